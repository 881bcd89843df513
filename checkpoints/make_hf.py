"""Write parameters in the official HF layout: config.json, sharded safetensors, model.safetensors.index.json.

    python -m checkpoints.make_hf --config tiny --seed 0 --out DIR [--shard-size-mb 4096] [--weight-format fp8]

The CLI makes a synthetic checkpoint: random parameters of a preset (`random_init`, on device) written in
the layout `import_hf` reads. `write_hf(cfg, params, out)` is the library entry point.

Invariants: the layout follows cfg.weight_format: "fp8" writes the official quantized layout (FP8 E4M3 +
UE8M0 32x32 scales, MXFP4 experts as I8 [out, in/2] + scales, FP8 Engram tables; wo_a quantized from its
bf16 leaf, exactly, since random init keeps it FP8-representable), "bf16" writes every weight as BF16 with no
scales and no quantization_config. Shards are planned from the names/dtypes/shapes alone, each header is
written first and tensors are streamed one at a time from the device (host memory: one tensor). Files are
written before the index and config.json, so an interrupted run never looks like a valid checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from jax import lax
from tqdm import tqdm

import dsv41_jax  # noqa: F401  (sets XLA flags before the backend starts)
from checkpoints.hf_config import CONFIG_NAME, write_hf_config
from checkpoints.hf_layout import I8, Stored, stored_tensors
from checkpoints.hf_manifest import INDEX_NAME
from checkpoints.safetensors_io import CheckpointError, ShardWriter, group_by_size
from checkpoints.tree import flat
from dsv41_jax import quant
from dsv41_jax.config import ModelConfig

DEFAULT_SHARD_MB = 4096


@functools.partial(jax.jit, static_argnums=2)
def _take(x, start, k):
    """x[start[0], ..., start[k-1]] with traced indices (one compile per leaf shape, not per index)."""
    sizes = (1,) * k + x.shape[k:]
    return lax.dynamic_slice(x, tuple(start) + (0,) * (x.ndim - k), sizes).reshape(x.shape[k:])


_quantize_fp8 = jax.jit(quant.quantize_weight_fp8)


def _get(leaf, index):
    if not index:
        return leaf
    return _take(leaf, tuple(np.int32(i) for i in index), len(index))


def _tensors(cfg: ModelConfig, params, stored: list[Stored]):
    """Yield (Stored, numpy array) in order, one tensor at a time."""
    leaves, quantized = flat(params), cfg.weight_format == "fp8"
    stash = None
    for st in stored:
        e = st.entry
        if e.fmt == "dense":
            arr = np.asarray(_get(leaves[e.path], e.index)).astype(st.dtype)
        elif not quantized:
            arr = np.asarray(_get(leaves[e.path if e.fmt == "fp8_to_bf16" else e.path + ("weight",)], e.index))
        elif e.fmt == "fp8_to_bf16":  # bf16 in the model, FP8 + scale in the checkpoint
            if st.role == "weight":
                w, stash = _quantize_fp8(_get(leaves[e.path], e.index))
                arr = np.asarray(w)
            else:
                arr, stash = np.asarray(stash), None
        else:
            arr = np.asarray(_get(leaves[e.path + (st.role,)], e.index))
            if st.dtype == I8:
                arr = arr.view(I8)
        if arr.dtype != st.dtype or arr.shape != tuple(st.shape):
            raise CheckpointError(f"tensor {st.name}: parameters give {arr.dtype}{list(arr.shape)}, the layout "
                                  f"needs {st.dtype}{list(st.shape)}")
        yield st, arr


def plan_shards(stored: list[Stored], shard_bytes: int) -> list[list[Stored]]:
    return group_by_size(stored, lambda st: math.prod(st.shape) * st.dtype.itemsize, shard_bytes)


def _prepare(out, overwrite: bool) -> Path:
    """Create `out`; refuse (or, with overwrite, delete) a checkpoint already there."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    old = [p for p in out.iterdir() if p.name in (CONFIG_NAME, INDEX_NAME) or p.suffix == ".safetensors"
           or p.name.endswith(".safetensors.xz")]
    if old and not overwrite:
        raise CheckpointError(f"{out}: already holds a checkpoint ({old[0].name}); pass overwrite=True / --force")
    for p in old:
        p.unlink()
    return out


def write_hf(cfg: ModelConfig, params, out, *, shard_size_mb: float = DEFAULT_SHARD_MB, overwrite: bool = False,
             progress: bool = True) -> dict:
    """Write `params` (the tree of `cfg`) to directory `out`; returns a summary dict."""
    out = _prepare(out, overwrite)
    stored = stored_tensors(cfg, quantized=cfg.weight_format == "fp8")
    shards = plan_shards(stored, max(1, int(shard_size_mb * 2 ** 20)))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(math.prod(s.shape) * s.dtype.itemsize for s in stored)
    weight_map, data = {}, _tensors(cfg, params, stored)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc=f"write {out.name}", mininterval=0.5) as bar:
        for fname, shard in zip(names, shards):
            with ShardWriter(out / fname, [(s.name, s.dtype, s.shape) for s in shard], {"format": "pt"}) as w:
                for _ in shard:
                    st, arr = next(data)
                    w.write(st.name, arr)
                    weight_map[st.name] = fname
                    bar.update(arr.nbytes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    write_hf_config(cfg, out)
    sizes = [(out / n).stat().st_size for n in names]
    return {"dir": str(out), "tensors": len(stored), "shards": len(names), "total_bytes": total,
            "largest_shard_bytes": max(sizes)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="preset name: tiny | small | medium | full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard-size-mb", type=float, default=DEFAULT_SHARD_MB)
    ap.add_argument("--weight-format", choices=["fp8", "bf16"], default=None,
                    help="layout to write (default: the preset's weight_format)")
    ap.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    a = ap.parse_args(argv)
    from checkpoints.random_params import random_init

    cfg = ModelConfig.preset(a.config)
    if a.weight_format:
        cfg = cfg.replace(weight_format=a.weight_format)
    _prepare(a.out, a.force)  # fail before the (long) random init
    t0 = time.perf_counter()
    params = jax.block_until_ready(random_init(cfg, a.seed))
    t1 = time.perf_counter()
    info = write_hf(cfg, params, a.out, shard_size_mb=a.shard_size_mb, overwrite=a.force)
    t2 = time.perf_counter()
    print(f"{a.config} ({cfg.weight_format}) seed {a.seed}: {info['tensors']} tensors, {info['shards']} shard(s), "
          f"{info['total_bytes'] / 2 ** 20:.1f} MiB -> {a.out}  (init {t1 - t0:.1f} s, write {t2 - t1:.1f} s)")
    return info


if __name__ == "__main__":
    main()
