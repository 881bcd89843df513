"""Checkpoints: the official HF layout (safetensors + index + config.json), Orbax, random init.

    cfg, params = checkpoints.load(path, weight_format=None, mesh=None)   # HF dir or Orbax dir
    params = checkpoints.random_init(cfg, seed, mesh=None)                # on device, never on the host
    checkpoints.write_hf(cfg, params, out)                                # python -m checkpoints.make_hf
    checkpoints.save_orbax(out, cfg, params)                              # python -m checkpoints.convert

Modules: `hf_layout` (official names -> our leaves), `hf_config` (config.json), `safetensors_io` (files),
`hf_manifest` (validation), `host_quant` (host dequantization), `hf_import` (streaming import),
`make_hf` (writer), `orbax_io`, `sharding` (leaf placement), `random_params`, `loader`, `tree`, `host_tables`
(Engram tables in host memory: `load(..., host_tables=StoreOptions())` reads them there, never onto a device).
Every bad input raises `CheckpointError` (a ValueError) naming the tensor or file, before any weight loads.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "checkpoints.safetensors_io", "import_hf": "checkpoints.hf_import", "load": "checkpoints.loader",
    "param_shardings": "checkpoints.sharding", "random_init": "checkpoints.random_params",
    "restore_orbax": "checkpoints.orbax_io", "save_orbax": "checkpoints.orbax_io",
    "to_bf16_weights": "checkpoints.loader", "to_hf_dict": "checkpoints.hf_config", "write_hf": "checkpoints.make_hf",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    """Lazy exports, so `python -m checkpoints.<module>` does not import that module twice."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'checkpoints' has no attribute {name!r}")
