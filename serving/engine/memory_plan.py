"""The memory plan of a model on GPUs, from the code's own accounting: weights, KV pages, SWA rings, Engram staging
buffers per GPU, and host memory per host.

    python -m serving.engine.memory_plan --preset full --layouts TP4,DEP4,DEP2 [--markdown]

Where each figure comes from:
- weights: every leaf of `params.param_specs(cfg)` (the Engram tables left out when they are host tables), divided
  by the mesh size along the dimension the layout's rules split (`sharding.partition_spec`, as the engine places
  them); replicated leaves count whole on every GPU;
- SWA rings, compressor state (and exact-mode snapshots): the runner's own pool shapes (`Runner._pool_shapes`,
  built abstractly by `Runner.for_lowering`), per GPU (DP / DEP: one rank's block; TP: replicated);
- Engram staging (host tables): the device inputs of the largest prefill call and the largest decode call in
  flight together (one uint8 [rows, T, n_cols, row_bytes] per Engram layer and rank); on the host, the feeder's
  span and staging buffers for the same calls, twice (one being filled while one is copied);
- KV pages: whatever the GPU has left after the above and `reserve_gib` for activations and XLA's workspace (an
  assumption, not measured), in whole pages of `PageLayout.page_bytes` (64 tokens; TP replicates the pages, so a
  TP group holds one rank's worth of KV, a DEP group one per rank);
- host: the Engram tables once per host (checkpoints.host_tables shares one copy between processes).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import numpy as np

GIB = 2 ** 30
H200_GIB = 143771 / 1024  # nvidia-smi's total for an H200 (143,771 MiB)
RESERVE_GIB = 10.0  # activations and XLA workspace per GPU (an assumption)


@dataclass(frozen=True)
class Plan:
    layout: str
    gpus: int
    weights: float  # bytes per GPU
    rings: float  # SWA rings + compressor state (+ snapshots) per GPU
    staging: float  # Engram row inputs on the device per GPU
    reserve: float
    pages: int  # KV pages per GPU (0 when the rest does not fit)
    page_bytes: int
    kv_tokens: int  # tokens of global KV the whole group holds
    host_tables: float  # bytes per host (one copy)
    host_staging: float
    fits: bool

    @property
    def kv(self) -> float:
        return self.pages * self.page_bytes

    def row(self, gpu_gib: float) -> dict:
        g = lambda b: round(b / GIB, 2)  # noqa: E731
        return {"layout": self.layout, "gpus": self.gpus, "weights_gib": g(self.weights), "rings_gib": g(self.rings),
                "staging_gib": g(self.staging), "reserve_gib": g(self.reserve), "kv_gib": g(self.kv),
                "kv_pages": self.pages, "kv_tokens": self.kv_tokens, "gpu_gib": round(gpu_gib, 2),
                "host_tables_gib": g(self.host_tables), "host_staging_gib": g(self.host_staging), "fits": self.fits}


def _parallel(layout: str):
    from dsv41_jax.sharding import Parallel

    m = re.fullmatch(r"(TP|DP|DEP)(\d+)", layout.upper())
    if m is None:
        raise ValueError(f"layout {layout!r}: TP<n>, DP<n> or DEP<n>")
    kind, n = m.group(1), int(m.group(2))
    if kind == "TP":
        return Parallel("tp", n)
    return Parallel("dp", n, ep=kind == "DEP")


def weight_bytes_per_gpu(cfg, par, host_tables: bool) -> float:
    from dsv41_jax.params import param_specs
    from dsv41_jax.sharding import partition_spec

    mesh = par.abstract_mesh()
    total = 0.0
    for path, leaf in param_specs(cfg).items():
        if host_tables and path[0] == "engram" and path[2] == "embed":  # the table and its scales
            continue
        n = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        spec = partition_spec(leaf.axes, leaf.shape, mesh, par.rules)
        split = sum(1 for s in spec if s is not None)
        total += n / (par.size ** split)
    return total


def plan(cfg, layout: str, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 4096,
         host_tables: bool = True, gpu_gib: float = H200_GIB, reserve_gib: float = RESERVE_GIB,
         swa_bounded_replay: bool = True) -> Plan:
    """The plan of `cfg` under `layout` ("TP4", "DEP4", "DEP2"): per GPU, and per host (module docstring).
    `max_num_seqs` and `max_num_batched_tokens` are per data-parallel rank, as the engine's flags."""
    from dsv41_jax.engram_rows import row_format
    from dsv41_jax.kv_format import pages_for
    from serving.engine.config import EngineArgs
    from serving.engine.engram_host import EngramConfig
    from serving.engine.runner import Runner

    par = _parallel(layout).resolved("gpu")
    n = par.size
    args = EngineArgs(max_model_len=cfg.max_seq_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, num_pages=1, kernels="xla",
                      swa_bounded_replay=swa_bounded_replay, snapshot_slots=8 * max_num_seqs)
    args.parallel = par
    args.engram = EngramConfig(cpu_offload=host_tables)
    runner = Runner.for_lowering(cfg, args, pages_for(cfg.max_seq_len), par.abstract_mesh())
    shapes = runner._pool_shapes()
    dp = par.mode == "dp"
    rings = sum(math.prod(s) * np.dtype(dt).itemsize for k, (s, dt, _) in shapes.items() if k != "pages")
    rings = rings / n if dp else rings
    page_bytes = runner.layout.page_bytes
    fmt = row_format(cfg)
    E, C = len(cfg.engram_layer_ids), cfg.engram_layout.n_cols if cfg.engram_layer_ids else 0
    per_row = E * C * fmt.row_bytes  # one token's Engram rows
    call_rows = max_num_batched_tokens + max_num_seqs  # a prefill call and a decode call in flight (per rank)
    staging = call_rows * per_row if host_tables else 0.0
    host_staging = 2 * 2 * call_rows * per_row * (n if dp else 1) if host_tables else 0.0
    weights = weight_bytes_per_gpu(cfg, par, host_tables)  # device tables: leaves of param_specs, replicated
    free = gpu_gib * GIB - weights - rings - staging - reserve_gib * GIB
    pages = max(int(free // page_bytes), 0)
    tokens = pages * 64 * (n if dp else 1)
    tables = sum(r * fmt.row_bytes for r in cfg.engram_rows) if host_tables else 0.0
    return Plan(layout.upper(), n, weights, rings, staging, reserve_gib * GIB, pages, page_bytes, tokens, tables,
                host_staging, free > 0)


def markdown(plans: list[Plan], gpu_gib: float = H200_GIB) -> str:
    """docs/PARALLELISM.md's table."""
    lines = ["| layout | GPUs | weights / GPU | SWA rings + compressor / GPU | Engram staging / GPU | reserve / GPU | "
             "KV pages / GPU | KV tokens (group) | host: Engram tables | host: staging |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        r = p.row(gpu_gib)
        kv = f"{r['kv_gib']} GiB ({p.pages:,} pages)" if p.fits else \
            f"**does not fit**: {round((p.weights + p.rings + p.staging + p.reserve) / GIB - gpu_gib, 2)} GiB over"
        tok = f"{p.kv_tokens:,}" if p.fits else "0"
        lines.append(f"| {p.layout} | {p.gpus} | {r['weights_gib']} GiB | {r['rings_gib']} GiB | "
                     f"{r['staging_gib']} GiB | {r['reserve_gib']} GiB | {kv} | {tok} | {r['host_tables_gib']} GiB | "
                     f"{r['host_staging_gib']} GiB |")
    return "\n".join(lines) + "\n"


def doc_plans(cfg=None) -> list[Plan]:
    """The plans docs/PARALLELISM.md shows (tests/test_memory_plan.py checks the table against them)."""
    from dsv41_jax.config import ModelConfig

    cfg = cfg or ModelConfig.preset("full")
    return [plan(cfg, lay) for lay in ("TP4", "DEP4", "DEP2")]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m serving.engine.memory_plan")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--layouts", default="TP4,DEP4,DEP2")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--device-tables", action="store_true", help="Engram tables on the GPUs (replicated)")
    ap.add_argument("--gpu-gib", type=float, default=H200_GIB)
    ap.add_argument("--reserve-gib", type=float, default=RESERVE_GIB)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    from dsv41_jax.config import ModelConfig

    cfg = ModelConfig.preset(a.preset)
    plans = [plan(cfg, lay, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                  host_tables=not a.device_tables, gpu_gib=a.gpu_gib, reserve_gib=a.reserve_gib)
             for lay in a.layouts.split(",")]
    if a.markdown:
        print(markdown(plans, a.gpu_gib), end="")
    else:
        for p in plans:
            print(p.row(a.gpu_gib))


if __name__ == "__main__":
    main()
