"""Load-time weight layouts for the weight GEMM kernels, and back to the checkpoint's (official) layout.

The official HF layout stays the import / export format (hf_import, hf_layout). The kernels of
pallas_kernels.moe and pallas_kernels.gemm read it as it is: the MXFP4 decoder (pallas_kernels.fp_decode) emits
each 32-bit word's 8 codes as two planes in a fixed k order, and the wrappers permute x's columns to match
(an [M, K] gather, fused by XLA into x's producer). The one alternative layout, `tiled`, moves the nibbles
instead, once: within each tile of `bk` k values (the kernel's bk), the decoded lo plane is the tile's first
bk/2 k values in order and the hi plane the last bk/2, so x needs no permutation. FP8 linears have no
alternative layout (the decoder reads e4m3 bytes as stored; scales stay [N/32, K/32]).

    to_tiled_mxfp4(packed [..., N, K/2] uint8, bk) -> tiled bytes (same shape)
    to_official_mxfp4(tiled, bk) -> packed        (bit-exact inverse; tests/kernels/test_fp_decode_and_layout.py)

Both are pure byte permutations (numpy on the host or jnp on a device, the same code): scales are unchanged.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.fp_decode import word_nibble_k


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def _codes(packed):
    xp = _xp(packed)
    p = packed.astype(xp.uint8)
    return xp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _pack(codes):
    return (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)


def _check(packed, bk: int):
    if packed.dtype != np.uint8 or bk < 128 or bk & (bk - 1) or (2 * packed.shape[-1]) % bk:
        raise ValueError(f"MXFP4 bytes {packed.shape} {packed.dtype}: need uint8 and K a multiple of bk={bk} "
                         "(a power of two >= 128)")


def to_tiled_mxfp4(packed, bk: int = 256):
    """Official packed E2M1 bytes (low nibble = even k) -> the tiled layout for a kernel with this bk."""
    _check(packed, bk)
    xp = _xp(packed)
    c = _codes(packed)
    lead, K = c.shape[:-1], c.shape[-1]
    src = word_nibble_k(bk, "tiled").reshape(-1)  # nibble slot -> the k it must hold
    c = c.reshape(*lead, K // bk, bk)[..., xp.asarray(src)]
    return _pack(c.reshape(*lead, K)).astype(xp.uint8)


def to_official_mxfp4(tiled, bk: int = 256):
    """Inverse of `to_tiled_mxfp4`."""
    _check(tiled, bk)
    xp = _xp(tiled)
    c = _codes(tiled)
    lead, K = c.shape[:-1], c.shape[-1]
    inv = np.argsort(word_nibble_k(bk, "tiled").reshape(-1))
    c = c.reshape(*lead, K // bk, bk)[..., xp.asarray(inv)]
    return _pack(c.reshape(*lead, K)).astype(xp.uint8)
