"""Paged sparse attention: the Pallas kernel (interpret mode, GPU-legal blocks) matches the one jnp reference (the
ops seam's XLA branch: window over the packed rings, latents through PagedKV, the model's sparse_attention) at
several shapes, ignores poisoned bytes of masked entries, writes every output element, and
lowers for the H200 at the full shape."""
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ops, quant
from dsv41_jax.kv_cache import KVState, PagedGlobal, PagedKV, PageLayout, SwaPool
from dsv41_jax.kv_format import PAGE_TOKENS
from dsv41_jax.ops import ExecContext
from pallas_kernels import common
from pallas_kernels.sparse_attention import (
    BlockSizes,
    PagedAttentionKV,
    SparseAttentionOperands,
    paged_sparse_attention,
)

INTERPRET = jax.default_backend() == "cpu"  # on a GPU (JAX_PLATFORMS=cuda) the kernels run compiled

POISON = 0xFF
BANK = 2048


@functools.cache
def _banks(d):
    """Real encodings of normal samples, made once per head dim (fixed shapes: one compile each):
    FP8 ring entries [BANK, d + d/32], their values [BANK, d] f32, FP4 latent entries [BANK, d/2 + d/16]."""
    x = jax.random.normal(jax.random.key(d), (2, BANK, d), jnp.float32)
    qb, codes = jax.jit(lambda v: quant.fp8_pack(v, 32))(x[0])
    vals = jax.jit(lambda v: quant.fp8_qdq(v, 32))(x[0])
    pk, sb = jax.jit(lambda v: quant.fp4_pack(v, 16, "e4m3"))(x[1])
    return (np.concatenate([np.asarray(qb), np.asarray(codes)], -1), np.asarray(vals),
            np.concatenate([np.asarray(pk), np.asarray(sb)], -1))


SRC = 1  # pages hold two latent regions (we read the second) and a small trailing index region


def _layout(ratio, d):
    n, eb = PAGE_TOKENS // ratio, d // 2 + d // 16
    regions = ((("lat", ratio, 0), (0, n, eb)), (("lat", ratio, 1), (n * eb, n, eb)),
               (("idx", ratio, 0), (2 * n * eb, n, 2)))
    return PageLayout(regions, 2 * n * eb + 2 * n, "fp4", d, 4)


