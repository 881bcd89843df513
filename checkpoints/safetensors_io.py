"""Minimal streaming safetensors reader/writer with the low-precision dtypes of the official checkpoint.

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw data.
The reader memory-maps the file and returns one tensor at a time (peak host memory: one tensor), and
checks every header entry against the file size so a truncated or corrupt file fails with its name.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "BOOL": np.dtype(bool), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint problem, with the file and tensor it concerns."""


def save_file(tensors: dict[str, np.ndarray], path, metadata: dict[str, str] | None = None):
    """Write tensors (numpy arrays, ml_dtypes allowed) in safetensors layout, streaming each tensor."""
    header, off, items = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in NAMES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {arr.dtype}")
        n = arr.nbytes
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [off, off + n]}
        items.append(arr)
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for arr in items:
            f.write(arr.tobytes())


class SafeOpen:
    """Lazy reader: `keys()`, `info(name) -> (dtype, shape)`, `get(name) -> np.ndarray` (a copy)."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
            size = self.path.stat().st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: truncated (no header)")
            (hlen,) = struct.unpack("<Q", self._f.read(8))
            if hlen > size - 8 or hlen > 100 * 2 ** 20:
                raise CheckpointError(f"{self.path}: corrupt header length {hlen}")
            try:
                self._header = json.loads(self._f.read(hlen))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt header ({e})") from None
            self._meta = self._header.pop("__metadata__", {}) or {}
            self._base = 8 + hlen
            data = size - self._base
            for name, e in self._header.items():
                if e.get("dtype") not in DTYPES:
                    raise CheckpointError(f"{self.path}: tensor {name}: unsupported dtype {e.get('dtype')}")
                s, t = e["data_offsets"]
                n = int(np.prod(e["shape"], dtype=np.int64)) * DTYPES[e["dtype"]].itemsize
                if t - s != n:
                    raise CheckpointError(f"{self.path}: tensor {name}: {t - s} bytes for shape {e['shape']}")
                if t > data:
                    raise CheckpointError(f"{self.path}: truncated: tensor {name} ends at byte {t} of {data}")
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e})") from None

    def keys(self):
        return list(self._header)

    @property
    def metadata(self) -> dict:
        return dict(self._meta)

    def info(self, name):
        e = self._header[name]
        return DTYPES[e["dtype"]], tuple(e["shape"])

    def get(self, name) -> np.ndarray:
        if name not in self._header:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        e = self._header[name]
        s, t = e["data_offsets"]
        buf = self._mm[self._base + s: self._base + t]
        return np.frombuffer(buf, dtype=DTYPES[e["dtype"]]).reshape(e["shape"]).copy()

    def close(self):
        if self._mm is not None:
            self._mm.close()
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
