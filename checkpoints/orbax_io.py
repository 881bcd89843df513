"""Orbax checkpoints of the parameters: DIR/params (an Orbax StandardCheckpointer tree) + DIR/dsv41_config.json.

The saved tree is the plain parameter pytree (`dsv41_jax.params` layout, FP8/FP4 leaves kept as they are
when cfg.weight_format == "fp8"); an `nnx_model.DSV41` module or its `nnx.state` can be passed too.
Restore builds the abstract tree from the saved config (`abstract_params`) with a sharding per leaf
(`checkpoints.sharding`, a mesh or the default device), checks it against the checkpoint's metadata
before reading any array (a mismatch names the leaf), and lets Orbax read straight into device buffers.
The config is written after the arrays, so a directory with `dsv41_config.json` is complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoints.safetensors_io import CheckpointError
from checkpoints.sharding import abstract_sharded
from checkpoints.tree import flat
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import abstract_params

CONFIG_NAME = "dsv41_config.json"
PARAMS_DIR = "params"
FORMAT = "dsv41-orbax-1"


def config_to_json(cfg: ModelConfig) -> str:
    d = {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v) for f in dataclasses.fields(cfg)}
    return json.dumps({"format": FORMAT, "config": d}, indent=1) + "\n"


def config_from_json(text: str, where: str = CONFIG_NAME) -> ModelConfig:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: unreadable ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("config"), dict):
        raise CheckpointError(f"{where}: not a {FORMAT} config")
    d = raw["config"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown config field(s) {unknown}")
    try:
        return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def is_orbax_dir(directory) -> bool:
    d = Path(directory)
    return (d / CONFIG_NAME).is_file() and (d / PARAMS_DIR).is_dir()


def _pure(params) -> dict:
    """Plain pytree from a params dict, a DSV41 module or an nnx.State of one."""
    if hasattr(params, "pure_params"):
        return params.pure_params()
    if not isinstance(params, dict | list):
        from flax import nnx

        pure = nnx.to_pure_dict(params)
        pure = pure.get("params", pure)

        def lists(t):
            if isinstance(t, dict):
                if t and all(isinstance(k, int) for k in t):
                    return [lists(t[i]) for i in range(len(t))]
                return {k: lists(v) for k, v in t.items()}
            return t

        return lists(pure)
    return params


def _checkpointer(concurrent_gb: int | None):
    if concurrent_gb:
        return ocp.StandardCheckpointer(save_concurrent_gb=concurrent_gb, restore_concurrent_gb=concurrent_gb)
    return ocp.StandardCheckpointer()


def save_orbax(directory, cfg: ModelConfig, params, *, overwrite: bool = False) -> Path:
    """Save `params` of `cfg` under `directory` (absolute path used; waits until written)."""
    d = Path(directory).absolute()
    params = _pure(params)
    want, got = flat(abstract_params(cfg)), flat(params)
    if want.keys() != got.keys() or any(want[k].shape != got[k].shape or want[k].dtype != got[k].dtype
                                        for k in want):
        bad = sorted(set(want) ^ set(got)) or [k for k in want if (want[k].shape, want[k].dtype) !=
                                                (got[k].shape, got[k].dtype)]
        raise CheckpointError(f"save_orbax: parameters do not match config {cfg.name} "
                              f"(weight_format {cfg.weight_format}): first difference at {bad[0]}")
    d.mkdir(parents=True, exist_ok=True)
    if (d / CONFIG_NAME).exists():
        if not overwrite:
            raise CheckpointError(f"{d}: already holds a checkpoint; pass overwrite=True")
        (d / CONFIG_NAME).unlink()
    ck = _checkpointer(None)
    ck.save(d / PARAMS_DIR, params, force=overwrite)
    ck.wait_until_finished()
    (d / CONFIG_NAME).write_text(config_to_json(cfg))
    return d


def read_config(directory) -> ModelConfig:
    p = Path(directory) / CONFIG_NAME
    try:
        text = p.read_text()
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e})") from None
    return config_from_json(text, str(p))


def restore_orbax(directory, *, mesh=None, expert_axis: str | None = None,
                  concurrent_gb: int | None = None, parallel=None, table_device=None) -> tuple[ModelConfig, dict]:
    """(cfg, params) as saved; leaves placed per `checkpoints.sharding` (mesh or default device; `parallel`:
    an engine layout's rules), read by Orbax straight into each device's shard. `table_device` (a CPU
    device): the Engram tables are read into host memory there instead (host tables)."""
    d = Path(directory).absolute()
    cfg = read_config(d)
    target = abstract_sharded(cfg, mesh, expert_axis, parallel)
    if table_device is not None:
        from jax.sharding import SingleDeviceSharding

        from checkpoints.tree import map_with_path

        host = SingleDeviceSharding(table_device)
        target = map_with_path(lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host)
                               if p[0] == "engram" and p[2] == "embed" else a, target)
    ck = _checkpointer(concurrent_gb)
    if not (d / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{d / PARAMS_DIR}: missing Orbax checkpoint directory")
    try:
        meta = ck.metadata(d / PARAMS_DIR)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{d / PARAMS_DIR}: unreadable Orbax checkpoint ({e})") from None
    meta_tree = getattr(meta, "item_metadata", meta)  # StepMetadata (orbax >= 0.11) or the tree itself
    meta_tree = getattr(meta_tree, "tree", meta_tree)
    _check_metadata(d / PARAMS_DIR, flat(meta_tree), flat(target))
    params = ck.restore(d / PARAMS_DIR, target)
    return cfg, jax.block_until_ready(params)


def _check_metadata(where: Path, have: dict, want: dict):
    """Every parameter present with the config's shape and dtype, nothing else (before reading any array)."""
    for path in want:
        if path not in have:
            raise CheckpointError(f"{where}: missing parameter {path}")
        m = have[path]
        if tuple(m.shape) != tuple(want[path].shape) or np.dtype(m.dtype) != np.dtype(want[path].dtype):
            raise CheckpointError(f"{where}: parameter {path} is {np.dtype(m.dtype)}{list(m.shape)}, "
                                  f"config needs {np.dtype(want[path].dtype)}{list(want[path].shape)}")
    extra = sorted(set(have) - set(want), key=str)
    if extra:
        raise CheckpointError(f"{where}: unexpected parameter {extra[0]} for this config")
