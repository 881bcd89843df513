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
         progress: bool = True, parallel=None, host_tables=None, kernel_layout: bool = False):
    """`mesh` + `parallel` (a dsv41_jax.sharding.Parallel): every leaf lands on its shards (see
    checkpoints.sharding); nothing is materialised whole on one device.
    `host_tables` (a checkpoints.host_tables.StoreOptions): the Engram tables go to host memory, never to a
    device; returns (cfg, params without the tables, HostTables). kernel_layout: see the module doc.
    Returns (cfg, params) otherwise."""
    if host_tables is not None:
        out = _load_host_tables(Path(path), weight_format, mesh, expert_axis, progress, parallel, host_tables)
    else:
        out = _load(path, weight_format=weight_format, mesh=mesh, expert_axis=expert_axis, progress=progress,
                    parallel=parallel)
    if kernel_layout:
        from checkpoints.kernel_layout import to_kernel_layout

        out = (out[0], to_kernel_layout(out[0], out[1]), *out[2:])
    return out


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


def _load_host_tables(d: Path, weight_format, mesh, expert_axis, progress, parallel, opts):
    from checkpoints import host_tables
    from checkpoints.hf_manifest import inspect
    from dsv41_jax.engram_rows import split_tables

    if is_hf_dir(d):
        man = inspect(d)  # every header checked before anything is read
        cfg = man.cfg.replace(weight_format=weight_format or man.cfg.weight_format)
        if cfg.weight_format == "fp8" and not man.quantized:
            raise CheckpointError(f"{man.directory}: weight_format 'fp8' needs an FP8 checkpoint (config.json has no "
                                  "fp8 quantization_config); load it with weight_format='bf16'")
        tables = host_tables.from_hf(man, cfg, opts)  # first: a bad table row fails before any device weight
        try:
            cfg, params = import_hf(d, weight_format=weight_format, mesh=mesh, expert_axis=expert_axis,
                                    progress=progress, parallel=parallel, tables=False)
        except BaseException:
            tables.close()
            raise
        return cfg, params, tables
    if is_orbax_dir(d):
        if weight_format == "bf16":
            raise CheckpointError(f"{d}: host Engram tables from an Orbax checkpoint keep its weight format; "
                                  "convert it first (python -m checkpoints.convert)")
        cfg, params = restore_orbax(d, mesh=mesh, expert_axis=expert_axis, parallel=parallel,
                                    table_device=jax.devices("cpu")[0])
        if weight_format == "fp8" and cfg.weight_format != "fp8":
            raise CheckpointError(f"{d}: holds bf16 weights; weight_format 'fp8' would need requantization")
        params, nodes = split_tables(params)
        key = host_tables.content_key("orbax", str(d.resolve()), (d / "dsv41_config.json").stat().st_mtime_ns)
        tables = host_tables.from_arrays(cfg, nodes, opts, key)
        for leaf in jax.tree.leaves(nodes):
            leaf.delete()
        return cfg, params, tables
    raise CheckpointError(f"{d}: neither an HF checkpoint (config.json + model.safetensors.index.json) nor an "
                          "Orbax one (dsv41_config.json + params/)")
