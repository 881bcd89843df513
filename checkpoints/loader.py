"""The one loader entry point: `load(path, weight_format=None, mesh=None) -> (ModelConfig, params)`.

Auto-detects the directory kind: an HF-layout checkpoint (config.json + model.safetensors.index.json or
model.safetensors; `hf_import`) or an Orbax one written by `save_orbax` / `python -m checkpoints.convert`
(dsv41_config.json + params/; `orbax_io`). weight_format None keeps the stored format; "bf16" dequantizes
FP8/FP4 weights (on the host while importing HF files, on device leaf by leaf after an Orbax restore);
asking for "fp8" from bf16 weights is an error (no silent requantization). The server calls this for
``serving.run --checkpoint DIR``; any problem raises `CheckpointError` before parameters are returned.
kernel_layout=True: the GEMM weights come back in the byte layouts the Pallas kernels read
(checkpoints/kernel_layout.py; the official layout for every kind today, so nothing moves).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from checkpoints.hf_import import import_hf
from checkpoints.hf_manifest import is_hf_dir
from checkpoints.orbax_io import is_orbax_dir, restore_orbax
from checkpoints.safetensors_io import CheckpointError
from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import expert_weight, lin_weight, tensor_specs

BF16 = jnp.bfloat16


def _table_bf16(node):
    codes = jax.lax.bitcast_convert_type(node["scale"], jnp.uint8)
    return quant.fp8_decode(node["weight"], codes, 32, BF16)


_DEQUANT = {"lin": lin_weight, "exp": expert_weight, "table": _table_bf16}


def to_bf16_weights(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """Dequantize every FP8 linear, MXFP4 expert and FP8 Engram table of an fp8-format tree, one leaf at a
    time on its device(s) (the FP8 leaf is released as soon as its bf16 copy exists)."""
    if cfg.weight_format == "bf16":
        return cfg, params
    for path, t in tensor_specs(cfg).items():
        if t.fmt not in _DEQUANT:
            continue
        parent = params
        for k in path[:-1]:
            parent = parent[k]
        node = parent[path[-1]]
        fn = jax.jit(_DEQUANT[t.fmt], out_shardings=node["weight"].sharding)
        parent[path[-1]] = {"weight": jax.block_until_ready(fn(node))}
        for leaf in node.values():
            leaf.delete()
    return cfg.replace(weight_format="bf16"), params


def load(path, *, weight_format: str | None = None, mesh=None, expert_axis: str | None = None,
         progress: bool = True, parallel=None, kernel_layout: bool = False) -> tuple[ModelConfig, dict]:
    """`mesh` + `parallel` (a dsv41_jax.sharding.Parallel): every leaf lands on its shards (see
    checkpoints.sharding); nothing is materialised whole on one device. kernel_layout: see the module doc."""
    cfg, params = _load(path, weight_format=weight_format, mesh=mesh, expert_axis=expert_axis, progress=progress,
                        parallel=parallel)
    if kernel_layout:
        from checkpoints.kernel_layout import to_kernel_layout

        params = to_kernel_layout(cfg, params)
    return cfg, params


def _load(path, *, weight_format, mesh, expert_axis, progress, parallel) -> tuple[ModelConfig, dict]:
    d = Path(path)
    if weight_format not in (None, "fp8", "bf16"):
        raise ValueError(f"weight_format {weight_format!r} not in (None, 'fp8', 'bf16')")
    if is_hf_dir(d):
        return import_hf(d, weight_format=weight_format, mesh=mesh, expert_axis=expert_axis, progress=progress,
                         parallel=parallel)
    if is_orbax_dir(d):
        cfg, params = restore_orbax(d, mesh=mesh, expert_axis=expert_axis, parallel=parallel)
        if weight_format == "fp8" and cfg.weight_format != "fp8":
            raise CheckpointError(f"{d}: holds bf16 weights; weight_format 'fp8' would need requantization")
        if weight_format == "bf16":
            cfg, params = to_bf16_weights(cfg, params)
        return cfg, params
    raise CheckpointError(f"{d}: neither an HF checkpoint (config.json + model.safetensors.index.json) nor an "
                          "Orbax one (dsv41_config.json + params/)")
