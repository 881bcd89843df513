"""Microbenchmark cases of the paged indexer kernel at full V4.1 shapes (Hi = 32, di = 128, ratio 1, decode T = 1).

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla (callables on the args), make_args (zero-arg:
(IndexerOperands, PagedIndexKV) of random full-shape device arrays, fixed seed), bytes (minimum bytes the op
must move). Cases, for B in {1, 8, 32}:
- cand32k: the Reindex use: 2048 candidate blocks of 8 entries out of a 32K context;
- full8k / full32k: the candidate-source full scan of every block of an 8K / 32K context.
fn_xla is the model's current approach: gather and decode every index key of the sequence's capacity from the
pages (the reference's decode), score them all with jnp, and (candidates) keep the candidate columns.

`python -m bench.kernels.indexer [--iters N] [--only SUBSTR] [--out results.json] [--smoke]` times both on the
current device (median wall time of N synced calls), checks the numerics contract (fraction of columns whose
score differs from XLA, largest difference in bf16 ulps of the row's largest score, top-512 agreement) and
prints a table last. --smoke: a 512-token context at B = 1 (16 candidate blocks, top-64), the CPU check that
the cases still build and run (tests/test_bench_kernels.py).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_result
from bench.kernels.timing import wall_us
from dsv41_jax.attention import candidate_block_ids, select_topk_entries
from dsv41_jax.config import ModelConfig
from dsv41_jax.kv_cache import PageLayout
from dsv41_jax.kv_format import PAGE_TOKENS, fp4_index_bytes
from pallas_kernels import common
from pallas_kernels.indexer import IndexerOperands, PagedIndexKV
from pallas_kernels.indexer.kernel import gather_index_keys, index_scores_paged, score_keys

HI, DI, RATIO, BS = 32, 128, 1, 8
# the full model's page (latents of the three ratio-2 sources and the ratio-1 source, then their index keys)
LAYOUT = PageLayout.for_config(ModelConfig.preset("full"))
PAGE_BYTES = LAYOUT.page_bytes
REGION = LAYOUT.region("idx", RATIO, 0)[0]
EB = fp4_index_bytes(DI)
N_CAND, TOPK = 2048, 512
SMOKE = dict(ctx=512, n_cand=16, topk=64)  # --smoke: 8 pages per sequence, interpret mode on the CPU


def _make_args(B, ctx, cand: bool, n_cand: int = N_CAND, seed=0):
    """(IndexerOperands, PagedIndexKV) of one decode step: random FP4 index keys in a shuffled page pool."""
    n = PAGE_TOKENS // RATIO
    pages_per_seq = ctx * RATIO // PAGE_TOKENS
    P = 1 + B * pages_per_seq
    k = jax.random.split(jax.random.key(seed), 8)
    pool = jax.random.randint(k[0], (P, PAGE_BYTES), 0, 256, jnp.int32).astype(jnp.uint8)
    # sane UE8M0 scale bytes in the index-key region (2^-7 .. 2^3) so that scores are finite
    slab = pool[:, REGION:REGION + n * EB].reshape(P, n, EB)
    slab = slab.at[..., DI // 2:].set(jax.random.randint(k[1], (P, n, DI // 32), 120, 131, jnp.int32).astype(jnp.uint8))
    pool = pool.at[:, REGION:REGION + n * EB].set(slab.reshape(P, n * EB))
    table = (1 + jax.random.permutation(k[2], B * pages_per_seq)).reshape(B, pages_per_seq).astype(jnp.int32)
    # q: FP4-grid values times a power-of-two scale per 32 elements (as fp4_qdq leaves them)
    codes = jax.random.randint(k[3], (B, 1, HI, DI), 0, 16, jnp.int32)
    scale = 2.0 ** jax.random.randint(k[4], (B, 1, HI, DI // 32, 1), -3, 2).astype(jnp.float32)
    q = (common.e2m1_to_f32(codes).reshape(B, 1, HI, DI // 32, 32) * scale).reshape(B, 1, HI, DI).astype(jnp.bfloat16)
    w = (jax.random.normal(k[5], (B, 1, HI)) * 0.02).astype(jnp.bfloat16)
    visible = (ctx - jax.random.randint(k[6], (B, 1), 0, BS)).astype(jnp.int32)  # cuts the newest block
    nb_all = ctx // BS
    if cand:
        keys = jax.random.split(k[7], B)
        pick = jax.vmap(lambda kk: jnp.sort(jax.random.choice(kk, nb_all - 1, (n_cand - 1,), replace=False)))(keys)
        blocks = jnp.concatenate([pick, jnp.full((B, 1), nb_all - 1)], axis=1)  # newest block forced in
        blocks = jnp.sort(blocks, axis=1)[:, None, :].astype(jnp.int32)
    else:
        blocks = jnp.broadcast_to(jnp.arange(nb_all, dtype=jnp.int32), (B, 1, nb_all))
    a = IndexerOperands(q=q, w=w, blocks=blocks, visible=visible, ratio=RATIO, block_size=BS)
    kv = PagedIndexKV(pages=pool, page_table=table, region=jnp.int32(REGION), page_tokens=PAGE_TOKENS,
                      entry_bytes=EB)
    return a, kv


def _xla_model_way(a: IndexerOperands, kv: PagedIndexKV, *, cand: bool):
    """Today's model path: every index key of the capacity gathered + decoded, every entry scored."""
    B = a.q.shape[0]
    n = kv.page_tokens // a.ratio
    C = kv.page_table.shape[1] * n
    e = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    k = gather_index_keys(kv.pages, kv.page_table, e, jnp.ones((B, C), bool), kv.region, n=n, di=DI)
    s = score_keys(a.q, a.w, k, jnp.arange(C)[None, None] < a.visible[..., None])  # [B,1,C]
    if not cand:
        return s
    ent = (a.blocks[..., None] * BS + jnp.arange(BS)).reshape(B, 1, -1)
    return jnp.where(ent >= 0, jnp.take_along_axis(s, jnp.clip(ent, 0, C - 1), axis=-1), -jnp.inf)


