"""HF checkpoints whose every file stays under a size limit (a git repository's 4 MiB house rule).

`repack(src, dst, max_bytes)` rewrites a checkpoint's shards (the same tensors, byte for byte, in the index's
order) so that each shard holds at most `max_bytes`; a shard that one tensor alone makes larger (the default
model's 8192 x 256 bf16 embedding and head are 4 MiB + header) is stored xz-compressed as
``NAME.safetensors.xz``. The index keeps naming ``NAME.safetensors``.

`resolve(dir, name)` is how readers find a shard: the file itself, or its ``.xz`` decompressed once into
``$DSV41_CACHE_DIR`` (default ``~/.cache/dsv41-jax``) ``/shards/<sha256 of the .xz>/NAME`` (written to a
temporary file and renamed, so a reader never sees half a shard). `hf_manifest.inspect` calls it, so every loader
(`checkpoints.load`, the server, the benchmarks) reads packed checkpoints unchanged. The shard file names of an
HF directory (`INDEX_NAME`, `SINGLE_NAME`) live here, below hf_manifest.

    python -m checkpoints.packed_shards SRC DST [--max-bytes 4000000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import tempfile
from pathlib import Path

from checkpoints.safetensors_io import CheckpointError, SafeOpen, ShardWriter, group_by_size

INDEX_NAME = "model.safetensors.index.json"  # an HF checkpoint's shard index: tensor name -> shard file
SINGLE_NAME = "model.safetensors"  # the one shard of an unsharded HF checkpoint
XZ = ".xz"
LIMIT = 4 * 2 ** 20  # the house rule: tracked files up to 4 MiB
MAX_BYTES = 4_000_000  # default shard budget, under LIMIT with room for the header


def cache_root() -> Path:
    return Path(os.environ.get("DSV41_CACHE_DIR") or os.path.expanduser("~/.cache/dsv41-jax"))


def resolve(directory, name: str) -> Path | None:
    """A readable path for shard `name` of `directory`, or None when neither it nor its .xz exists."""
    d = Path(directory)
    if (d / name).is_file():
        return d / name
    packed = d / (name + XZ)
    if not packed.is_file():
        return None
    digest = hashlib.sha256(packed.read_bytes()).hexdigest()[:20]
    out = cache_root() / "shards" / digest / name
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=name + ".")
        try:
            with os.fdopen(fd, "wb") as f, lzma.open(packed, "rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
            os.replace(tmp, out)
        except (lzma.LZMAError, EOFError, OSError) as e:
            Path(tmp).unlink(missing_ok=True)
            raise CheckpointError(f"{packed}: cannot decompress ({type(e).__name__}: {e})") from None
    return out


def repack(src, dst, max_bytes: int = MAX_BYTES, limit: int = LIMIT) -> dict:
    """Rewrite the checkpoint in `src` into `dst` (created; may equal src) with every file <= limit bytes.
    Returns {file name: bytes on disk} of the shards and the index."""
    src, dst = Path(src), Path(dst)
    index = json.loads((src / INDEX_NAME).read_text())
    wm: dict[str, str] = index["weight_map"]
    readers: dict[str, SafeOpen] = {}
    try:
        for f in dict.fromkeys(wm.values()):
            path = resolve(src, f)
            if path is None:
                raise CheckpointError(f"{src / f}: missing shard file")
            readers[f] = SafeOpen(path)
        infos = {name: readers[f].header.tensors[name] for name, f in wm.items()}
        groups = group_by_size(list(wm), lambda name: infos[name].nbytes, max_bytes, big_alone=True)
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        with tempfile.TemporaryDirectory(dir=dst.parent if dst.parent.exists() else None) as tmp:
            tmp = Path(tmp)
            new_map, files = {}, {}
            for fname, group in zip(names, groups):
                with ShardWriter(tmp / fname, [(n, infos[n].dtype, infos[n].shape) for n in group],
                                 {"format": "pt"}) as w:
                    for n in group:
                        w.write(n, readers[wm[n]].get(n))
                        new_map[n] = fname
                if (tmp / fname).stat().st_size > limit:
                    with open(tmp / fname, "rb") as f_in, lzma.open(tmp / (fname + XZ), "wb", preset=9) as f_out:
                        shutil.copyfileobj(f_in, f_out, 1 << 20)
                    (tmp / fname).unlink()
                    fname += XZ
                files[fname] = (tmp / fname).stat().st_size
                if files[fname] > limit:
                    raise CheckpointError(f"{fname}: {files[fname]} bytes even compressed (limit {limit})")
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": index.get("metadata", {}),
                                                      "weight_map": new_map}, indent=1) + "\n")
            files[INDEX_NAME] = (tmp / INDEX_NAME).stat().st_size
            for r in readers.values():
                r.close()
            readers.clear()
            dst.mkdir(parents=True, exist_ok=True)
            for p in list(dst.iterdir()):  # the old shards (dst may be src)
                if p.name.startswith("model-") and (p.name.endswith(".safetensors") or p.name.endswith(XZ)):
                    p.unlink()
            for p in tmp.iterdir():
                shutil.move(str(p), dst / p.name)
        if src != dst:
            for p in src.iterdir():  # config, tokenizer, ...: copied as they are
                if p.is_file() and not (dst / p.name).exists() and not p.name.startswith("model-"):
                    shutil.copy2(p, dst / p.name)
        return files
    finally:
        for r in readers.values():
            r.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="tensor bytes per shard")
    a = ap.parse_args(argv)
    for name, n in repack(a.src, a.dst, a.max_bytes).items():
        print(f"{n:>10,}  {name}")


if __name__ == "__main__":
    main()
