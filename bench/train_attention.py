"""Training attention core, "blocked" (XLA, dsv41_jax.train_attention.blocked_attention) vs "flash" (the fused
Pallas kernels, pallas_kernels.train_attention): forward + backward time at the default model's shapes.

Each case times jax.jit(jax.grad(sum of out * w)) w.r.t. (q, chunk_kv, lat, sink) for both forms: median wall
time of --iters synced calls after a warm-up call (compile). Before timing it checks flash against blocked at
the full shape: max |flash - blocked| / max |blocked| of the output and of each gradient (bf16 config: bf16
rounding, ~1e-2). Operands: q [B,T,H,d] (2 x normal), chunk_kv [B,T,d], lat [B,C,d] (normal), sink [H],
top-k ids per row: one random id in each of k equal strata of [0, C) (distinct, sorted), 10% set to -1;
`--causal`: also -1 for ids past the row's compressed prefix (c >= (t + 1) C / T, as a real indexer sees), where
flash skips latent blocks no row of a query block selected. C = 0: an SWA-only layer (no latents).

`python -m bench.train_attention [--out FILE] [--iters N] [--only SUBSTR] [--causal] [--sweep BxTxC,..] [--smoke]`
(GPU; --smoke: tiny shapes in interpret mode on CPU, the check that the script runs; --sweep: also time flash
under each launch configuration of SWEEP at those cases). Prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_result
from bench.kernels.timing import wall_us
from dsv41_jax import ops
from dsv41_jax.config import ModelConfig
from dsv41_jax.train_attention import blocked_attention, flash_attention

# (B, T, C): the default model's training chunk (B=32, T=2048) and a long-context one (B=8, T=8192)
CASES = [(32, 2048, 0), (32, 2048, 1024), (32, 2048, 2048), (8, 8192, 4096), (8, 8192, 8192)]
SMOKE_CASES = [(2, 256, 0), (2, 256, 128)]
H, D, W, TOPK = 4, 64, 128, 128


def make_case(B, T, C, k, *, causal: bool, seed: int = 0):
    """AttentionOperands of one fresh chunk (bf16) and the latents [B,C,d] (None when C = 0)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    bf = jnp.bfloat16
    q = (2 * jax.random.normal(ks[0], (B, T, H, D), jnp.float32)).astype(bf)
    kv = jax.random.normal(ks[1], (B, T, D), jnp.float32).astype(bf)
    sink = jax.random.normal(ks[2], (H,), jnp.float32)
    lat = sel = None
    if C:
        k = min(k, C)
        lat = jax.random.normal(ks[3], (B, C, D), jnp.float32).astype(bf)
        width = C // k
        sel = jnp.arange(k, dtype=jnp.int32) * width + jax.random.randint(ks[4], (B, T, k), 0, width, jnp.int32)
        drop = jax.random.bernoulli(ks[5], 0.1, sel.shape)
        if causal:
            t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
            drop |= sel * T >= (t + 1) * C
        sel = jnp.where(drop, -1, sel)
    a = ops.AttentionOperands(q=q, chunk_kv=kv, pos0=jnp.zeros((B,), jnp.int32), clip=jnp.zeros((B,), jnp.int32),
                              sel=sel, sink=sink, layer=jnp.asarray(0, jnp.int32), src=jnp.asarray(0, jnp.int32),
                              ratio=4, fresh=True)
    return a, lat


def grad_fn(cfg, core, a, w):
    """jit: (q, chunk_kv, lat, sink, sel) -> (grads of sum(out * w), out). Every operand is an argument (no
    operand is a compile-time constant, so XLA cannot fold the selection's scatter at compile time)."""
    def loss(q, kv, lat, sink, sel, w):
        out = core(cfg, dataclasses.replace(a, q=q, chunk_kv=kv, sink=sink, sel=sel), lat)
        return jnp.sum(out.astype(jnp.float32) * w), out

    argnums = (0, 1, 3) if a.sel is None else (0, 1, 2, 3)
    f = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))
    return lambda q, kv, lat, sink: f(q, kv, lat, sink, a.sel, w)


def rel_err(x, y) -> float:
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


def median_ms(fn, args, iters: int) -> float:
    return wall_us(fn, args, iters) / 1e3


