"""Static look at the weight-GEMM kernels without a GPU: lower every candidate of bench/weight_gemms.py for the H200
(pallas_kernels.common.lower_for_h200), compile its Triton IR for sm_90a with a pip `triton` (ptxas included), and
count the SASS instructions of the main loop per weight byte (the issue-rate bound: an SM issues 4 warp-instructions
a clock, so x instructions per byte cap it at 128 / x bytes a clock).

    python -m tools.kernel_sass dump --out DIR [--only SUBSTR]          (this project's venv: writes DIR/*.ttir)
    python -m tools.kernel_sass dump --out DIR --only mega_mhc          (Mega-mHC at N = 1 / 8 / 32, 4 and 8 warps)
    TRITON_PY -m tools.kernel_sass compile DIR                          (a venv with triton==3.6.0, no jax needed)

The compile step reads DIR/index.json, rewrites the one attribute spelling that differs between jaxlib's Triton
dialect and pip Triton 3.6 (a load's cachePolicy), and prints per kernel: registers, shared memory, the loop's
instruction count, instructions per weight byte, the issue-bound TB/s (132 SMs at 1.755 GHz) and the main opcodes
per byte (QGMMA = FP8 wgmma, HMMA = mma.sync, F2FP = FP8 -> f16 converts, STS / LDS = shared memory), and the
stack size and local-memory instructions (register spills); for kernels without a weight loop (Mega-mHC) only the
registers, stack and local-memory instructions. XLA's own
Triton build (what jax 0.11.2 uses on the GPU) may schedule differently: these are estimates to rank candidates,
not measurements.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SM_ISSUE, SMS, CLOCK = 128, 132, 1.755e9
_CACHE = {"none": 1, "ca": 2, "cg": 3, "wb": 4, "cs": 5, "wt": 6, "cv": 7}
_EVICT = {"normal": 1, "evict_first": 2, "evict_last": 3}


# ----------------------------------------------------------------------------- dump (jax side)
def dump(out: Path, only: str = ""):
    import jax
    import jax.numpy as jnp

    from bench import weight_gemm_cases as wc
    from pallas_kernels.common import lower_for_h200
    from pallas_kernels.gemm import matmul
    from pallas_kernels.moe import grouped_matmul, grouped_swiglu

    def ttir(fn, *args):
        from jax._src.interpreters import mlir as jmlir
        from jax._src.lib import triton as tlib
        from jax._src.lib.mlir import ir

        ctx = jmlir.make_ir_context()
        tlib.dialect.register_dialect(ctx)
        mod = ir.Module.parse(lower_for_h200(fn, *args), context=ctx)
        found = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for o in block.operations:
                        if o.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in o.attributes:
                            found.append(str(ir.Module.parse(o.attributes["mhlo.backend_config"]["ir"].value_bytes,
                                                             context=ctx)))
                        walk(o.operation)
        walk(mod.operation)
        return found[0]

    sd = jax.ShapeDtypeStruct
    out.mkdir(parents=True, exist_ok=True)
    index, seen = {}, set()
    jobs = []
    for M in wc.MOE_MS:
        for fused, (N, K) in ((True, (wc.INTER, wc.D)), (False, (wc.D, wc.INTER))):
            active = float(min(M, wc.E)) if M <= 6 else wc.E * (1 - (1 - 1 / wc.E) ** M)
            cur = wc.pick_moe_block(M, N, K, fp4=True, active=min(M, wc.E), fused=fused)
            for name, b in [("current", cur)] + wc.moe_candidates(M, N, K, active, fused):
                jobs.append((f"moe_{'w13' if fused else 'w2'}_M{M}_{name}", "moe", M, N, K, b, fused))
    for mat, (N, K) in wc.DENSE.items():
        for M in wc.DENSE_MS:
            if M < 64 or mat in wc.DENSE_M64:
                for name, b in [("current", wc.pick_gemm_block(M, N, K, fp8=True))] + wc.dense_candidates(M, N, K):
                    jobs.append((f"dense_{mat}_M{M}_{name}", "dense", M, N, K, b, False))
    if only.startswith("mega_mhc"):  # Mega-mHC's one-launch kernel at D = 5120, pick_blocks' blocks at 4 and 8 warps
        _dump_mega_mhc(out, ttir, only)
        return
    for name, kind, M, N, K, b, fused in jobs:
        if only not in name or (kind, N, K, fused, b) in seen:
            continue
        seen.add((kind, N, K, fused, b))
        fp8x = b.decode == "fp8"
        xs = sd((M, K // 32), jnp.uint8) if fp8x else None
        x = sd((M, K), jnp.float8_e4m3fn if fp8x else jnp.bfloat16)
        try:
            if kind == "dense":
                text = ttir(lambda x, w, s, xs, b=b: matmul(x, w, scale=s, x_scale=xs, block=b, interpret=False), x,
                            sd((N, K), jnp.float8_e4m3fn), sd((N // 32, K // 32), jnp.uint8), xs)
                nbytes = b.bn * b.bk
            else:
                rw = jnp.ones((M,), jnp.float32)
                w, s, g = sd((wc.E, N, K // 2), jnp.uint8), sd((wc.E, N, K // 32), jnp.uint8), sd((wc.E,), jnp.int32)
                if fused:
                    fn = lambda x, w, s, g, xs, b=b: grouped_swiglu(x, w, w, g, rw, scale1=s, scale3=s, x_scale=xs,  # noqa
                                                                    block=b, interpret=False)
                else:
                    fn = lambda x, w, s, g, xs, b=b: grouped_matmul(x, w, g, scale=s, x_scale=xs, block=b,  # noqa
                                                                    interpret=False)
                text = ttir(fn, x, w, s, g, xs)
                # bytes per loop step: the FP8-dot swiglu streams both weights in one loop, the bf16 one in two
                nbytes = b.bn * b.bk // 2 * (2 if fused and b.decode == "fp8" else 1)
        except Exception as exc:  # noqa: BLE001 - a candidate that does not lower is reported, the rest go on
            print(f"{name}: LOWERING FAILED {type(exc).__name__}: {str(exc)[:200]}")
            continue
        (out / f"{name}.ttir").write_text(text)
        index[name] = dict(num_warps=b.num_warps, num_stages=b.num_stages, loop_bytes=nbytes, block=repr(b))
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(index)} kernels in {out}")


def _dump_mega_mhc(out: Path, ttir, only: str):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from pallas_kernels.mega_mhc import hc_boundary, pick_blocks

    sd = jax.ShapeDtypeStruct
    D, L, hc, mw = 5120, 40, 4, 24
    index = {}
    for n in (1, 8, 32):
        for warps in (4, 8):
            b = dataclasses.replace(pick_blocks(n, D), num_warps=warps)
            name = f"mega_mhc_N{n}_w{warps}"
            if only not in name:
                continue
            fn = lambda y, h, m, f, s, bb, w, l, b=b: hc_boundary(  # noqa: E731
                y, h, m, f, s, bb, w, layer=l, hc=hc, iters=20, eps=1e-6, norm_eps=1e-6, quantize=True, blocks=b,
                interpret=False)
            (out / f"{name}.ttir").write_text(ttir(
                fn, sd((n, D), jnp.bfloat16), sd((n, hc, D), jnp.bfloat16), sd((n, mw), jnp.float32),
                sd((L, mw, hc * D), jnp.float32), sd((L, 3), jnp.float32), sd((L, mw), jnp.float32),
                sd((L, D), jnp.bfloat16), sd((), jnp.int32)))
            index[name] = dict(num_warps=warps, num_stages=1, loop_bytes=0, block=repr(b))
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(index)} kernels in {out}")


# ----------------------------------------------------------------------------- compile (triton side)
def _fix(text: str) -> str:
    return re.sub(r"\{cachePolicy = #tt\.cache_policy<cache_modifier = (\w+), eviction_policy = (\w+)>\}",
                  lambda m: f"{{cache = {_CACHE[m.group(1)]} : i32, evict = {_EVICT[m.group(2)]} : i32, "
                            "isVolatile = false}", text)


def loop_counts(sass: str):
    """Opcode counts inside the largest backward branch (the main k loop) of a cuobjdump -sass listing."""
    ins = []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln)
        if m:
            op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", m.group(2))
            if op:
                ins.append((int(m.group(1), 16), op.group(1), m.group(2)))
    best = None
    for a, op, body in ins:
        t = re.search(r"BRA\s+(?:`\(\.L_x_\d+\))?\s*(0x[0-9a-f]+)", body) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < a and (best is None or a - int(t.group(1), 16) > best[1] - best[0]):
            best = (int(t.group(1), 16), a)
    if best is None:
        return collections.Counter()
    return collections.Counter(op.split(".")[0] for a, op, _ in ins if best[0] <= a <= best[1])


def compile_dir(d: Path):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    index = json.loads((d / "index.json").read_text())
    keys = ("QGMMA", "HMMA", "F2FP", "STS", "LDS", "LDSM", "LDGSTS", "LDG", "LOP3", "SHF", "PRMT", "SEL", "FFMA",
            "FMUL")
    for name, m in index.items():
        src = d / f"{name}.fixed.ttir"
        src.write_text(_fix((d / f"{name}.ttir").read_text()))
        try:
            k = tcompile(str(src), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": m["num_warps"], "num_stages": m["num_stages"]})
        except Exception as exc:  # noqa: BLE001
            print(f"{name:60s} COMPILE FAILED {str(exc)[:200]}")
            continue
        cub = d / f"{name}.cubin"
        cub.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(cub)], capture_output=True, text=True).stdout
        res = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", str(cub)], capture_output=True, text=True).stdout
        regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
        local = len(re.findall(r"\b(?:STL|LDL)\b", sass))  # spill traffic: local-memory loads and stores
        if not m["loop_bytes"]:  # not a weight GEMM: registers, spills and the whole kernel's static opcode mix
            allc = collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass))
            mix = " ".join(f"{o}:{allc[o]}" for o in ("HMMA", "FFMA", "LDS", "STS", "SHFL", "BAR", "MUFU") if allc[o])
            print(f"{name:60s} regs {regs.group(1) if regs else '?':>3s} stack {stack.group(1) if stack else '?':>5s} "
                  f"local-memory instructions {local:5d} | all {sum(allc.values()):6d} {mix}", flush=True)
            continue
        c = loop_counts(sass)
        per = sum(c.values()) * 32 * m["num_warps"] / m["loop_bytes"]
        bound = SM_ISSUE / per * SMS * CLOCK / 1e12 if per else float("nan")
        ops = " ".join(f"{o}:{c[o] * 32 * m['num_warps'] / m['loop_bytes']:.2f}" for o in keys if c[o])
        print(f"{name:60s} regs {regs.group(1) if regs else '?':>3s} stack {stack.group(1) if stack else '?':>5s} "
              f"local {local:4d} smem {k.metadata.shared:6d} "
              f"loop {sum(c.values()):5d} instr/B {per:5.2f} issue-bound {bound:4.1f} TB/s | {ops}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.kernel_sass")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dump")
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="")
    p = sub.add_parser("compile")
    p.add_argument("dir")
    a = ap.parse_args(argv)
    if a.cmd == "dump":
        dump(Path(a.out), a.only)
    else:
        compile_dir(Path(a.dir))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
