"""Checkpoint I/O: HF import and Orbax save/restore times, and peak host RSS of each phase.

    python -m bench.checkpoint_io --preset small                       # CPU
    python -m bench.checkpoint_io --preset medium --weight-format fp8 --dir /tmp/dsv41_ckpt   # GPU

Every phase runs in a fresh subprocess (`--child PHASE`) so its peak RSS (VmHWM, and ru_maxrss) is its own:
  baseline  an idle process: python + jax + the checkpoint modules imported, backend started;
  make_hf   random_init on the device + write_hf (synthetic checkpoint; --shard-size-mb);
  import    checkpoints.load(HF dir) onto the device, run "cold" (the files' page cache evicted first with
            posix_fadvise DONTNEED) and "warm", --repeats times each (median time, largest peak);
  convert   HF import (untimed) + save_orbax (timed);
  restore   checkpoints.load(Orbax dir), cold and warm, --repeats times each.
Reported per phase: wall time of the work itself (imports excluded), peak RSS, and peak RSS minus the idle
baseline's peak. On CPU the parameters themselves live in host memory, so the loader's own overhead is
peak - baseline - parameter bytes; on a GPU the parameters are on the device and the target is peak -
baseline < 1.3 x the largest shard. Results go to bench/results/checkpoint_io_<preset>_<backend>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PHASES = ("make_hf", "import", "convert", "restore")


# ----------------------------------------------------------------------------- child side
def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def _mem() -> dict:
    return {"vm_hwm_mb": _status_kb("VmHWM") / 1024, "vm_rss_mb": _status_kb("VmRSS") / 1024,
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _device_mem() -> dict:
    import jax

    st = jax.devices()[0].memory_stats() or {}
    return {k: st[k] / 2 ** 20 for k in ("bytes_in_use", "peak_bytes_in_use") if k in st}


def _child(a) -> dict:
    import jax
    import numpy as np

    import dsv41_jax  # noqa: F401
    from checkpoints.loader import load
    from checkpoints.tree import nbytes

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.device_put(np.zeros(8, np.float32))))  # start the backend
    start = _mem()
    hf, ob = Path(a.dir) / "hf", Path(a.dir) / "orbax"
    out: dict = {"start": start}
    t0 = time.perf_counter()
    if a.child == "make_hf":
        from checkpoints.make_hf import write_hf
        from checkpoints.random_params import random_init
        from dsv41_jax.config import ModelConfig

        cfg = ModelConfig.preset(a.preset, weight_format=a.weight_format)
        params = jax.block_until_ready(random_init(cfg, 0))
        out["init_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        out["write"] = write_hf(cfg, params, hf, shard_size_mb=a.shard_size_mb, overwrite=True)
        out["write_s"] = time.perf_counter() - t1
    elif a.child == "import":
        _, params = load(hf, progress=True)
        out["params_bytes"] = nbytes(params)
    elif a.child == "convert":
        from checkpoints.orbax_io import save_orbax

        cfg, params = load(hf, progress=True)
        t0 = time.perf_counter()
        save_orbax(ob, cfg, params, overwrite=True)
        out["params_bytes"] = nbytes(params)
    elif a.child == "restore":
        _, params = load(ob)
        out["params_bytes"] = nbytes(params)
    elif a.child != "baseline":
        raise SystemExit(f"unknown phase {a.child}")
    out["time_s"] = time.perf_counter() - t0
    out["end"] = _mem()
    out["backend"] = jax.default_backend()
    out["device_mem_mb"] = _device_mem()
    return out


# ----------------------------------------------------------------------------- parent side
def _evict(*dirs):
    """Drop the page cache of every file under `dirs` (clean pages; no root needed)."""
    for d in dirs:
        for p in Path(d).rglob("*") if Path(d).exists() else ():
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _run_child(a, phase: str) -> dict:
    cmd = [sys.executable, "-m", "bench.checkpoint_io", "--child", phase, "--preset", a.preset, "--weight-format",
           a.weight_format, "--dir", a.dir, "--shard-size-mb", str(a.shard_size_mb)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        raise SystemExit(f"phase {phase} failed (rc {r.returncode}):\n{r.stdout}")
    return json.loads(line[-1][len("RESULT "):])


def _du(d) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file()) if Path(d).exists() else 0


def _summary(runs: list[dict], base_mb: float) -> dict:
    """Median time and the largest peak RSS over the repeats of one phase."""
    peak = max(r["end"]["vm_hwm_mb"] for r in runs)
    res = runs[0]
    s = {"time_s": round(statistics.median(r["time_s"] for r in runs), 2), "runs": len(runs),
         "peak_rss_mb": round(peak, 1), "peak_minus_baseline_mb": round(peak - base_mb, 1)}
    if len(runs) > 1:
        s["times_s"] = [round(r["time_s"], 2) for r in runs]
    if "params_bytes" in res:
        s["params_mb"] = round(res["params_bytes"] / 2 ** 20, 1)
    if res.get("device_mem_mb"):
        s["device_mem_mb"] = {k: round(max(r["device_mem_mb"][k] for r in runs), 1) for k in res["device_mem_mb"]}
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--weight-format", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--dir", default=None, help="work directory (default /tmp/dsv41_ckpt_<preset>_<fmt>)")
    ap.add_argument("--shard-size-mb", type=float, default=4096)
    ap.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)}")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each cold / warm import and restore")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint files afterwards")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.dir = a.dir or f"/tmp/dsv41_ckpt_{a.preset}_{a.weight_format}"
    if a.child:
        print("RESULT " + json.dumps(_child(a)), flush=True)
        return
    from tqdm import tqdm

    phases = [p for p in a.phases.split(",") if p]
    bad = set(phases) - set(PHASES)
    if bad:
        raise SystemExit(f"unknown phase(s) {sorted(bad)}")
    hf, ob = Path(a.dir) / "hf", Path(a.dir) / "orbax"
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    raw: dict = {}
    timed = [(p, k) for p in phases for k in (("cold", "warm") if p in ("import", "restore") else ("",))]
    steps = [("baseline", "")] + [(p, k) for p, k in timed for _ in range(a.repeats if k else 1)]
    for phase, kind in tqdm(steps, desc="phases", unit="phase", file=sys.stderr):
        if kind != "warm":
            _evict(hf, ob)
        raw.setdefault(phase + (f"_{kind}" if kind else ""), []).append(_run_child(a, phase))
    base = raw["baseline"][0]["end"]["vm_hwm_mb"]
    shards = sorted(hf.glob("*.safetensors"))
    largest = max((p.stat().st_size for p in shards), default=0)
    res = {"preset": a.preset, "weight_format": a.weight_format, "backend": raw["baseline"][0]["backend"],
           "shards": len(shards), "largest_shard_mb": round(largest / 2 ** 20, 1),
           "hf_checkpoint_mb": round(_du(hf) / 2 ** 20, 1), "orbax_checkpoint_mb": round(_du(ob) / 2 ** 20, 1),
           "baseline_peak_rss_mb": round(base, 1), "phases": {}}
    for k, v in raw.items():
        if k == "baseline":
            continue
        s = _summary(v, base)
        if k == "make_hf":
            s.update(init_s=round(v[0]["init_s"], 2), write_s=round(v[0]["write_s"], 2))
        res["phases"][k] = s
    for k, mb in (("import_cold", "hf_checkpoint_mb"), ("import_warm", "hf_checkpoint_mb"),
                  ("restore_cold", "orbax_checkpoint_mb"), ("restore_warm", "orbax_checkpoint_mb")):
        if k in res["phases"] and res["phases"][k]["time_s"] > 0:
            res["phases"][k]["read_mb_per_s"] = round(res[mb] / res["phases"][k]["time_s"], 1)
    imp = res["phases"].get("import_cold")
    if imp and largest:
        res["import_peak_over_largest_shard"] = round(imp["peak_minus_baseline_mb"] * 2 ** 20 / largest, 3)
        if res["backend"] == "cpu":  # parameters live in host memory on CPU
            res["import_loader_overhead_mb"] = round(imp["peak_minus_baseline_mb"] - imp["params_mb"], 1)
            res["note"] = "CPU: the parameters are host memory, so peak - baseline includes them"
    print(json.dumps(res, indent=1))
    out = a.out or f"bench/results/checkpoint_io_{a.preset}_{res['backend']}.json"
    cmd = "python -m bench.checkpoint_io " + " ".join(argv if argv is not None else sys.argv[1:])
    import dsv41_jax  # noqa: F401  (the parent starts its JAX backend only now, after every phase is done)
    from bench.common import write_result

    write_result(out, res, command=cmd.strip())
    print(f"-> {out}")
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