def run_case(cfg, B, T, C, iters: int, causal: bool) -> dict:
    a, lat = make_case(B, T, C, TOPK, causal=causal)
    w = jax.random.normal(jax.random.PRNGKey(7), (B, T, H, D), jnp.float32)
    args = (a.q, a.chunk_kv, lat, a.sink)
    fb, ff = grad_fn(cfg, blocked_attention, a, w), grad_fn(cfg, flash_attention, a, w)
    gb, ob = fb(*args)
    gf, of = ff(*args)
    names = ("q", "kv", "sink") if lat is None else ("q", "kv", "lat", "sink")
    err = {"out": rel_err(of, ob)} | {f"d{n}": rel_err(x, y) for n, x, y in zip(names, gf, gb)}
    del gb, ob, gf, of
    row = {"B": B, "T": T, "C": C, "H": H, "d": D, "W": W, "k": TOPK if C else 0, "causal": causal,
           "rel_err": err}
    row["blocked_ms"] = median_ms(fb, args, iters)
    row["flash_ms"] = median_ms(ff, args, iters)
    row["speedup"] = row["blocked_ms"] / row["flash_ms"]
    return row


# flash configurations tried by --sweep: (ROWS, BK, NUM_WARPS, NUM_STAGES, MASK_PER_POSITION) of
# pallas_kernels.train_attention.kernel
SWEEP = [(64, 64, 4, 2, True), (64, 64, 4, 2, False), (128, 64, 4, 2, True), (128, 64, 8, 2, True),
         (256, 64, 8, 2, True), (128, 64, 4, 3, True), (128, 32, 4, 2, True), (128, 128, 8, 2, True)]
SWEEP_KEYS = ("ROWS", "BK", "NUM_WARPS", "NUM_STAGES", "MASK_PER_POSITION")


def sweep(cfg, B, T, C, iters: int, causal: bool) -> list[dict]:
    """Time flash under each SWEEP configuration (module constants patched; each one retraces), with its max
    relative error against blocked over the output and the gradients."""
    from pallas_kernels.train_attention import kernel as K

    a, lat = make_case(B, T, C, TOPK, causal=causal)
    w = jax.random.normal(jax.random.PRNGKey(7), (B, T, H, D), jnp.float32)
    args = (a.q, a.chunk_kv, lat, a.sink)
    gb, ob = grad_fn(cfg, blocked_attention, a, w)(*args)
    saved = tuple(getattr(K, key) for key in SWEEP_KEYS)
    rows = []
    try:
        for conf in SWEEP:
            for key, v in zip(SWEEP_KEYS, conf):
                setattr(K, key, v)
            ff = grad_fn(cfg, flash_attention, a, w)
            gf, of = ff(*args)
            err = max([rel_err(of, ob)] + [rel_err(x, y) for x, y in zip(gf, gb)])
            rows.append({"conf": conf, "flash_ms": median_ms(ff, args, iters), "rel_err": err})
            print(f"sweep {B}x{T}x{C} {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        for key, v in zip(SWEEP_KEYS, saved):
            setattr(K, key, v)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", default="", help="run the cases whose 'BxTxC' name contains this")
    ap.add_argument("--causal", action="store_true", help="drop ids past each row's compressed prefix")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpret mode)")
    ap.add_argument("--sweep", default="", help="'BxTxC' cases (comma-separated) to time under every SWEEP launch "
                    "configuration of flash (after the main table)")
    ap.add_argument("--out", default="bench/results/train_attention_h200.json")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), window_size=W, compute_dtype="bfloat16")
    cases = SMOKE_CASES if args.smoke else CASES
    rows = []
    for B, T, C in cases:
        if args.only not in f"{B}x{T}x{C}":
            continue
        row = run_case(cfg, B, T, C, 2 if args.smoke else args.iters, args.causal)
        rows.append(row)
        print(f"{B}x{T}x{C}: {row}", file=sys.stderr, flush=True)
        worst = max(row["rel_err"].values())
        if worst > 5e-2:
            print(f"WARNING {B}x{T}x{C}: flash vs blocked rel err {worst:.3g}", file=sys.stderr)
    sweeps = {}
    for name in filter(None, args.sweep.split(",")):
        B, T, C = map(int, name.split("x"))
        sweeps[name] = sweep(cfg, B, T, C, 2 if args.smoke else args.iters, args.causal)
    if not args.smoke:
        write_result(args.out, {"cases": rows, "sweep": sweeps},
                     " ".join(["python -m bench.train_attention", *(argv or sys.argv[1:])]))
    print(f"{'B':>3} {'T':>5} {'C':>5} {'blocked ms':>11} {'flash ms':>9} {'speedup':>8} {'max rel err':>12}")
    for r in rows:
        print(f"{r['B']:>3} {r['T']:>5} {r['C']:>5} {r['blocked_ms']:>11.2f} {r['flash_ms']:>9.2f} "
              f"{r['speedup']:>8.2f} {max(r['rel_err'].values()):>12.2e}")
    for name, rs in sweeps.items():
        print(f"sweep {name}: {SWEEP_KEYS}: flash ms / max rel err")
        for r in rs:
            print(f"  {r['conf']}: {r['flash_ms']:.2f} / {r['rel_err']:.2e}")


if __name__ == "__main__":
    main()
