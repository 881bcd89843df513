"""Numerics on the accelerator vs the CPU, same parameters (tiny preset), and the path equivalences there.

    python -m bench.gpu_sanity --out bench/results/gpu_sanity_h200.json

(a) forward on the default device vs on the CPU device; (b)-exact and (c) vs (a) on the default device with the
indexer selections forced to (a)'s. Prints a short table.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import dsv41_jax  # noqa: F401
from bench.common import write_result
from dsv41_jax import paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = ModelConfig.preset("tiny")
    cpu = jax.devices("cpu")[0]
    dev = jax.devices()[0]
    with jax.default_device(cpu):
        params_cpu = jax.jit(lambda: init_params(cfg, 0))()
        toks = np.random.default_rng(1234).integers(0, 512, (2, 40)).astype(np.int32)
        ref_cpu = np.asarray(paths.forward(cfg, params_cpu, toks))
    params = jax.device_put(params_cpu, dev)
    ref, topk = paths.forward(cfg, params, toks, return_topk=True)
    ref = np.asarray(ref)
    res = {"device": str(dev), "fwd_dev_vs_cpu_maxabs": float(np.abs(ref - ref_cpu).max()),
           "fwd_dev_vs_cpu_argmax_agree": float(np.mean(ref.argmax(-1) == ref_cpu.argmax(-1))),
           "fwd_dev_vs_cpu_bit_identical_rows": float(np.mean(np.all(ref == ref_cpu, -1)))}
    N = 32
    f = lambda lo, hi: {l: v[:, lo:hi] for l, v in topk.items()}  # noqa: E731
    lb, ds, _ = paths.ced_prefill(cfg, params, toks[:, :N], mode="exact", forced_topk=f(0, N))
    diffs = [float(np.abs(np.asarray(lb[:, -1]) - ref[:, N - 1]).max())]
    for i in range(N, 40):
        lc, ds = paths.decode_step(cfg, params, ds, toks[:, i], forced_topk=f(i, i + 1))
        diffs.append(float(np.abs(np.asarray(lc) - ref[:, i]).max()))
    res["exact_tail_and_decode_vs_forward_maxabs"] = max(diffs)
    res["exact_tail_and_decode_rows_identical"] = float(np.mean([d == 0 for d in diffs]))
    print(f"{'check':>42} {'value':>12}")
    for k, v in res.items():
        if k != "device":
            print(f"{k:>42} {v:>12.4g}")
    if a.out:
        write_result(a.out, res, command="python -m bench.gpu_sanity")


if __name__ == "__main__":
    main()
