"""Shared helpers for benchmarks: result files carry device, date, commit and command."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

import jax


def device_name() -> str:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    return f"{d.platform}:{kind}" if d.platform != "cpu" else f"cpu:{platform.processor() or platform.machine()}"


def git_commit() -> str:
    import os

    if os.environ.get("DSV41_COMMIT"):  # the device machine gets the tree without .git
        return os.environ["DSV41_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        # a tree that differs from HEAD says so (the device machine's .git can be older than the tree it runs)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(path, result: dict, command: str, source: dict | None = None):
    """`source` (device, jax, date, commit) overrides this process's: a file derived from runs made elsewhere."""
    now = datetime.datetime.now().isoformat(timespec="seconds")
    rec = {"device": device_name(), "jax": jax.__version__, "date": now, "commit": git_commit(), "command": command}
    rec.update({k: v for k, v in (source or {}).items() if k in rec and v})
    rec["result"] = result
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rec, indent=2) + "\n")
    return rec


# `--kernels` choices of the decode benchmarks beyond the engine's own ("xla", "pallas", "auto"): name -> (ops added
# to, ops taken from) `--kernels auto`'s XLA list (dsv41_jax.ops.AUTO_XLA_OPS), for side-by-side runs of one kernel
# choice. "auto-xla-sinkhorn": the auto of before the Sinkhorn kernel ran inside XLA's mHC boundary; "auto+<kernel>":
# auto with one kernel that auto keeps on XLA switched on (Mega-mHC, Mega-Gate, the fused ring write, the one-launch
# FP8 quantisation of the GEMMs' inputs).
KERNEL_VARIANTS = {"auto-xla-sinkhorn": (("hc_coefficients",), ()),
                   "auto+mega-mhc": ((), ("hc_boundary",)),
                   "auto+mega-gate": ((), ("gate",)),
                   "auto+ring-write": ((), ("ring_write",)),
                   "auto-f32-head": (("lm_head",), ()),
                   "auto+act-quant": ((), ("act_quant",))}


def kernel_args(spec: str) -> dict:
    """EngineArgs keywords for a benchmark's `--kernels` entry (an engine choice or a KERNEL_VARIANTS name)."""
    if spec in KERNEL_VARIANTS:
        from dsv41_jax.ops import AUTO_XLA_OPS

        add, drop = KERNEL_VARIANTS[spec]
        return {"kernels": "pallas", "xla_ops": tuple(o for o in AUTO_XLA_OPS if o not in drop) + add}
    return {"kernels": spec}
