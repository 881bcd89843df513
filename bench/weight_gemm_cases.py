"""The cases of bench/weight_gemms.py: shapes, inputs and the candidate blocks of each weight GEMM.

A group is one (GEMM, M): its XLA reference, the current kernel (the default block on bf16 activations: what the
model ran before the FP8 x FP8 kernels) and the candidates (FP8-dot blocks and, for MoE at M = 6 / 48, the `tiled`
MXFP4 layout). Every case is a function of jit arguments plus a list of argument sets the timer rotates through
(other routings / other layer copies, so L2 cannot serve the weights).

Candidates are templates turned into valid blocks per shape (`fp8_moe_block`, `fp8_dense_block`): R = rows per
work item / M tile, nb = MMA rows / R (R grows where K has too few 32-blocks), bk = the k per loop step (a target,
reduced to divide K), K splits chosen to give >= 2 programs per SM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gemm import GemmBlock, matmul
from pallas_kernels.gemm.block_sizes import NUM_SMS, next_pow2, pick_gemm_block
from pallas_kernels.moe import MoeBlock, grouped_matmul, grouped_swiglu, pick_moe_block

E, TOPK, D, INTER = 384, 6, 5120, 2304
MOE_MS = (6, 48, 1, 192, 1536)
DENSE = {"wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w13": (2304, 5120), "shared_w2": (5120, 2304),
         "wq_a": (1280, 5120), "wkv": (512, 5120), "idx_wq_b": (4096, 1280)}
DENSE_MS = (1, 8, 64)
DENSE_M64 = ("wq_b", "wo_b", "shared_w13", "shared_w2")  # M = 64 only for these
HEAD = (129280, 5120)
ROUTINGS = 8
TARGET_PROGRAMS = 2 * NUM_SMS
TOL_EXACT, TOL_FAST, TOL_BF16_OUT = 1e-5, 4e-3, 1.6e-2  # max |y - ref| / max |ref| (fast: FP8 wgmma accumulator)


@dataclass
class Case:
    kind: str  # moe | dense
    matrix: str
    M: int
    variant: str
    block: object
    fn: object
    arg_sets: list
    nbytes: float
    tol: float
    key: tuple | None = None  # the TUNED key this block would fill
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- block templates
def _splits(programs: int, ksteps: int, cap: int = 16) -> int:
    """Smallest divisor S of ksteps (<= cap, >= 2 steps each) with programs * S >= TARGET_PROGRAMS."""
    best = 1
    for s in range(1, cap + 1):
        if ksteps % s or ksteps // s < 2:
            continue
        best = s
        if programs * s >= TARGET_PROGRAMS:
            return s
    return best


def _max_nb(K: int) -> int:
    """Largest nb (<= 64) with 32 * nb | K."""
    nb = 1
    while nb < 64 and K % (64 * nb) == 0:
        nb *= 2
    return nb


def _bk(K: int, nb: int, target: int) -> int:
    """k per loop step: the largest multiple 32 * nb * 2^j <= max(target, 32 * nb) dividing K."""
    bk = 32 * nb
    while bk * 2 <= target and K % (bk * 2) == 0:
        bk *= 2
    return bk


def _rows_nb(R: int, mma: int, K: int):
    """(R, nb) with R * nb = mma and 32 * nb | K (R grows where K does not allow the blocks)."""
    nb = mma // R
    cap = _max_nb(K)
    return (mma // cap, cap) if nb > cap else (R, nb)


def fp8_moe_block(rows: int, N: int, K: int, items: int, *, mma: int = 16, bn: int = 64, warps: int = 4,
                  stages: int = 3, swap: bool = True, fast: bool = True, bk: int = 512, splits: int | None = None):
    """An FP8-dot MoeBlock for ~`rows` rows per active expert, or None if the shape does not allow it."""
    R, nb = _rows_nb(min(next_pow2(rows), mma), mma, K)
    bk = _bk(K, nb, bk)
    if N % bn or K % bk:
        return None
    S = splits if splits is not None else _splits(items * (N // bn), K // bk)
    if K % (bk * S):
        return None
    return MoeBlock(R, bn, bk, warps, stages, S, decode="fp8", nb=nb, swap=swap, fast_accum=fast)


def fp8_dense_block(M: int, N: int, K: int, *, mma: int = 16, bn: int = 64, warps: int = 4, stages: int = 3,
                    swap: bool = True, fast: bool = True, bk: int = 256, splits: int | None = None):
    R = next_pow2(M)
    R, nb = _rows_nb(R, max(mma, R), K)
    bk = _bk(K, nb, bk)
    if N % bn or K % bk or bn < 32:
        return None
    S = splits if splits is not None else _splits(-(-M // R) * (N // bn), K // bk)
    if K % (bk * S):
        return None
    return GemmBlock(R, bn, bk, S, warps, stages, decode="fp8", swap=swap, nb=nb, fast_accum=fast)


def _name(b) -> str:
    tag = ("swap-" if b.swap else "") + ("fast" if b.fast_accum else "exact")
    return f"fp8-{tag}-R{b.bm}nb{b.nb}-bn{b.bn}-bk{b.bk}-w{b.num_warps}-s{b.num_stages}-S{b.splits}"


def moe_candidates(M: int, N: int, K: int, active: float, fused: bool) -> list[tuple[str, MoeBlock]]:
    rows = max(1, int(np.ceil(M / max(active, 1.0))))
    items = int(np.ceil(active))
    templates = [dict(), dict(bn=128, warps=8), dict(stages=4), dict(bk=1024), dict(swap=False, fast=False)]
    if rows >= 4:
        templates += [dict(mma=32), dict(mma=32, bn=128, warps=8)]
    elif not fused:
        templates += [dict(splits=1)]
    out = []
    for t in templates:
        b = fp8_moe_block(rows, N, K, items, **t)
        if b is not None and all(b != o for _, o in out):
            out.append((_name(b), b))
    return out


def dense_candidates(M: int, N: int, K: int) -> list[tuple[str, GemmBlock]]:
    if M <= 16:
        templates = [dict(), dict(bn=128, warps=8), dict(mma=32), dict(stages=4, bk=512),
                     dict(swap=False, fast=False)] + ([dict(bn=32)] if N <= 2048 else [])
    else:
        templates = [dict(mma=64, swap=False), dict(mma=64, swap=False, bn=128, warps=8),
                     dict(mma=64, bn=128), dict(mma=64, swap=False, fast=False)]
    out = []
    for t in templates:
        b = fp8_dense_block(M, N, K, **t)
        if b is not None and all(b != o for _, o in out):
            out.append((_name(b), b))
    return out


# ----------------------------------------------------------------------------- inputs
def routing_sizes(M: int, seed: int) -> np.ndarray:
    """Rows per expert: M = 1 one row; else M / 6 tokens routed top-6 to distinct uniformly random experts."""
    rng = np.random.default_rng(seed)
    if M < TOPK:
        return np.bincount(rng.permutation(E)[:M], minlength=E).astype(np.int32)
    idx = np.stack([rng.permutation(E)[:TOPK] for _ in range(M // TOPK)])
    return np.bincount(idx.reshape(-1), minlength=E).astype(np.int32)


def fp4_weights(key, N, K):
    """Random bytes (every code) and scales 118..125 (|w| up to ~0.2, as the checkpoint's experts)."""
    k1, k2 = jax.random.split(key)
    w = jax.random.randint(k1, (E, N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.randint(k2, (E, N, K // 32), 118, 126, jnp.int32).astype(jnp.uint8)
    return w, jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)


def fp8_rows(key, M, K):
    """Activations as the model feeds the GEMMs: (bf16 values, E4M3 codes, UE8M0 codes) of FP8-per-32 rows."""
    from dsv41_jax import quant

    q, c = quant.fp8_encode(jax.random.normal(key, (M, K), jnp.float32), 32)
    return quant.fp8_decode(q, c, 32, jnp.bfloat16), q, c


# ----------------------------------------------------------------------------- MoE groups
class MoeWeights:
    """w1, w3 (N = moe_inter, K = dim), w2 (N = dim, K = moe_inter) of one layer, official layout; tiled copies
    made on first use."""

    def __init__(self):
        ks = jax.random.split(jax.random.key(0), 3)
        self.off = jax.block_until_ready(fp4_weights(ks[0], INTER, D) + fp4_weights(ks[1], INTER, D)
                                         + fp4_weights(ks[2], D, INTER))
        self._tiled = {}

    def tiled(self, bk: int):
        if bk not in self._tiled:
            from checkpoints.kernel_layout import to_tiled_mxfp4

            w1, s1, w3, s3, w2, s2 = self.off
            f = jax.jit(lambda w: to_tiled_mxfp4(w, bk))
            self._tiled[bk] = jax.block_until_ready((f(w1), s1, f(w3), s3, f(w2), s2))
        return self._tiled[bk]


def moe_group(W: MoeWeights, matrix: str, M: int, with_xla: bool, extra=(), tiled: bool = True):
    """(cases, reference fn, reference args) of one MoE GEMM at M rows; `extra`: (name, MoeBlock) pairs instead of
    the candidates (official layout; FP8-dot blocks get FP8 x); tiled: the v1 kernel on the tiled layout too (M =
    6, 48)."""
    fused = matrix == "w13+swiglu"
    N, K = (INTER, D) if fused else (D, INTER)
    gss = [jnp.asarray(routing_sizes(M, r)) for r in range(ROUTINGS)]
    active = float(np.mean([(np.asarray(g) > 0).sum() for g in gss]))
    nbytes = active * (N * K // 2 + N * K // 32) * (2 if fused else 1)
    key = jax.random.key(3 + M)
    xb, xq, xc = fp8_rows(key, M, K)
    rw = jax.random.uniform(key, (M,), jnp.float32, 0.05, 1.0)

    def f(blk, impl="pallas", fp8x=False):
        def run(x, xs, g, rw, W6):
            w1, s1, w3, s3, w2, s2 = W6
            xs = xs if fp8x else None
            if fused:
                return grouped_swiglu(x, w1, w3, g, rw, scale1=s1, scale3=s3, limit=10.0, block=blk,
                                      implementation=impl, x_scale=xs)
            return grouped_matmul(x, w2, g, scale=s2, block=blk, implementation=impl, x_scale=xs)
        return run

    def args(x, xs, W6):
        return [(x, xs, g, rw, W6) for g in gss]

    tol = TOL_BF16_OUT if fused else TOL_EXACT
    kname = "swiglu" if fused else "gmm"
    cases = []
    if with_xla:
        cases.append(Case("moe", matrix, M, "xla", None, f(None, "xla"), args(xb, xc, W.off)[:2], nbytes, 0.0))
    cur = pick_moe_block(M, N, K, fp4=True, active=min(M, E), fused=fused)
    cases.append(Case("moe", matrix, M, "current", cur, f(cur), args(xb, xc, W.off), nbytes, tol))
    if tiled and M in (6, 48) and cur.bk >= 128:
        t = replace(cur, layout="tiled")
        cases.append(Case("moe", matrix, M, "bf16x2-tiled", t, f(t), args(xb, xc, W.tiled(cur.bk)), nbytes, tol,
                          key=(kname, N, K, M)))
    for name, b in moe_candidates(M, N, K, active, fused) if not extra else []:
        t = tol if fused else (TOL_FAST if b.fast_accum else TOL_EXACT)
        cases.append(Case("moe", matrix, M, name, b, f(b, fp8x=True), args(xq, xc, W.off), nbytes, t,
                          key=(kname, N, K, M)))
    for name, b in extra:
        fp8x = b.decode == "fp8"
        t = tol if fused else (TOL_FAST if b.fast_accum else TOL_EXACT)
        cases.append(Case("moe", matrix, M, name, b, f(b, fp8x=fp8x), args(xq if fp8x else xb, xc, W.off), nbytes,
                          t, key=(kname, N, K, M)))
    return cases, f(None, "xla"), args(xb, xc, W.off)[0], dict(active_experts=active)


# ----------------------------------------------------------------------------- dense groups
def dense_weights(N: int, K: int, fp8: bool):
    """A stack of L layer copies (>= 256 MB in all), FP8 block-32 quantized (or bf16)."""
    from dsv41_jax import quant

    nbytes = N * K * (1 if fp8 else 2)
    L = max(2, -(-256 * 2 ** 20 // nbytes))
    w = jax.random.normal(jax.random.key(1), (L, N, K), jnp.float32) * 0.02
    if not fp8:
        return jax.block_until_ready(w.astype(jnp.bfloat16)), None, L
    q, s = jax.jit(quant.quantize_weight_fp8)(w)
    return jax.block_until_ready(q), jax.block_until_ready(s), L


def dense_group(matrix: str, M: int, weights, extra=()):
    """(cases, reference fn, reference args) of one dense GEMM; `extra`: (name, GemmBlock) pairs instead of the
    candidates."""
    N, K = HEAD if matrix == "head_bf16" else DENSE[matrix]
    q, s, L = weights
    fp8 = s is not None
    nbytes = N * K * (1 if fp8 else 2) + (N // 32) * (K // 32) * fp8
    xb, xq, xc = fp8_rows(jax.random.key(2 + M), M, K)
    layers = [jnp.int32(i) for i in range(L)]

    def f(blk, impl="pallas", fp8x=False):
        def run(x, xs, lyr, q, s):
            return matmul(x, q, scale=s, layer=lyr, block=blk, implementation=impl, x_scale=xs if fp8x else None)
        return run

    def args(x, xs):
        return [(x, xs, lyr, q, s) for lyr in layers]

    cases = [Case("dense", matrix, M, "xla", None, f(None, "xla"), args(xb, xc), nbytes, 0.0)]
    cur = pick_gemm_block(M, N, K, fp8=fp8)
    cases.append(Case("dense", matrix, M, "current", cur, f(cur), args(xb, xc), nbytes, TOL_EXACT))
    if fp8:
        for name, b in list(extra) or dense_candidates(M, N, K):
            fp8x = b.decode == "fp8"
            cases.append(Case("dense", matrix, M, name, b, f(b, fp8x=fp8x), args(xq if fp8x else xb, xc), nbytes,
                              TOL_FAST if b.fast_accum else TOL_EXACT, key=(N, K, M)))
    return cases, f(None, "xla"), args(xb, xc)[0], {}


# ----------------------------------------------------------------------------- A/B of the TUNED entries
def _variants(base, changes):
    out = [("tuned", base)]
    for ch in changes:
        b = replace(base, **ch)
        if b not in [o for _, o in out]:
            out.append((",".join(f"{k}={v}" for k, v in ch.items()), b))
    return out


def moe_ab_blocks(M: int, active: float) -> list[tuple[str, MoeBlock]]:
    """The TUNED fused w1/w3 block at M rows (the model's pick) and its variants: prefetch toggled, the w13 weight
    schedules of fp8_kernel.py ("grid": one weight per program; "serial"), deeper pipelines, other K splits."""
    from pallas_kernels.moe.block_sizes import tuned_moe_block

    base = tuned_moe_block(M, INTER, D, active, True, True)
    if base is None:
        return []
    pf = base.prefetch
    ch = [dict(prefetch=not pf), dict(w13="grid"), dict(w13="grid", prefetch=not pf),
          dict(w13="grid", num_stages=4), dict(w13="grid", num_stages=4, prefetch=not pf),
          dict(w13="grid", num_stages=5)]
    ksteps = D // base.bk
    for s in (base.splits // 2, base.splits * 2):
        if s >= 1 and ksteps % s == 0:
            ch.append(dict(w13="grid", splits=s))
    if M == 6:
        ch.append(dict(w13="serial"))
    return _variants(base, ch)


def w2_ab_blocks(M: int, active: float) -> list[tuple[str, MoeBlock]]:
    """w2 (the model keeps v1): the swept FP8-dot default with and without prefetch."""
    b = fp8_moe_block(max(1, int(np.ceil(M / active))), D, INTER, int(np.ceil(active)))
    return [] if b is None else [("fp8", b), ("fp8,prefetch=True", replace(b, prefetch=True))]


def dense_ab_blocks(M: int, N: int, K: int) -> list[tuple[str, GemmBlock]]:
    from pallas_kernels.gemm.block_sizes import tuned_gemm_block

    base = tuned_gemm_block(M, N, K, True)
    return [] if base is None else _variants(base, [dict(prefetch=not base.prefetch)])
