"""Rotary embeddings as the reference: interleaved pairs on the LAST rope_head_dim channels.

Compressed layers (ratio > 0) use compress_rope_theta with YaRN frequency interpolation (no mscale);
SWA-only layers use rope_theta without YaRN. The inverse rotation (conjugate) is applied to the
attention output at the query position.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_freqs(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
               beta_fast: int = 32, beta_slow: int = 1) -> np.ndarray:
    """[dim/2] float32 inverse frequencies, with YaRN interpolation when original_seq_len > 0."""
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(
        np.float32)
    if original_seq_len > 0:
        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
        smooth = (1 - ramp).astype(np.float32)
        freqs = (freqs / np.float32(factor) * (1 - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def layer_freqs(cfg, ratio: int) -> np.ndarray:
    if ratio:
        return rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                          cfg.beta_fast, cfg.beta_slow)
    return rope_freqs(cfg.rope_head_dim, cfg.rope_theta)


def apply_rope(x, pos, freqs, inverse: bool = False):
    """Rotate the last len(freqs)*2 channels of x [..., S, (H,) d] at integer positions pos [..., S].

    The rotation is computed in f32 and the result cast back to x.dtype (as the reference's in-place copy).
    """
    rd = freqs.shape[-1] * 2
    ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [..., S, rd/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    if x.ndim == pos.ndim + 2:  # heads axis
        cos, sin = cos[..., None, :], sin[..., None, :]
    r = x[..., -rd:].astype(jnp.float32).reshape(*x.shape[:-1], rd // 2, 2)
    a, b = r[..., 0], r[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rd)
    return jnp.concatenate([x[..., :-rd], out.astype(x.dtype)], axis=-1)
