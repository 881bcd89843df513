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
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
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


# `--kernels` choices of the decode benchmarks beyond the engine's own ("xla", "pallas", "auto"): name -> the ops kept
# on XLA beside `--kernels auto`'s (dsv41_jax.ops.AUTO_XLA_OPS). "auto-xla-sinkhorn" is the auto of before the
# Sinkhorn kernel ran inside XLA's mHC boundary (its while loop on XLA), for side-by-side runs.
KERNEL_VARIANTS = {"auto-xla-sinkhorn": ("hc_coefficients",)}


def kernel_args(spec: str) -> dict:
    """EngineArgs keywords for a benchmark's `--kernels` entry (an engine choice or a KERNEL_VARIANTS name)."""
    if spec in KERNEL_VARIANTS:
        from dsv41_jax.ops import AUTO_XLA_OPS

        return {"kernels": "pallas", "xla_ops": AUTO_XLA_OPS + KERNEL_VARIANTS[spec]}
    return {"kernels": spec}
