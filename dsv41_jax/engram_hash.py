"""Engram n-gram hashing (docs/ARCHITECTURE.md): integer-only, from token ids alone, so it runs on the host.

For position t, the compressed ids of tokens t, t-1, ..., t-(n-1) are multiplied by per-(layer, lookback)
odd multipliers and XOR-folded; the running value after k lookbacks is the (k+1)-gram hash, reduced modulo a
prime per (n-gram size, head) and shifted into that prime's disjoint row range of the layer's table.
A lookback before the sequence start (history slot -1) becomes the pad token's compressed id and blocks all
older lookbacks too. All arithmetic is int64, exactly as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(start: int, seen: set[int]) -> int:
    c = start + 1
    while not is_prime(c) or c in seen:
        c += 1
    return c


@dataclass(frozen=True)
class EngramLayout:
    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]  # [layer][ngram size - 2][head]

    @property
    def n_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        return tuple(sum(p for per in layer for p in per) for layer in self.primes)

    def offsets(self) -> np.ndarray:
        """[n_layers, n_cols] first row of each (n-gram size, head) range."""
        out = []
        for layer in self.primes:
            flat = [p for per in layer for p in per]
            out.append(np.cumsum([0, *flat[:-1]]))
        return np.asarray(out, dtype=np.int64)


@lru_cache(maxsize=16)
def _layout(layer_ids, max_ngram, n_heads, head_dim, vocab) -> EngramLayout:
    seen: set[int] = set()
    primes = []
    for _ in layer_ids:
        per_ngram = []
        for _ in range(max_ngram - 1):
            cur, sizes = vocab - 1, []
            for _ in range(n_heads):
                cur = next_unused_prime(cur, seen)
                seen.add(cur)
                sizes.append(cur)
            per_ngram.append(tuple(sizes))
        primes.append(tuple(per_ngram))
    return EngramLayout(tuple(layer_ids), max_ngram, n_heads, head_dim, tuple(primes))


def layout_for(cfg) -> EngramLayout | None:
    if not cfg.engram_layer_ids:
        return None
    return _layout(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                   cfg.engram_head_dim, cfg.engram_vocab_size)


def hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab: int) -> np.ndarray:
    """[n_layers, max_ngram_size] odd int64 multipliers from np.random.default_rng(10007 * layer)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for lid in layer_ids:
        g = np.random.default_rng(10007 * lid)
        rows.append(g.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1)
    return np.stack(rows)


class EngramHasher:
    """Maps token ids to Engram table rows: ``ids[B, T, n_engram_layers, n_cols]`` (int32)."""

    def __init__(self, cfg, token_map: np.ndarray | None = None):
        self.layout = layout_for(cfg)
        if self.layout is None:
            raise ValueError("config has no Engram layers")
        if token_map is None:
            if cfg.engram_compressed_vocab_size != cfg.vocab_size:
                raise ValueError(
                    "Engram needs the tokenizer's compressed token map (compressed vocab "
                    f"{cfg.engram_compressed_vocab_size} != vocab {cfg.vocab_size}); pass token_map")
            token_map = np.arange(cfg.vocab_size, dtype=np.int64)
        token_map = np.asarray(token_map, dtype=np.int64)
        if token_map.shape != (cfg.vocab_size,) or token_map.max() >= cfg.engram_compressed_vocab_size:
            raise ValueError("token_map must map every vocab id into [0, engram_compressed_vocab_size)")
        self.token_map = token_map
        self.n = self.layout.max_ngram_size
        self.pad = int(token_map[cfg.engram_pad_id])
        self.mult = hash_multipliers(self.layout.layer_ids, self.n, cfg.engram_compressed_vocab_size)
        self.primes = np.asarray(self.layout.primes, dtype=np.int64)  # [E, n-1, heads]
        self.offsets = self.layout.offsets()  # [E, n_cols]

    def empty_history(self, batch: int) -> np.ndarray:
        return np.full((batch, self.n - 1), -1, dtype=np.int64)

    def compress(self, tokens) -> np.ndarray:
        return self.token_map[np.asarray(tokens, dtype=np.int64)]

    def hash_ids(self, tokens, history=None) -> np.ndarray:
        """tokens [B, T] raw ids; history [B, n-1] compressed ids of the preceding tokens (oldest first),
        -1 where the sequence had not started. Returns int32 [B, T, E, n_cols]."""
        prod = self._products(tokens, history)  # [B, T, E, n]
        rolling = prod[..., 0]
        cols = []
        for i in range(1, self.n):
            rolling = np.bitwise_xor(rolling, prod[..., i])
            cols.append(rolling[..., None] % self.primes[None, None, :, i - 1, :])
        ids = np.concatenate(cols, axis=-1) + self.offsets[None, None]
        return ids.astype(np.int32)

    def _products(self, tokens, history) -> np.ndarray:
        """[B, T, E, n] int64: each position's lookback k (k = 0: its own token; padded from the first missing
        lookback on) times the layer's multiplier k."""
        tokens = np.asarray(tokens, dtype=np.int64)
        B, T = tokens.shape
        hist = self.empty_history(B) if history is None else np.asarray(history, dtype=np.int64)
        full = np.concatenate([hist, self.compress(tokens)], axis=1)  # [B, n-1+T]
        h = self.n - 1
        blocked = np.zeros((B, T), dtype=bool)
        grams = []
        for k in range(self.n):
            src = full[:, h - k: h - k + T]
            blocked = blocked | (src < 0)
            grams.append(np.where(blocked, self.pad, src))
        grams = np.stack(grams, axis=-1)  # [B, T, n]
        return grams[:, :, None, :] * self.mult[None, None]

    def lookback_xor(self, history) -> np.ndarray:
        """[B, E, n-1] int64 for the position after `history` whose own token is not known yet: for n-gram size
        k + 1, the XOR of lookbacks 1..k's products. `hash_ids` XORs the token's own product (its compressed id
        times multiplier 0) into these before the modulo (serving/engine/device_tokens.py does it on the device)."""
        hist = np.asarray(history, dtype=np.int64)
        prod = self._products(np.zeros((hist.shape[0], 1), np.int64), hist)[:, 0]  # own token: a placeholder
        return np.bitwise_xor.accumulate(prod[..., 1:], axis=-1)

    def next_history(self, history, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        B = tokens.shape[0]
        hist = self.empty_history(B) if history is None else np.asarray(history, dtype=np.int64)
        full = np.concatenate([hist, self.compress(tokens)], axis=1)
        return full[:, full.shape[1] - (self.n - 1):]
