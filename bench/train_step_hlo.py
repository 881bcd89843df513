"""Where the default model's training step puts its memory: compile `training.objective`'s train step for one
batch shape and list the largest values of the optimized HLO with the JAX op that made them.

    python -m bench.train_step_hlo --shape 2048x4 --out bench/results/train_step_hlo_cpu.json

Reports XLA's own numbers for the compiled program (temp bytes, flops, bytes accessed; backend-specific: a CPU
compile shows the structure, not GPU timings) and the `--top` largest HLO values (shape, HLO opcode, the
`op_name` metadata of the einsum / gather that produced them), de-duplicated by (shape, op_name); values
are counted once each, so a tensor that lives in a loop carry appears with its stacked shape.
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax  # noqa: F401
from bench.common import write_result
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.train_attention import TRAIN_ATTENTION
from training import data as D
from training import objective as T
from training.train_default import model_config

BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "u8": 1, "s8": 1, "f16": 2, "s64": 8,
         "f8e4m3fn": 1, "f8e8m0fnu": 1}
LINE = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\S* (\w[\w\-]*)\(")


def largest(hlo: str, top: int) -> list[dict]:
    rows = []
    for line in hlo.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        dt, dims, opcode = m.groups()
        n = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
        op = re.search(r'op_name="([^"]+)"', line)
        rows.append((n * BYTES.get(dt, 4), f"{dt}[{dims}]", opcode, op.group(1) if op else ""))
    rows.sort(key=lambda r: -r[0])
    out, seen = [], set()
    for b, shape, opcode, op in rows:
        if (shape, op) in seen:
            continue
        seen.add((shape, op))
        out.append({"mb": round(b / 1e6, 1), "shape": shape, "hlo": opcode, "op_name": op[-160:]})
        if len(out) == top:
            break
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048x4", help="TxB of the batch")
    ap.add_argument("--aux-stride", type=int, default=16)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--attention", default="served", choices=TRAIN_ATTENTION,
                    help="the attention core's training form (dsv41_jax.train_attention)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t, b = (int(x) for x in a.shape.lower().split("x"))
    cfg, h = model_config(), T.Hyper(aux_stride=a.aux_stride, attention=a.attention)
    m = jax.jit(lambda: T.init_masters(cfg, 0))()
    tx = T.make_optimizer(h, m)
    st = jax.jit(tx.init)(m)
    ex = D.host_batch(cfg, EngramHasher(cfg), np.zeros((b, t + 1), np.int32))
    t0 = time.perf_counter()
    c = jax.jit(T.make_train_step(cfg, h, tx)).lower(m, st, *ex, jnp.float32(0)).compile()
    compile_s = time.perf_counter() - t0
    ma = c.memory_analysis()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    res = {"shape": a.shape, "tokens": b * t, "attention": a.attention, "compile_s": round(compile_s, 1),
           "temp_bytes": int(ma.temp_size_in_bytes), "temp_bytes_per_token": int(ma.temp_size_in_bytes / (b * t)),
           "flops": float(ca.get("flops", 0)), "bytes_accessed": float(ca.get("bytes accessed", 0)),
           "largest": largest(c.as_text(), a.top)}
    print(f"{a.shape}: temp {res['temp_bytes'] / 1e9:.2f} GB ({res['temp_bytes_per_token'] / 1e3:.0f} KB/token), "
          f"{res['flops'] / 1e9:.0f} GFLOP, {res['bytes_accessed'] / 1e9:.0f} GB accessed, compile {compile_s:.0f} s")
    for r in res["largest"]:
        print(f"{r['mb']:>9.1f} MB {r['shape']:<28} {r['hlo']:<18} {r['op_name'][-90:]}")
    if a.out:
        write_result(a.out, res, "python -m bench.train_step_hlo " + " ".join(argv or __import__("sys").argv[1:]))
    return res


if __name__ == "__main__":
    main()
