"""Load-time weight layouts for the weight GEMM kernels, and back to the checkpoint's (official) layout.

One layout per GEMM kind (the `fmt` of dsv41_jax.params.tensor_specs), named where the kernels pick their blocks:

- "exp" (MXFP4 routed experts): `pallas_kernels.moe.block_sizes.MXFP4_LAYOUT`, "official" today. The FP8-dot MoE
  kernels (pallas_kernels/moe/fp8_kernel.py) read the checkpoint's bytes as they are: a 32-bit word's low nibbles
  become one E4M3 plane (even k) and its high nibbles another (odd k) with ~5 integer ops per 8 weights, and x is
  split into even / odd columns to match, so no byte move can make that decode shorter. The bf16 decoder
  (decode "bf16x2") reads either "official" (x's columns permuted per tile) or "tiled": within each tile of
  TILED_BK k values the nibbles are moved once so that its two decoded planes come out in k order.
- "lin" (FP8 block-32 linears): "official" only: the FP8-dot kernels feed the E4M3 bytes to the tensor core as
  stored and read the [N/32, K/32] scales per 32x32 tile.

The official HF layout stays the import / export format (hf_import, hf_layout, orbax_io save official bytes):

    to_kernel_layout(cfg, params, layouts=None) -> params    (every "exp" / "lin" leaf in its kind's layout)
    to_official_layout(cfg, params, layouts=None) -> params  (the inverse, bit-exact; before saving / --kernels xla)
    to_tiled_mxfp4(packed [..., N, K/2] uint8, bk) / to_official_mxfp4(tiled, bk)  (one leaf; numpy or jnp)

The LM head: the checkpoint stores it in bf16 and the model's tree holds it in f32 (the reference computes the
head in f32, and training keeps f32 masters). `head_as_stored(params)` gives the serving tree the checkpoint's bf16
back when every value is a bf16 (after an HF import or `random_init`; a training master may not be): the same
values in half the bytes, which the Pallas head reads (dsv41_jax.ops.lm_head).

A converted tree is for the Pallas kernels only (the XLA reference ops read official bytes): `checkpoints.load(...,
kernel_layout=True)` converts after loading. Conversions are byte permutations within each row's K / 2 bytes: leaf
shapes, dtypes and shardings (rows / experts / layers) are kept, scales are untouched.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.fp_decode import word_nibble_k
from pallas_kernels.gemm.block_sizes import FP8_LAYOUT
from pallas_kernels.moe.block_sizes import MXFP4_LAYOUT, TILED_BK

LAYOUTS = {"exp": ("official", "tiled"), "lin": ("official",)}


def kernel_layouts() -> dict[str, str]:
    """The layout each GEMM kind is converted to at load (what the default blocks read)."""
    return {"exp": MXFP4_LAYOUT, "lin": FP8_LAYOUT}


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


def to_tiled_mxfp4(packed, bk: int = TILED_BK):
    """Official packed E2M1 bytes (low nibble = even k) -> the tiled layout for a kernel with this bk."""
    _check(packed, bk)
    xp = _xp(packed)
    c = _codes(packed)
    lead, K = c.shape[:-1], c.shape[-1]
    src = word_nibble_k(bk, "tiled").reshape(-1)  # nibble slot -> the k it must hold
    c = c.reshape(*lead, K // bk, bk)[..., xp.asarray(src)]
    return _pack(c.reshape(*lead, K)).astype(xp.uint8)


def to_official_mxfp4(tiled, bk: int = TILED_BK):
    """Inverse of `to_tiled_mxfp4`."""
    _check(tiled, bk)
    xp = _xp(tiled)
    c = _codes(tiled)
    lead, K = c.shape[:-1], c.shape[-1]
    inv = np.argsort(word_nibble_k(bk, "tiled").reshape(-1))
    c = c.reshape(*lead, K // bk, bk)[..., xp.asarray(inv)]
    return _pack(c.reshape(*lead, K)).astype(xp.uint8)


_TO = {("exp", "tiled"): to_tiled_mxfp4}
_FROM = {("exp", "tiled"): to_official_mxfp4}


def _convert(cfg, params, layouts, table):
    """Apply table[(kind, layout)] to the weight leaf of every tensor of that kind (identity where absent),
    on each leaf's own device(s); returns a new tree (the input's leaves are not modified)."""
    import jax

    from dsv41_jax.params import tensor_specs

    layouts = kernel_layouts() if layouts is None else layouts
    for kind, name in layouts.items():
        if name not in LAYOUTS.get(kind, ()):
            raise ValueError(f"layout {name!r} for {kind!r}: one of {LAYOUTS.get(kind)}")
    if cfg.weight_format != "fp8":
        return params
    out = jax.tree.map(lambda x: x, params)  # new containers, same leaves
    for path, t in tensor_specs(cfg).items():
        fn = table.get((t.fmt, layouts.get(t.fmt, "official")))
        if fn is None:
            continue
        node = out
        for k in path:
            node = node[k]
        w = node["weight"]
        node["weight"] = jax.jit(fn, out_shardings=getattr(w, "sharding", None))(w)
    return out


def to_kernel_layout(cfg, params, layouts: dict | None = None):
    """Every GEMM weight of an fp8-format tree in its kind's kernel layout (`kernel_layouts()` by default)."""
    return _convert(cfg, params, layouts, _TO)


def to_official_layout(cfg, params, layouts: dict | None = None):
    """The inverse of `to_kernel_layout` with the same layouts: the checkpoint's bytes again (bit-exact)."""
    return _convert(cfg, params, layouts, _FROM)


def head_as_stored(params):
    """(tree, converted): the tree with the LM head in bf16 when its f32 values are all bf16 (exact: no value
    changes), else the tree as given. New containers; the input tree and its leaves are not modified. Abstract
    leaves (jax.ShapeDtypeStruct: lowering only) are taken as convertible."""
    import jax
    import jax.numpy as jnp

    w = params.get("head", {}).get("weight")
    if w is None or w.dtype != jnp.float32:
        return params, False
    sharding = getattr(w, "sharding", None)
    if isinstance(w, jax.ShapeDtypeStruct):
        wb = jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=sharding)
    else:
        wb = jax.jit(lambda a: a.astype(jnp.bfloat16), out_shardings=sharding)(w)
        if not bool(jax.jit(lambda a, b: jnp.array_equal(a, b.astype(jnp.float32)))(w, wb)):
            return params, False
    out = dict(params)
    out["head"] = {**params["head"], "weight": wb}
    return out, True
