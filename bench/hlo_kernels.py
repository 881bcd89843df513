"""Kernels per call of a GPU program, counted from its optimized HLO, on a host without a GPU.

    pip install "jax-cuda12-plugin==$(python -c 'import jax; print(jax.__version__)')" \\
        "jax-cuda12-pjrt==$(python -c 'import jax; print(jax.__version__)')"
    python -m bench.hlo_kernels --preset medium --weight-format fp8 --kernels auto --batch 1 \\
        --out bench/results/hlo_kernels_medium_fp8_auto_tail.json

XLA's GPU compiler runs without a GPU when JAX is given a compile-only device built from a target description
(`bench/gpu_targets/<name>.txtpb`: SM count, memory sizes, compute capability; `--target`). The decode program
(the engine's own, `Runner.for_lowering`: abstract parameters and pools, nothing allocated) is compiled for it
and its optimized HLO lists what one call launches. The count walks the executed computations from ENTRY:
- a fusion, a custom call (cuBLAS GEMM, Pallas/Triton kernel, TopK), a copy, a collective, any other op that is
  not free: one launch;
- free: parameter, constant, bitcast, tuple, get-tuple-element, the `-done` halves of async pairs, barriers;
- a while loop: its body and condition per trip (XLA's `known_trip_count`), plus one device-to-host copy of the
  predicate per evaluation (the host decides whether to loop again); an unknown trip count counts once and is
  reported;
- a conditional: the predicate copy plus its largest branch (reported: a step takes one branch);
- a call: its computation.
Fused computations' insides are not walked (a fusion is one kernel whatever it holds).

What this is not: a trace. cuBLAS may run a GEMM as two kernels (split-K), the runtime may add memsets, and the
compiler here is this host's jaxlib, not necessarily the GPU machine's, so fusion decisions can differ by
version. bench/profile_decode.py on the GPU stays the measure; this is the check between GPU sessions, and
`by_source` (bench/hlo_sources.py's source lines) says where the launches come from.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from bench.hlo_sources import instruction_metadata, kernel_name

TARGETS = Path(__file__).resolve().parent / "gpu_targets"

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLED = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
FREE = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all", "add-dependency",
        "opt-barrier", "partition-id", "replica-id"}


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    called: dict  # role -> computation name (branches: "branch0", "branch1", ...)
    trip: int | None


def _opcode(rest: str) -> tuple[str, str]:
    """'TYPE opcode(operands), attrs' -> (opcode, the text from the operands on). TYPE may be a tuple."""
    i = 0
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):  # noqa: B007 (i is used after the loop)
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        i += 1
    else:
        i = rest.find(" ")
    tail = rest[i:].lstrip()
    j = tail.find("(")
    return tail[:j].strip(), tail[j:]


def parse_module(text: str) -> tuple[str, dict[str, list[Instr]]]:
    """Optimized HLO text -> (entry computation name, {computation: [instructions]})."""
    comps: dict[str, list[Instr]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        op, tail = _opcode(m.group(2))
        called = {role: comp for role, comp in _CALLED.findall(tail)}
        b = _BRANCHES.search(tail)
        if b:
            for k, comp in enumerate(c.strip().lstrip("%") for c in b.group(1).split(",")):
                called[f"branch{k}"] = comp
        t = _TRIP.search(tail)
        comps[cur].append(Instr(m.group(1), op, called, int(t.group(1)) if t else None))
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return entry, comps


@dataclasses.dataclass
class Count:
    launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kernel -> per call
    predicate_copies: int = 0
    unknown_trip_loops: list = dataclasses.field(default_factory=list)
    conditionals: list = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.launches.values()) + self.predicate_copies

    def add(self, other: Count, mult: int):
        for k, v in other.launches.items():
            self.launches[k] += v * mult
        self.predicate_copies += other.predicate_copies * mult
        self.unknown_trip_loops += other.unknown_trip_loops
        self.conditionals += other.conditionals


def _count(comps: dict[str, list[Instr]], comp: str, stack: tuple = ()) -> Count:
    """Launches of one call of `comp` (the rules of this module's docstring)."""
    if comp in stack:
        raise ValueError(f"recursive computation {comp}")
    stack, out = stack + (comp,), Count()
    for ins in comps.get(comp, []):
        if ins.opcode in FREE or ins.opcode.endswith("-done"):
            continue
        if ins.opcode == "while":
            trip = ins.trip
            if trip is None:
                out.unknown_trip_loops.append(ins.name)
                trip = 1
            out.add(_count(comps, ins.called["body"], stack), trip)
            out.add(_count(comps, ins.called["condition"], stack), trip + 1)
            out.predicate_copies += trip + 1
        elif ins.opcode == "conditional":
            branches = [_count(comps, c, stack) for r, c in sorted(ins.called.items())
                        if r.startswith("branch") or r.endswith("_computation")]
            out.conditionals.append({"name": ins.name, "branch_launches": [b.total for b in branches]})
            if branches:
                out.add(max(branches, key=lambda b: b.total), 1)
            out.predicate_copies += 1
        elif ins.opcode == "call":
            out.add(_count(comps, ins.called.get("to_apply") or ins.called["calls"], stack), 1)
        else:
            out.launches[kernel_name(ins.name)] += 1
    return out


def count_launches(text: str) -> Count:
    """Launches per call of an optimized HLO module's ENTRY computation."""
    entry, comps = parse_module(text)
    return _count(comps, entry)


def by_source(text: str, launches: collections.Counter, top: int = 30) -> list[dict]:
    """Launches per call grouped by the JAX source line of each instruction (bench/hlo_sources.py)."""
    meta = instruction_metadata(text.splitlines())
    agg = collections.Counter()
    for k, n in launches.items():
        agg[meta.get(k, ("", k))[1]] += n
    return [{"source": s, "launches": n} for s, n in agg.most_common(top)]


def compile_only_device(target: str):
    """A compile-only CUDA device for `target` (bench/gpu_targets/<target>.txtpb); needs the CUDA plugin."""
    from jax.experimental import topologies

    spec = (TARGETS / f"{target}.txtpb").read_text()
    return topologies.get_topology_desc(target, platform="cuda", target_config=spec, topology="1x1x1").devices[0]


def decode_program_hlo(preset: str, weight_format: str | None, kernels: str, batch: int, context: int,
                       target: str) -> str:
    """The optimized HLO of the engine's decode program at `batch` rows, compiled for `target` without a GPU."""
    import jax

    from bench.common import kernel_args
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.kv_format import pages_for
    from dsv41_jax.ops import AUTO_XLA_OPS
    from serving.engine import EngineArgs
    from serving.engine.runner import Runner
    from serving.engine.step_io import DECODE, ProgramKey

    kw = {"weight_format": weight_format} if weight_format else {}
    cfg = ModelConfig.preset(preset, **kw)
    mml = -(-(context + 128) // 64) * 64
    # `auto` as a GPU resolves it for one device (serving/engine/config.py auto_kernels): this host has none
    choice = {"kernels": "pallas", "xla_ops": AUTO_XLA_OPS} if kernels == "auto" else kernel_args(kernels)
    args = EngineArgs(max_model_len=mml, max_num_seqs=batch, max_num_batched_tokens=cfg.window_size,
                      prefill_buckets=(cfg.window_size,), decode_buckets=(batch,), **choice,
                      enable_prompt_logprobs=False, enable_prefix_caching=False,
                      num_pages=1 + batch * pages_for(mml)).resolved(cfg)
    runner = Runner.for_lowering(cfg, args, pages_for(mml), None)
    with jax.default_device(compile_only_device(target)):
        return runner.lower(ProgramKey(DECODE, batch), platforms=("cuda",)).compile().as_text()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--weight-format", default=None, help="bf16 | fp8 (None: the preset's)")
    ap.add_argument("--kernels", default="auto", help="comma-separated: xla, pallas, auto")
    ap.add_argument("--batch", default="1", help="comma-separated decode batches")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--target", default="h200", help="bench/gpu_targets/<target>.txtpb")
    ap.add_argument("--hlo", default=None, help="count this optimized HLO text file instead of compiling")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--save-hlo", default=None, help="a folder: each compiled program's optimized HLO text goes there")
    ap.add_argument("--note", default="", help="recorded with the result (e.g. what the tree holds)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    if a.hlo:
        configs = [(None, None, Path(a.hlo).read_text())]
    else:
        configs = [(k, int(b), None) for k in a.kernels.split(",") for b in a.batch.split(",")]
    for impl, B, text in configs:
        t0 = time.perf_counter()
        if text is None:
            text = decode_program_hlo(a.preset, a.weight_format, impl, B, a.context, a.target)
            if a.save_hlo:
                Path(a.save_hlo).mkdir(parents=True, exist_ok=True)
                (Path(a.save_hlo) / f"decode_{a.preset}_{a.weight_format}_{impl}_b{B}.txt").write_text(text)
        c = count_launches(text)
        rows.append({"preset": a.preset, "weight_format": a.weight_format, "kernels": impl, "batch": B,
                     "target": a.target, "launches_per_call": c.total, "kernel_launches": sum(c.launches.values()),
                     "predicate_copies": c.predicate_copies, "unknown_trip_loops": c.unknown_trip_loops,
                     "conditionals": c.conditionals, "compile_s": round(time.perf_counter() - t0, 1),
                     "by_source": by_source(text, c.launches, a.top)})
        print(f"{impl} B={B}: {c.total} launches per call ({c.predicate_copies} predicate copies)",
              file=sys.stderr, flush=True)
    if a.out:
        from bench.common import device_name, write_result

        where = f"no GPU: compiled for bench/gpu_targets/{a.target}.txtpb on {device_name()}"
        write_result(a.out, {"rows": rows, "note": a.note}, "python -m bench.hlo_kernels " + " ".join(
            argv if argv is not None else sys.argv[1:]), source={"device": where})
    print(f"{'kernels':>8} {'batch':>5} {'launches':>9} {'pred. copies':>12}")
    for r in rows:
        print(f"{str(r['kernels']):>8} {str(r['batch']):>5} {r['launches_per_call']:>9} {r['predicate_copies']:>12}")
    if rows:
        print(json.dumps(rows[-1]["by_source"][:10], indent=1))
    return rows


if __name__ == "__main__":
    main()
