"""Microbenchmark cases of paged_sparse_attention at the full V4.1 decode shape (H=64, d=512, W=128, k=512,
ratio 1, T=1), for B in {1, 8, 32} with the automatic launch configuration, plus launch-configuration variants
for tuning on the H200.

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla (jitted callables taking *make_args(): the
kernel, and the model's XLA path through dsv41_jax.ops.csa_attention), make_args (builds the operand bundles
SparseAttentionOperands / PagedAttentionKV of random device arrays with a fixed seed: real-looking FP8 ring
entries and FP4 latents in a page pool sized for 8K tokens of context per sequence, 512 sorted distinct
selections per row), bytes (the minimum HBM traffic of
the op: the row's W-1 ring entries and its chunk row, the k selected latents, the selection indices and page
table entries, q, sink and the bf16 output).

`python -m bench.kernels.sparse_attention [--out FILE] [--only SUBSTR] [--chain N] [--smoke]` (GPU; --smoke: one
tiny case, H = 8, d = 64, 256 tokens, the CPU check of tests/test_bench_kernels.py): for every case, checks
the Pallas output against the XLA reference at the full shape (max error in bf16 ulps of each row's max|ref|,
fraction bit-identical), times both (median over repetitions of a chain of calls inside one program, so the
~35 us per-call dispatch is amortised) and prints a table last, with the bandwidth against 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_result
from dsv41_jax import ops
from dsv41_jax.config import ModelConfig
from dsv41_jax.kv_cache import KVState, PagedGlobal, PagedKV, PageLayout, SwaPool
from dsv41_jax.kv_format import PAGE_TOKENS, fp4_latent_bytes
from dsv41_jax.ops import ExecContext
from dsv41_jax.rope import rope_freqs
from pallas_kernels.sparse_attention import PagedAttentionKV, SparseAttentionOperands, paged_sparse_attention
from pallas_kernels.sparse_attention.block_sizes import BlockSizes

RATIO = 1
FULL = dict(H=64, D=512, W=128, K=512, L=40, context=8192)
SMOKE = dict(H=8, D=64, W=128, K=64, L=2, context=256)  # --smoke: interpret mode on the CPU
COPY_CEILING = 4.3e12  # H200 HBM copy bandwidth, B/s


@functools.cache
def layout(D: int) -> PageLayout:
    """The full model's page at D = 512 (latents of the three ratio-2 sources, then the ratio-1 source, then the
    index keys); otherwise one ratio-1 latent region (the smoke shapes)."""
    if D == FULL["D"]:
        return PageLayout.for_config(ModelConfig.preset("full"))
    eb = fp4_latent_bytes(D)
    return PageLayout(((("lat", RATIO, 0), (0, PAGE_TOKENS, eb)),), PAGE_TOKENS * eb, "fp4", D, 128)


def make_args(B: int, T: int = 1, seed: int = 0, *, H, D, W, K, L, context):
    """(SparseAttentionOperands, PagedAttentionKV) of a decode step at position context - T."""
    lay = layout(D)
    region, _, eb = lay.region("lat", RATIO, 0)
    e = D + D // 32  # FP8 ring entry: E4M3 bytes, then UE8M0 per 32
    key = jax.random.key(seed)
    ks = jax.random.split(key, 8)
    max_pages = context // PAGE_TOKENS
    n_pages = B * max_pages + 1
    u8 = jnp.uint8
    pages = jax.random.bits(ks[0], (n_pages, lay.page_bytes), u8)
    lat = pages[:, region:region + PAGE_TOKENS * eb].reshape(n_pages, PAGE_TOKENS, eb)
    sc = jax.random.randint(ks[1], (n_pages, PAGE_TOKENS, D // 16), 0x20, 0x50).astype(u8)  # E4M3 scales ~2^-4..2^2
    pages = pages.at[:, region:region + PAGE_TOKENS * eb].set(lat.at[..., D // 2:].set(sc).reshape(n_pages, -1))
    ring = jax.random.bits(ks[2], (L, B + 1, W, e), u8)
    ring = ring.at[..., :D].set(ring[..., :D] & 0xF7)  # |E4M3| <= 240, never NaN
    ring = ring.at[..., D:].set(jax.random.randint(ks[3], (L, B + 1, W, D // 32), 118, 126).astype(u8))
    table = (jax.random.permutation(ks[4], B * max_pages) + 1).reshape(B, max_pages).astype(jnp.int32)
    pos0 = jnp.full((B,), context - T, jnp.int32)
    scores = jax.random.uniform(ks[5], (B, T, context // RATIO))
    sel = jnp.sort(jax.lax.top_k(scores, K)[1], axis=-1).astype(jnp.int32)
    q = (jax.random.normal(ks[6], (B, T, H, D)) * 2).astype(jnp.bfloat16)
    chunk = jax.random.normal(ks[7], (B, T, D)).astype(jnp.bfloat16)
    sink = jnp.linspace(-1, 1, H, dtype=jnp.float32)
    a = SparseAttentionOperands(q=q, chunk_kv=chunk, pos0=pos0, clip=jnp.zeros((B,), jnp.int32), sel=sel, sink=sink,
                                layer=jnp.int32(L // 2), src=jnp.int32(0), ratio=RATIO)
    kv = PagedAttentionKV(ring=ring, ring_slot=jnp.arange(B, dtype=jnp.int32), pages=pages, page_table=table,
                          region=jnp.int32(region), page_tokens=PAGE_TOKENS, entry_bytes=eb)
    return a, kv


def min_bytes(B: int, T: int = 1, *, H, D, W, K, L, context) -> int:
    rows = B * T
    eb, e = fp4_latent_bytes(D), D + D // 32
    keys = (W - T) * e * B + T * D * 2 * B + rows * K * eb  # ring entries read once per sequence for T <= W
    meta = rows * K * 4 + B * (K // (PAGE_TOKENS // RATIO) + 1) * 4 + H * 4
    io = 2 * rows * H * D * 2  # q in, o out (bf16)
    return keys + meta + io


def xla_reference(a: SparseAttentionOperands, kv: PagedAttentionKV):
    """The model's XLA path on the same operands: the ops seam's reference branch (window over the packed rings,
    selected latents through PagedKV, dsv41_jax.attention.sparse_attention)."""
    d, W = a.q.shape[-1], kv.ring.shape[2]
    cfg = SimpleNamespace(qdq=True, head_dim=d, compute_dtype="bfloat16", window_size=W)
    ex = ExecContext(kv=PagedKV(layout(d), "bfloat16"))
    state = KVState(SwaPool(kv.ring, kv.ring_slot), PagedGlobal(kv.pages, kv.page_table), None)
    return ops.csa_attention(ex, cfg, a, state)


def _fns(bs: BlockSizes | None, D: int):
    fp = jax.jit(functools.partial(paged_sparse_attention, scale=D ** -0.5, block_sizes=bs))
    return fp, jax.jit(xla_reference)


def cases(smoke: bool = False) -> list[dict]:
    """The full decode shape at B = 1, 8, 32 (automatic launch) and tuning variants; smoke: one tiny case."""
    shape = SMOKE if smoke else FULL
    variants = [(1, None)] if smoke else [(B, None) for B in (1, 8, 32)]
    if not smoke:
        variants += [(1, BlockSizes(block_h=16)), (8, BlockSizes(num_splits=2)), (32, BlockSizes(num_splits=1)),
                     (32, BlockSizes(num_splits=2)), (32, BlockSizes(block_h=16, num_splits=1)),
                     (32, BlockSizes(block_h=32, num_splits=2))]
    out = []
    for B, bs in variants:
        fp, fx = _fns(bs, shape["D"])
        tag = "auto" if bs is None else f"h{bs.block_h or 64}_s{bs.num_splits or 'auto'}"
        out.append(dict(name=f"decode_b{B}_{tag}" + ("_smoke" if smoke else ""), fn_pallas=fp, fn_xla=fx,
                        make_args=functools.partial(make_args, B, **shape), bytes=min_bytes(B, **shape)))
    return out


def _with_rope(B: int, smoke: bool, seed: int = 0):
    """make_args plus the layer's RoPE frequencies (the output leaves inverse-rotated) and the layer index last
    (bench/fused_kernels.py loops over it)."""
    shape = dict(SMOKE if smoke else FULL)
    if not smoke and B > 32:
        shape["context"] = 2048
    a, kv = make_args(B, seed=seed, **shape)
    freqs = jnp.asarray(rope_freqs(64 if not smoke else 16, 160000.0, 65536, 16.0))
    return dataclasses.replace(a, freqs=freqs), kv, a.layer


def _kernel_on_layer(a, kv, layer):
    return paged_sparse_attention(dataclasses.replace(a, layer=layer), kv, scale=a.q.shape[-1] ** -0.5)


def _xla_on_layer(a, kv, layer):
    return xla_reference(dataclasses.replace(a, layer=layer), kv)


def variants(smoke: bool = False) -> list[dict]:
    """bench/fused_kernels.py: the kernel (in-kernel split merge and inverse RoPE) against the model's XLA path
    (core, then the inverse RoPE) at the full decode shape, B = 1, 8, 32 (context 8K)."""
    shape = SMOKE if smoke else FULL
    fused, xla = jax.jit(_kernel_on_layer), jax.jit(_xla_on_layer)
    return [{"op": "sparse_attention", "n": B, "make_args": functools.partial(_with_rope, B, smoke),
             "bytes": min_bytes(B, **dict(shape, context=2048 if B > 32 and not smoke else shape["context"])),
             "reference": xla, "fused": {"fused": fused}, "unfused": {"xla": xla}, "n_layers": shape["L"]}
            for B in ((1,) if smoke else (1, 8, 32))]


def _chain(fn, n: int):
    """n dependent calls in one program: call i+1's sink depends on call i's output (a 64-float fusion)."""
    def run(a, kv):
        o = None
        for _ in range(n):
            if o is not None:
                a = dataclasses.replace(a, sink=a.sink + 0.0 * o[0, 0, 0, 0].astype(jnp.float32))
            o = fn(a, kv)
        return o
    return jax.jit(run)


def _time(fn, args, n=10, reps=15):
    chained = _chain(fn, n)
    jax.block_until_ready(chained(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(chained(*args))
        ts.append((time.perf_counter() - t0) / n)
    return float(np.median(ts))


def _accuracy(got, want):
    g = np.asarray(got, np.float32)
    w = np.asarray(want, np.float32)
    amax = np.abs(w).max(axis=(-2, -1), keepdims=True)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(amax, 1e-30))) - 7)
    return float((np.abs(g - w) / ulp).max()), float((g == w).mean()), bool(np.isfinite(g).all())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="results JSON (bench.common.write_result)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--chain", type=int, default=10, help="dependent calls per timed program")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions (median)")
    ap.add_argument("--smoke", action="store_true", help="one tiny case (CPU: interpret mode)")
    a = ap.parse_args(argv)
    rows, results = [], {}
    for c in cases(a.smoke):
        if a.only not in c["name"]:
            continue
        args = c["make_args"]()
        t0 = time.perf_counter()
        got = jax.block_until_ready(c["fn_pallas"](*args))
        compile_s = time.perf_counter() - t0
        err, exact, finite = _accuracy(got, c["fn_xla"](*args))
        tp, tx = _time(c["fn_pallas"], args, a.chain, a.reps), _time(c["fn_xla"], args, a.chain, a.reps)
        res = dict(pallas_us=tp * 1e6, xla_us=tx * 1e6, bytes=c["bytes"], pallas_bw_frac=c["bytes"] / tp / COPY_CEILING,
                   max_err_ulp_rowmax=err, exact_frac=exact, finite=finite, first_call_s=compile_s)
        results[c["name"]] = res
        rows.append((c["name"], res))
        del args
    if a.out:
        cmd = "python -m bench.kernels.sparse_attention " + " ".join(sys.argv[1:] if argv is None else argv)
        write_result(a.out, results, cmd)
    print(f"{'case':28s} {'pallas us':>10s} {'xla us':>9s} {'MB':>7s} {'%4.3TB/s':>9s} {'err ulp':>8s} "
          f"{'exact':>6s} {'1st s':>6s}")
    for name, r in rows:
        print(f"{name:28s} {r['pallas_us']:10.1f} {r['xla_us']:9.1f} {r['bytes'] / 1e6:7.2f} "
              f"{100 * r['pallas_bw_frac']:8.1f}% {r['max_err_ulp_rowmax']:8.2f} {r['exact_frac']:6.3f} "
              f"{r['first_call_s']:6.1f}" + ("" if r["finite"] else "  NON-FINITE"))


if __name__ == "__main__":
    main()
