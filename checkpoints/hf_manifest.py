"""Validate an HF checkpoint directory completely before any weight is read.

`inspect(dir)` reads ``config.json``, the index (``model.safetensors.index.json`` with its ``weight_map``;
a lone ``model.safetensors`` also works) and the header of every shard (a shard may be stored as
``NAME.xz``: `packed_shards.resolve`), and checks that every tensor of
`hf_layout.stored_tensors(cfg, quantized)` is present with the right dtype and shape, that the index and
the shard headers agree, and that nothing unexpected is there (vision tensors, DSpark ``mtp.*`` tensors of a
config without a draft and the gate's ``bias_vl`` are accepted and skipped). All problems found are reported
together in one CheckpointError naming each tensor and file; on success it returns a `Manifest` that says
where every tensor's bytes are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from checkpoints.hf_config import CONFIG_NAME, is_quantized, read_hf_config
from checkpoints.hf_layout import Stored, is_ignored, stored_tensors
from checkpoints.packed_shards import INDEX_NAME, SINGLE_NAME, resolve
from checkpoints.safetensors_io import NAMES, CheckpointError, TensorInfo, read_header
from dsv41_jax.config import ModelConfig

MAX_LISTED = 20


@dataclass(frozen=True)
class Located:
    path: Path  # shard file
    info: TensorInfo


@dataclass
class Manifest:
    directory: Path
    cfg: ModelConfig  # as the config says (weight_format "fp8" iff quantized)
    quantized: bool
    stored: list[Stored]  # what the layout requires, in checkpoint order
    tensors: dict[str, Located]  # every required tensor
    shards: list[Path]
    ignored: list[str] = field(default_factory=list)


def is_hf_dir(directory) -> bool:
    d = Path(directory)
    return (d / CONFIG_NAME).is_file() and ((d / INDEX_NAME).is_file() or (d / SINGLE_NAME).is_file())


def _read_index(d: Path) -> dict[str, str]:
    p = d / INDEX_NAME
    if not p.is_file():
        if (d / SINGLE_NAME).is_file():
            return {name: SINGLE_NAME for name in read_header(d / SINGLE_NAME).tensors}
        raise CheckpointError(f"{d}: no {INDEX_NAME} or {SINGLE_NAME}")
    try:
        wm = json.loads(p.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p}: unreadable index ({type(e).__name__}: {e})") from None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{p}: weight_map must map tensor names to file names")
    for name, f in wm.items():
        if Path(f).name != f or f in ("", ".", ".."):
            raise CheckpointError(f"{p}: tensor {name}: shard name {f!r} is not a file in the checkpoint directory")
    return wm


def inspect(directory) -> Manifest:
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    cfg, raw = read_hf_config(d)
    quantized = is_quantized(raw)
    wm = _read_index(d)
    files = sorted(set(wm.values()))
    first = {}
    for name, f in wm.items():
        first.setdefault(f, name)
    paths = {f: resolve(d, f) for f in files}  # the shard, or its .xz decompressed into the cache
    for f in files:
        if paths[f] is None:
            raise CheckpointError(f"{d / f}: missing shard file (the index lists tensor {first[f]} in it)")
    headers = {f: read_header(paths[f]) for f in files}
    errors, tensors, ignored = [], {}, []
    stored = stored_tensors(cfg, quantized)
    for name, f in wm.items():
        if name not in headers[f].tensors:
            errors.append(f"tensor {name}: listed in {INDEX_NAME} under {f}, but {d / f} does not hold it")
    for s in stored:
        f = wm.get(s.name)
        if f is None:
            errors.append(f"missing tensor {s.name} ({NAMES[s.dtype]} {list(s.shape)})")
            continue
        info = headers[f].tensors.get(s.name)
        if info is None:
            continue  # reported above
        if info.dtype not in s.accepted:
            errors.append(f"tensor {s.name} in {d / f}: dtype {info.dtype_name}, expected "
                          f"{' or '.join(NAMES[t] for t in s.accepted)}")
        elif info.shape != tuple(s.shape):
            errors.append(f"tensor {s.name} in {d / f}: shape {list(info.shape)}, expected {list(s.shape)}")
        else:
            tensors[s.name] = Located(paths[f], info)
    want = {s.name for s in stored}
    for name in wm:
        if name in want:
            continue
        if is_ignored(name):
            ignored.append(name)
        else:
            errors.append(f"unexpected tensor {name} in {d / wm[name]} (not in the layout of this config"
                          f"{'' if quantized else '; a .scale needs quantization_config in config.json'})")
    if errors:
        more = f"\n  ... and {len(errors) - MAX_LISTED} more" if len(errors) > MAX_LISTED else ""
        raise CheckpointError(f"{d}: invalid checkpoint ({len(errors)} problem(s)):\n  "
                              + "\n  ".join(errors[:MAX_LISTED]) + more)
    return Manifest(d, cfg, quantized, stored, tensors, [paths[f] for f in files], ignored)
