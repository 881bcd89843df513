"""Typed inputs and outputs of the engine's compiled programs.

`ProgramKey` names a program (what it computes, for which bucket). `StepInputs` is the one pytree every
chunk/decode program takes besides the parameters and the device pools; the engine fills it from chunk
plans and the AOT compilation lowers the programs from `StepInputs.abstract(...)`, built by the same code,
so the two cannot disagree on fields or order. Results are a `StepOutputs` read by field name.

On the device all outputs of a program are packed into ONE int32 array [B, width] (floats bit-cast), so a
step costs one device-to-host transfer, started asynchronously right after dispatch (`PendingOutputs`) and
read when the engine needs it.

Speculative decoding adds `verify[B]` programs (kind VERIFY, `spec` = k drafts): B requests x (1 + k) rows, the
decoder band on every row, and the verification (serving/engine/spec_verify.py) on device. Their `StepOutputs`
carry a row axis: tokens / token_logprob [B, 1+k], top_* [B, 1+k, n], plus `n_accepted` [B].
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import ChunkInputs
from serving.engine.types import MAX_LOGPROBS

PREFILL, DECODE, VERIFY, SNAP_SAVE, SNAP_LOAD = "prefill", "decode", "verify", "snap_save", "snap_load"


@dataclass(frozen=True, order=True)
class ProgramKey:
    kind: str  # PREFILL | DECODE | VERIFY | SNAP_SAVE | SNAP_LOAD
    size: int  # prefill: tokens per chunk (bucket); decode / verify: batch (bucket); snapshots: 1
    decoder: str = "all"  # chunk_plan.DEC_NONE | DEC_WINDOW | DEC_ALL
    sample: bool = True
    all_logits: bool = False  # logits on every row: prompt logprobs
    spec: int = 0  # verify: draft rows per request (num_speculative_tokens)

    @property
    def batch(self) -> int:
        return self.size if self.kind in (DECODE, VERIFY) else 1

    @property
    def tokens(self) -> int:
        return {DECODE: 1, VERIFY: 1 + self.spec}.get(self.kind, self.size)

    @property
    def verify(self) -> bool:
        return self.kind == VERIFY

    def __str__(self) -> str:
        if self.kind in (SNAP_SAVE, SNAP_LOAD):
            return self.kind
        if self.kind == VERIFY:
            return f"{self.kind}[{self.size}]:k{self.spec}"
        extra = ("+sample" if self.sample else "") + ("+all_logits" if self.all_logits else "")
        return f"{self.kind}[{self.size}]:{self.decoder}{extra}"


@partial(jax.tree_util.register_dataclass,
         data_fields=["temperature", "top_k", "top_p", "min_p", "seed", "counter", "allowed", "next_ids"],
         meta_fields=[])
@dataclass(frozen=True)
class SamplingInputs:
    temperature: jax.Array  # [B] f32 (<= 0: greedy)
    top_k: jax.Array  # [B] int32 (<= 0: off)
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    seed: jax.Array  # [B] uint32
    counter: jax.Array  # [B] int32 sampling step of the request (RNG stream position)
    allowed: jax.Array  # [B, ceil(V/32)] uint32 bitmask of the tokens that may be sampled (all ones: any token)
    next_ids: jax.Array | None  # [B, T] int32 next prompt token of every row (prompt-logprob programs only)


@partial(jax.tree_util.register_dataclass, data_fields=["slots", "page_table", "chunk", "sampling"],
         meta_fields=[])
@dataclass(frozen=True)
class StepInputs:
    slots: jax.Array  # [B] int32 SWA ring / compressor slot of each row (the scratch slot for padding)
    page_table: jax.Array  # [B, max_pages] int32 global-KV pages (0 = the null page)
    chunk: ChunkInputs  # tokens, Engram rows, positions, clips, write_from
    sampling: SamplingInputs

    @staticmethod
    def host(B: int, T: int, max_pages: int, n_engram: int, n_cols: int, vocab: int, all_logits: bool,
             scratch_slot: int, engram_row_bytes: int = 0):
        """Default host (numpy) inputs for B rows of T tokens (greedy, unconstrained); padding rows use the
        scratch slot. `engram_row_bytes` > 0: host Engram tables, the programs take gathered rows (one uint8
        [B, T, n_cols, row_bytes] per Engram layer; serving.engine.engram_host fills them) instead of ids."""
        i32, f32 = np.int32, np.float32
        ids = np.zeros((B, T, n_engram, n_cols), i32) if n_engram and not engram_row_bytes else None
        rows = tuple(np.zeros((B, T, n_cols, engram_row_bytes), np.uint8) for _ in range(n_engram)) \
            if n_engram and engram_row_bytes else None
        chunk = ChunkInputs(np.zeros((B, T), i32), ids, np.zeros(B, i32), np.zeros(B, i32), np.zeros(B, i32),
                            np.zeros(B, i32), np.zeros(B, i32), rows)
        samp = SamplingInputs(np.zeros(B, f32), np.full(B, -1, i32), np.ones(B, f32), np.zeros(B, f32),
                              np.zeros(B, np.uint32), np.zeros(B, i32), np.full((B, mask_words(vocab)), ALL_BITS),
                              np.zeros((B, T), i32) if all_logits else None)
        return StepInputs(np.full(B, scratch_slot, i32), np.zeros((B, max_pages), i32), chunk, samp)

    @staticmethod
    def abstract(B: int, T: int, max_pages: int, n_engram: int, n_cols: int, vocab: int, all_logits: bool,
                 engram_row_bytes: int = 0):
        """The same structure as `host` with jax.ShapeDtypeStruct leaves (for AOT lowering)."""
        ex = StepInputs.host(B, T, max_pages, n_engram, n_cols, vocab, all_logits, 0, engram_row_bytes)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ex)


ALL_BITS = np.uint32(0xFFFFFFFF)


def mask_words(vocab: int) -> int:
    """uint32 words of a token bitmask over the vocabulary (bit t % 32 of word t // 32 = token t)."""
    return -(-vocab // 32)


@dataclass
class StepOutputs:
    """What a sampling program returns, per row (numpy once on the host). Verify programs: a row axis R = 1 + k
    after B on the first four fields, and `n_accepted`."""
    tokens: np.ndarray  # [B] int32 sampled token (verify: [B, R] the emitted tokens, -1 past the last)
    token_logprob: np.ndarray  # [B] f32 its logprob (raw distribution) (verify: [B, R])
    top_ids: np.ndarray  # [B, MAX_LOGPROBS] int32 (verify: [B, R, MAX_LOGPROBS])
    top_logprobs: np.ndarray  # [B, MAX_LOGPROBS] f32 (verify: [B, R, MAX_LOGPROBS])
    prompt_next_logprob: np.ndarray | None = None  # [B, T] f32 logprob of the next prompt token at every row
    prompt_top_ids: np.ndarray | None = None  # [B, T, MAX_LOGPROBS] int32
    prompt_top_logprobs: np.ndarray | None = None  # [B, T, MAX_LOGPROBS] f32
    n_accepted: np.ndarray | None = None  # verify: [B] int32 drafts accepted (tokens[:, :n_accepted + 1] emitted)
    drafts: np.ndarray | None = None  # DSpark: [B, k] int32 the draft's next proposal (verified by the next step)


def _layout(B: int, T: int, all_logits: bool, verify: bool = False, drafts: int = 0):
    """(field, per-row shape, dtype) in packing order."""
    n = MAX_LOGPROBS
    extra = [("drafts", (drafts,), np.int32)] if drafts else []
    if verify:
        return [("tokens", (T,), np.int32), ("token_logprob", (T,), np.float32), ("top_ids", (T, n), np.int32),
                ("top_logprobs", (T, n), np.float32), ("n_accepted", (), np.int32), *extra]
    out = [("tokens", (), np.int32), ("token_logprob", (), np.float32), ("top_ids", (n,), np.int32),
           ("top_logprobs", (n,), np.float32), *extra]
    if all_logits:
        out += [("prompt_next_logprob", (T,), np.float32), ("prompt_top_ids", (T, n), np.int32),
                ("prompt_top_logprobs", (T, n), np.float32)]
    return out


def packed_width(T: int, all_logits: bool, verify: bool = False, drafts: int = 0) -> int:
    """int32 columns of a program's packed outputs (`pack_outputs`); column 0 holds the sampled tokens."""
    return sum(int(np.prod(shape)) for _, shape, _ in _layout(1, T, all_logits, verify, drafts))


def pack_outputs(out: StepOutputs, T: int, all_logits: bool, verify: bool = False, drafts: int = 0) -> jax.Array:
    """Device side: every field of `out` (jax arrays) into one int32 [B, width] array."""
    parts = []
    for name, _, dt in _layout(out.tokens.shape[0], T, all_logits, verify, drafts):
        x = getattr(out, name)
        x = x.astype(jnp.int32) if dt == np.int32 else jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
        parts.append(x.reshape(x.shape[0], -1))
    return jnp.concatenate(parts, axis=1)


def unpack_outputs(packed: np.ndarray, T: int, all_logits: bool, verify: bool = False,
                   drafts: int = 0) -> StepOutputs:
    """Host side: the inverse of `pack_outputs` on the transferred numpy array."""
    B = packed.shape[0]
    vals, off = {}, 0
    if packed.shape[1] != packed_width(T, all_logits, verify, drafts):
        raise ValueError(f"packed output width {packed.shape[1]} does not match the layout "
                         f"({packed_width(T, all_logits, verify, drafts)})")
    for name, shape, dt in _layout(B, T, all_logits, verify, drafts):
        w = int(np.prod(shape))
        col = packed[:, off:off + w]
        off += w
        vals[name] = (col if dt == np.int32 else col.view(np.float32)).reshape((B, *shape))
    return StepOutputs(**vals)


class PendingOutputs:
    """A program's packed outputs on their way to the host (the copy starts at construction)."""

    def __init__(self, packed: jax.Array, T: int, all_logits: bool, verify: bool = False, drafts: int = 0):
        self.packed = packed
        self.T, self.all_logits, self.verify, self.drafts = T, all_logits, verify, drafts
        packed.copy_to_host_async()
        self._host: StepOutputs | None = None

    def get(self) -> StepOutputs:
        if self._host is None:
            self._host = unpack_outputs(np.asarray(self.packed), self.T, self.all_logits, self.verify, self.drafts)
        return self._host


if {f.name for f in fields(StepOutputs)} != {n for v in (False, True) for n, _, _ in _layout(1, 1, True, v, 1)}:
    raise ImportError("StepOutputs and its packing layout disagree")