def make_case(seed, *, B, T, H, d, k, ratio, pos0, clip, W=128, L=2, layer=1, with_sel=True, poison=True):
    """Random inputs for paged_sparse_attention. Every byte no valid key reads is 0xFF (NaN scales) when
    `poison`, else random valid-looking data; valid entries are real FP8/FP4 encodings of normal samples."""
    rng = np.random.default_rng(seed)
    pos0 = np.asarray(pos0, np.int32)
    clip = np.asarray(clip, np.int32)
    R = B + 2
    ring_slot = rng.permutation(R)[:B].astype(np.int32)

    fp8_bank, fp8_vals, fp4_bank = _banks(d)
    ring = fp8_bank[rng.integers(0, BANK, (L, R, W))]
    if poison:
        ring[:, np.setdiff1d(np.arange(R), ring_slot)] = POISON
        for b in range(B):  # slot s holds the latest p < pos0 with p % W == s; unread when p < max(clip, 0)
            s = np.arange(W)
            p = (pos0[b] - 1) - np.mod(pos0[b] - 1 - s, W)
            ring[layer, ring_slot[b], (p < 0) | (p < clip[b])] = POISON
    chunk = fp8_vals[rng.integers(0, BANK, (B, T))]

    lay = _layout(ratio, d)
    n, eb = PAGE_TOKENS // ratio, d // 2 + d // 16
    region = lay.region("lat", ratio, SRC)[0]
    max_pages = max(-(-(int(p0) + T) // PAGE_TOKENS) for p0 in pos0) + 1  # >= 1 padding column
    n_pages = B * max_pages + 2
    pages = rng.integers(0, 256, (n_pages, lay.page_bytes), dtype=np.uint8)
    table = np.zeros((B, max_pages), np.int32)  # column padding -> null page 0
    sel = None
    if with_sel:
        if poison:
            pages[:] = POISON
        perm = rng.permutation(np.arange(1, n_pages))
        sel = np.full((B, T, k), -1, np.int32)
        ent_bytes = fp4_bank[rng.integers(0, BANK, (B, max_pages * n))]
        for b in range(B):
            n_tok = pos0[b] + T
            used = -(-n_tok // PAGE_TOKENS)
            table[b, :used] = perm[b * max_pages: b * max_pages + used]
            for ent in range(n_tok // ratio):  # every existing entry of source SRC
                off = region + (ent % n) * eb
                pages[table[b, ent // n], off:off + eb] = ent_bytes[b, ent]
            for i in range(T):
                vis = (pos0[b] + i + 1) // ratio
                m = min(k, vis)
                pick = np.sort(rng.choice(vis, m, replace=False)) if m else np.zeros(0, np.int32)
                sel[b, i, :m] = pick
                sel[b, i, rng.random(k) < 0.15] = -1  # some holes anywhere in the list
    q = jnp.asarray(rng.normal(size=(B, T, H, d)) * 2.0, jnp.bfloat16)
    sink = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    args = (q, jnp.asarray(chunk, jnp.bfloat16), jnp.asarray(ring), jnp.int32(layer), jnp.asarray(ring_slot),
            jnp.asarray(pos0), jnp.asarray(clip), jnp.asarray(pages), jnp.asarray(table),
            None if sel is None else jnp.asarray(sel), jnp.int32(region), sink)
    return args, dict(ratio=ratio, scale=d ** -0.5)


def bundles(args, ratio, freqs=None):
    """The positional case as the kernel's operand bundles (what ops builds from the model's operands)."""
    q, chunk, ring, layer, ring_slot, pos0, clip, pages, table, sel, region, sink = args
    d = q.shape[-1]
    a = SparseAttentionOperands(q=q, chunk_kv=chunk, pos0=pos0, clip=clip, sel=sel, sink=sink, layer=layer,
                                src=jnp.int32(SRC), ratio=ratio, freqs=freqs)
    kv = PagedAttentionKV(ring=ring, ring_slot=ring_slot, pages=pages, page_table=table, region=region,
                          page_tokens=PAGE_TOKENS, entry_bytes=d // 2 + d // 16)
    return a, kv


def ref(args, kw, freqs=None):
    """The one reference: the ops seam's XLA branch (window over the packed rings, selected latents through
    PagedKV, then dsv41_jax.attention.sparse_attention, then the inverse RoPE with `freqs`) on the same operands."""
    return _xla(args, kw["ratio"], kw["scale"], freqs)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _xla(args, ratio, scale, freqs=None):
    q, chunk, ring, layer, ring_slot, pos0, clip, pages, table, sel, region, sink = args
    d, W = q.shape[-1], ring.shape[2]
    cfg = SimpleNamespace(qdq=True, head_dim=d, compute_dtype="bfloat16", window_size=W)
    a, _ = bundles(args, ratio, freqs)
    assert scale == d ** -0.5  # the seam's scale
    ex = ExecContext(kv=PagedKV(_layout(ratio, d), "bfloat16"))
    state = KVState(SwaPool(ring, ring_slot), PagedGlobal(pages, table), None)
    return ops.csa_attention(ex, cfg, a, state)


def _assert_close(got, want, exact=0.99):
    """Kernel contract: every element within 1 bf16 ulp of max|ref| over its row's heads; a fraction `exact` of
    elements bit-identical (one split: >= 99%; splits re-round probabilities against their own max: >= 75%)."""
    g = np.asarray(got, np.float32)
    w = np.asarray(want, np.float32)
    assert np.isfinite(g).all(), "non-finite output"
    amax = np.abs(w).max(axis=(-2, -1), keepdims=True)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(amax, 1e-30))) - 7)
    err = np.abs(g - w)
    assert (err <= ulp).all(), f"max err / ulp = {(err / ulp).max()}"
    assert (g == w).mean() >= exact, f"exact fraction {(g == w).mean()}"


def _run(args, kw, freqs=None, **opts):
    fn = functools.partial(paged_sparse_attention, scale=kw["scale"], interpret=INTERPRET, _poison_out=True, **opts)
    return jax.jit(fn)(*bundles(args, kw["ratio"], freqs))


SMALL = dict(H=16, d=64, k=128)


def _f32(x):
    return np.asarray(x, np.float32)


def test_reference_is_nontrivial():
    cases = [dict(ratio=1, T=4, pos0=[150, 3], clip=[0, 0]), dict(ratio=2, T=1, pos0=[300, 70], clip=[200, 0]),
             dict(ratio=1, T=2, pos0=[40, 200], clip=[0, 150], with_sel=False)]
    for seed, c in enumerate(cases):
        args, kw = make_case(seed, B=2, **c, **SMALL)
        want = _f32(ref(args, kw))
        assert np.isfinite(want).all() and np.abs(want).max() > 0.1


@pytest.mark.parametrize("ratio,T,pos0,clip,splits", [
    (1, 1, [700, 5], [0, 0], 1),  # decode; row 1 mostly empty window, sel shorter than k
    (2, 4, [250, 60], [180, 0], 3),  # chunk rows after ring rows in the last window chunk, clip > 0, split merge
    (1, 20, [64, 1], [10, 5], 1),  # 32-row chunk tile; sequence 1: clip inside the chunk rows
    (2, 72, [40], [0], 2),  # T > 64: chunk rows span both window chunks (full-tile merge path)
])
def test_kernel_matches_ref(ratio, T, pos0, clip, splits):
    B = len(pos0)
    args, kw = make_case(10 + ratio, B=B, T=T, ratio=ratio, pos0=pos0, clip=clip, **SMALL)
    got = _run(args, kw, block_sizes=BlockSizes(block_h=16, num_splits=splits))
    _assert_close(got, ref(args, kw), 0.99 if splits == 1 else 0.75)


@pytest.mark.parametrize("splits", [1, 3])
def test_inverse_rope_in_the_epilogue(splits):
    """With the layer's RoPE frequencies the output leaves inverse-rotated (the model's apply_rope(inverse=True));
    one split rotates in the kernel's epilogue, several after the XLA merge."""
    from dsv41_jax.rope import rope_freqs

    args, kw = make_case(21, B=2, T=2, ratio=2, pos0=[900, 37], clip=[0, 0], **SMALL)
    freqs = jnp.asarray(rope_freqs(16, 160000.0, 4096, 16.0))  # the last 16 of d = 64 channels rotate
    got = _run(args, kw, freqs, block_sizes=BlockSizes(block_h=16, num_splits=splits))
    want = ref(args, kw, freqs)
    assert not np.array_equal(_f32(want), _f32(ref(args, kw)))  # the rotation moves the output
    _assert_close(got, want, 0.99 if splits == 1 else 0.75)


def test_kernel_int_decode_padded_heads_swa_only():
    """Integer decoders; H=8 padded to a 16-head block with 2 splits over an SWA-only key list (2 chunks); then
    k = 96 (sel padded to 128 with -1)."""
    args, kw = make_case(3, B=1, T=2, H=8, d=64, k=64, ratio=1, pos0=[130], clip=[40], with_sel=False)
    got = _run(args, kw, decode="int", block_sizes=BlockSizes(num_splits=2))
    _assert_close(got, ref(args, kw), 0.75)
    args, kw = make_case(4, B=1, T=1, H=16, d=64, k=96, ratio=2, pos0=[520], clip=[0])  # k % 64 != 0
    _assert_close(_run(args, kw, decode="int", block_sizes=BlockSizes(num_splits=1)), ref(args, kw))


def test_poisoned_masked_bytes_do_not_leak():
    """0xFF (NaN-scale) bytes in unused pages / ring slots change nothing: same output as random filler.
    Sequence 2 (position 0, ratio 2) has no compressed entry yet: its -1 selections point into a poisoned page."""
    base = dict(B=3, T=1, ratio=2, pos0=[300, 90, 0], clip=[240, 0, 0], **SMALL)
    a_clean, kw = make_case(5, poison=False, **base)
    a_pois, _ = make_case(5, poison=True, **base)
    bs = BlockSizes(block_h=16, num_splits=2)
    clean, pois = _f32(_run(a_clean, kw, block_sizes=bs)), _f32(_run(a_pois, kw, block_sizes=bs))
    assert np.isfinite(pois).all()
    np.testing.assert_array_equal(clean, pois)
    want = _f32(ref(a_pois, kw))
    np.testing.assert_array_equal(want, _f32(ref(a_clean, kw)))
    _assert_close(pois, want, 0.75)


def _abstract_full(B, T, with_sel=True, n_pages=64, max_pages=128):
    sds = jax.ShapeDtypeStruct
    H, d, W, k, L, R = 64, 512, 128, 512, 40, 8
    lay = _layout(1, d)
    i32 = jnp.int32
    return (sds((B, T, H, d), jnp.bfloat16), sds((B, T, d), jnp.bfloat16), sds((L, R, W, d + d // 32), jnp.uint8),
            sds((), i32), sds((B,), i32), sds((B,), i32), sds((B,), i32), sds((n_pages, lay.page_bytes), jnp.uint8),
            sds((B, max_pages), i32), sds((B, T, k), i32) if with_sel else None, sds((), i32), sds((H,), jnp.float32))


@pytest.mark.parametrize("B,T,bs,decode,with_sel", [
    (1, 1, BlockSizes(), "cvt", True),  # 64-head block, 10 splits
    (4, 4, BlockSizes(block_h=16, num_splits=1), "int", True),
    (2, 1, BlockSizes(block_h=32), "cvt", False),
])
def test_full_shape_lowers_for_h200(B, T, bs, decode, with_sel):
    def f(freqs, *a):
        return paged_sparse_attention(*bundles(a, 1, freqs), scale=512 ** -0.5, interpret=False, block_sizes=bs,
                                      decode=decode)

    text = common.lower_for_h200(f, jax.ShapeDtypeStruct((32,), jnp.float32), *_abstract_full(B, T, with_sel))
    assert "__gpu$xla.gpu.triton" in text