def _bytes(B, ctx, cand: bool, n_cand: int = N_CAND) -> int:
    nb = n_cand if cand else ctx // BS
    keys = B * nb * BS * EB
    return keys + B * (HI * DI * 2 + HI * 2 + nb * BS * 4 + nb * 4 + 4 + ctx // PAGE_TOKENS * 4)


def cases(smoke: bool = False) -> list[dict]:
    """The full-shape cases, or (smoke) one tiny context per kind at B = 1 for a CPU run in interpret mode."""
    kinds = (("cand32k", 32768, True), ("full8k", 8192, False), ("full32k", 32768, False))
    if smoke:
        kinds = (("cand_smoke", SMOKE["ctx"], True), ("full_smoke", SMOKE["ctx"], False))
    n_cand = SMOKE["n_cand"] if smoke else N_CAND
    out = []
    for kind, ctx, cand in kinds:
        for B in ((1,) if smoke else (1, 8, 32)):
            out.append({
                "name": f"indexer_{kind}_B{B}",
                "fn_pallas": jax.jit(functools.partial(index_scores_paged, implementation="pallas")),
                "fn_xla": jax.jit(functools.partial(_xla_model_way, cand=cand)),
                "make_args": functools.partial(_make_args, B, ctx, cand, n_cand),
                "bytes": _bytes(B, ctx, cand, n_cand),
            })
    return out


# ----------------------------------------------------------------------------- runner
def _numerics(got, want, blocks, visible, topk):
    got, want = np.asarray(got), np.asarray(want)
    fin = np.isfinite(want)
    mask_ok = bool(np.array_equal(np.isneginf(got), np.isneginf(want)) and not np.isnan(got).any())
    rowmax = np.max(np.where(fin, np.abs(want), 0), axis=-1, keepdims=True)
    ulp = np.where(fin, np.abs(np.where(fin, got, 0) - np.where(fin, want, 0)) / (rowmax * 2.0 ** -8 + 1e-30), 0)
    sel = jax.jit(functools.partial(select_topk_entries, k=topk))
    a = np.asarray(sel(jnp.asarray(got), blocks, visible))
    b = np.asarray(sel(jnp.asarray(want), blocks, visible))
    same_sets = np.mean([len(np.intersect1d(x, y)) / max(1, (x >= 0).sum()) for x, y in zip(a.reshape(-1, topk),
                                                                                           b.reshape(-1, topk))])
    return {"mask_exact": mask_ok, "frac_cols_differ": float((got[fin] != want[fin]).mean()),
            "max_diff_rowmax_ulps": float(ulp.max()), "topk_rows_equal": float(np.mean(np.all(a == b, axis=-1))),
            "topk_overlap": float(same_sets)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpret mode)")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    rows = []
    topk, n_cand = (SMOKE["topk"], SMOKE["n_cand"]) if a.smoke else (TOPK, N_CAND)
    for c in cases(a.smoke):
        if a.only not in c["name"]:
            continue
        args = c["make_args"]()
        tp = wall_us(c["fn_pallas"], args, a.iters) * 1e-6
        tx = wall_us(c["fn_xla"], args, a.iters) * 1e-6
        num = _numerics(c["fn_pallas"](*args), c["fn_xla"](*args), args[0].blocks, args[0].visible, topk)
        # the candidate-source rule on the full-scan output, so that it is compiled and exercised at full shape
        if "full" in c["name"]:
            jax.block_until_ready(candidate_block_ids(c["fn_pallas"](*args), args[0].visible, n_keep=n_cand,
                                                      block_size=BS))
        rows.append({"name": c["name"], "pallas_us": tp * 1e6, "xla_us": tx * 1e6, "speedup": tx / tp,
                     "pallas_GBps": c["bytes"] / tp / 1e9, "bytes": c["bytes"], **num})
        del args
    if a.out:
        write_result(a.out, {"cases": rows}, "python -m bench.kernels.indexer " + " ".join(argv))
    hdr = (f"{'case':24s} {'pallas_us':>10s} {'xla_us':>10s} {'speedup':>8s} {'GB/s':>7s} {'mask':>5s} "
           f"{'cols_diff':>9s} {'max_ulp':>7s} {'topk_eq':>7s} {'overlap':>7s}")
    print(hdr)
    for r in rows:
        print(f"{r['name']:24s} {r['pallas_us']:10.1f} {r['xla_us']:10.1f} {r['speedup']:8.2f} {r['pallas_GBps']:7.0f} "
              f"{str(r['mask_exact']):>5s} {r['frac_cols_differ']:9.2e} {r['max_diff_rowmax_ulps']:7.2f} "
              f"{r['topk_rows_equal']:7.3f} {r['topk_overlap']:7.4f}")


if __name__ == "__main__":
    main()
