"""Async scheduling's token feedback: a decode row takes its input token from the device, not the host.

With async scheduling (EngineArgs.async_scheduling) the engine dispatches step j before it collects step j-1,
so the token that step j-1 samples for a request is still on the device when step j's inputs are filled. This
module keeps it there:

- `DeviceTokens.record(pending, slots)`: after every sampling call, one small program scatters the call's sampled
  tokens (column 0 of its packed outputs, serving.engine.step_io) into `last`, a device vector indexed by the
  request's ring slot (the scratch slot S takes the padding rows).
- `DeviceTokens.patch(inp, rows)`: before a decode call, one small program replaces the marked rows' tokens with
  `last[slot]`, and, for a model with device Engram tables, their Engram rows (`EngramFeedback`).

Both run on the device stream in dispatch order, so a row always reads the token of the call dispatched last for
its slot. A row is marked only when its token is the one still in flight (its position = len(req.tokens)); the
host knows every older token.

The Engram rows of such a row hash the unknown token with the known ones (dsv41_jax.engram_hash, int64 on the
host). On the device, without int64: the host sends, per (layer, n-gram size), the XOR of the known lookbacks'
products as two uint32 words; the unknown token's product c * m0 comes from a [layers, compressed vocab] table of
uint32 pairs; the 64-bit value is reduced modulo each head's prime by a byte-wise Horner scheme in uint32 (exact
for primes < 2^24), and the floor modulo of a negative int64 (numpy's `%`) by subtracting 2^64 mod p. The result
equals `EngramHasher.hash_ids` (tests/test_device_tokens.py).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.step_io import DECODE, PREFILL, PendingOutputs, packed_width

MAX_PRIME = 1 << 24  # the Horner reduction's bound: acc * 256 + 255 < 2^32


def _split64(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 -> (high, low) uint32 words of its two's-complement bits."""
    u = np.asarray(v, np.int64).view(np.uint64)
    return (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)


class EngramFeedback:
    """Device Engram rows of a decode row whose token is on the device (the module docstring)."""

    def __init__(self, hasher):
        self.h = hasher
        self.n = hasher.n
        if int(hasher.primes.max()) >= MAX_PRIME:
            raise ValueError(f"Engram primes up to {int(hasher.primes.max())}: the device hash needs < {MAX_PRIME}")
        c = np.arange(int(hasher.token_map.max()) + 1, dtype=np.int64)
        hi, lo = _split64(c[None, :] * hasher.mult[:, :1])  # [E, Cv]: c * m0 of each layer
        self.p_hi, self.p_lo = jnp.asarray(hi), jnp.asarray(lo)
        self.token_map = jnp.asarray(hasher.token_map.astype(np.int32))
        primes = hasher.primes.astype(np.uint64)  # [E, n-1, H]
        self.primes = jnp.asarray(primes.astype(np.uint32))
        two64 = (np.uint64(1 << 63) % primes) * np.uint64(2) % primes  # 2^64 mod p, in uint64 without overflow
        self.two64 = jnp.asarray(two64.astype(np.uint32))
        self.offsets = jnp.asarray(hasher.offsets.astype(np.int32))  # [E, n_cols]

    def known(self, history: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """history [B, n-1] compressed ids before the unknown token -> `EngramHasher.lookback_xor` as (high, low)
        uint32 words [B, E, n-1]."""
        return _split64(self.h.lookback_xor(history))

    def ids(self, tokens, known_hi, known_lo):
        """Device: tokens [B] int32, known words [B, E, n-1] -> Engram rows [B, E, n_cols] int32."""
        c = self.token_map[tokens]  # [B]
        hi = self.p_hi[:, c].T[:, :, None] ^ known_hi  # [B, E, n-1]
        lo = self.p_lo[:, c].T[:, :, None] ^ known_lo
        p = self.primes[None]  # [1, E, n-1, H]
        acc = jnp.zeros(hi.shape + (p.shape[-1],), jnp.uint32)
        for word in (hi, lo):
            for shift in (24, 16, 8, 0):
                byte = ((word >> shift) & 0xFF)[..., None]
                acc = (acc * 256 + byte) % p
        neg = (hi >> 31)[..., None] == 1  # the int64 was negative: floor modulo
        acc = jnp.where(neg, (acc + p - self.two64[None]) % p, acc)
        B, E = acc.shape[:2]
        return acc.reshape(B, E, -1).astype(jnp.int32) + self.offsets[None]


class DeviceTokens:
    """The sampled token of each slot's last sampling call, on the device, and the decode inputs patched from it."""

    def __init__(self, n_slots: int, hasher=None):
        self.last = jnp.zeros(n_slots, jnp.int32)
        self.engram = EngramFeedback(hasher) if hasher is not None else None
        self._record = jax.jit(_scatter_tokens, donate_argnums=(0,))
        self._patch = jax.jit(partial(_patch_rows, self.engram))

    def record(self, pending, slots: np.ndarray):
        """After a sampling call: its rows' tokens into `last[slots]` (padding rows: the scratch slot)."""
        self.last = self._record(self.last, pending.packed, np.asarray(slots, np.int32))

    def patch(self, inp, rows: list[int], history: np.ndarray | None = None):
        """Decode inputs (host numpy) -> the same with `rows`' tokens (and Engram rows) taken from the device.
        history: [len(rows), n-1] compressed ids before each row's token (Engram models)."""
        B = inp.slots.shape[0]
        mask = np.zeros(B, bool)
        mask[rows] = True
        c = inp.chunk
        if self.engram is None or c.engram_ids is None:
            tokens = self._patch(self.last, inp.slots, mask, c.tokens, None, None, None)
            return replace(inp, chunk=replace(c, tokens=tokens))
        E, k = self.engram.p_hi.shape[0], self.engram.n - 1
        hi, lo = np.zeros((B, E, k), np.uint32), np.zeros((B, E, k), np.uint32)
        hi[rows], lo[rows] = self.engram.known(history)
        tokens, ids = self._patch(self.last, inp.slots, mask, c.tokens, c.engram_ids, hi, lo)
        return replace(inp, chunk=replace(c, tokens=tokens, engram_ids=ids))

    def warm(self, runner):
        """Compile the scatter of every sampling program and the patch of every decode program (by running them
        on zeros), so that none compiles while serving."""
        for key in runner.programs:
            if key.kind not in (DECODE, PREFILL) or not key.sample:
                continue
            inp = runner.inputs(key)
            width = packed_width(key.tokens, key.all_logits, drafts=runner.draft_tokens(key))
            packed = jnp.zeros((inp.slots.shape[0], width), jnp.int32)
            self.record(PendingOutputs(packed, key.tokens, key.all_logits), inp.slots)
            if key.kind == DECODE:
                hist = None if self.engram is None else np.full((1, self.engram.n - 1), -1, np.int64)
                jax.block_until_ready(self.patch(inp, [0], hist).chunk.tokens)
        jax.block_until_ready(self.last)


def _scatter_tokens(last, packed, slots):
    return last.at[slots].set(packed[:, 0])


def _patch_rows(engram, last, slots, mask, tokens, engram_ids, known_hi, known_lo):
    dev = last[slots]  # [B]
    new = tokens.at[:, 0].set(jnp.where(mask, dev, tokens[:, 0]))
    if engram_ids is None:
        return new
    ids = engram.ids(dev, known_hi, known_lo)  # [B, E, n_cols]
    return new, engram_ids.at[:, 0].set(jnp.where(mask[:, None, None], ids, engram_ids[:, 0]))
