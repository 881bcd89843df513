"""Chained block hashes for prefix caching: hash_i fingerprints the whole prefix [0, 64(i+1)).

h_i = sha256(h_{i-1} || token ids of block i || cache_salt if i == 0); only full 64-token blocks are hashed.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dsv41_jax.kv_format import PAGE_TOKENS

BLOCK = PAGE_TOKENS  # one prefix-cache block per global-KV page
_ROOT = hashlib.sha256(b"dsv41-prefix-root").digest()


def block_hashes(tokens, cache_salt: str | None = None, parents: list[bytes] | None = None,
                 block: int = BLOCK) -> list[bytes]:
    """Hashes of full blocks, continuing from `parents` (the hashes already computed for the prefix); only the
    new blocks' tokens are read."""
    out = list(parents or [])
    i = len(out)
    while (i + 1) * block <= len(tokens):
        h = hashlib.sha256(out[-1] if out else _ROOT)
        h.update(np.asarray(tokens[i * block:(i + 1) * block], dtype=np.int64).tobytes())
        if i == 0 and cache_salt:
            h.update(b"salt:" + cache_salt.encode())
        out.append(h.digest())
        i += 1
    return out
