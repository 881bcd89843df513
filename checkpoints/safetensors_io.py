"""Minimal streaming safetensors reader/writer with the low-precision dtypes of the official checkpoint.

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw data.

Invariants:
- `read_header` validates a whole file before any data is read: known dtypes, byte counts that match the
  shapes, offsets that tile the data region exactly (contiguous, no overlap, no trailing bytes, as the
  safetensors library requires), so a truncated or corrupt file fails with its path and tensor name;
- reads go straight from the file into a caller's buffer with `pread` (no mmap: pages of a mapped shard
  would count towards the process RSS), so peak host memory is the destination buffer only;
- `ShardWriter` writes the header first (from the planned names/dtypes/shapes) and then streams tensors
  one at a time in that order; `save_file` is the small in-memory convenience version.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
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
MAX_HEADER = 100 * 2 ** 20


class CheckpointError(ValueError):
    """A checkpoint problem, with the file and tensor it concerns."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype
    shape: tuple
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def dtype_name(self) -> str:
        return NAMES[self.dtype]


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict  # name -> TensorInfo, in file order
    metadata: dict
    size: int  # file size in bytes


def read_header(path) -> Header:
    """Parse and validate the header of a safetensors file (reads only the header bytes)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 8:
                raise CheckpointError(f"{path}: truncated (no header)")
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > size - 8 or hlen > MAX_HEADER:
                raise CheckpointError(f"{path}: corrupt header length {hlen} (file has {size} bytes)")
            raw = f.read(hlen)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base, data = 8 + hlen, size - 8 - hlen
    spans = []
    for name, e in header.items():
        try:
            dt, shape, (s, t) = e["dtype"], [int(x) for x in e["shape"]], e["data_offsets"]
            s, t = int(s), int(t)
        except (TypeError, KeyError, ValueError) as err:
            raise CheckpointError(f"{path}: tensor {name}: corrupt header entry {e!r} ({err})") from None
        if dt not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dt}")
        if any(x < 0 for x in shape) or not 0 <= s <= t:
            raise CheckpointError(f"{path}: tensor {name}: corrupt shape {shape} / offsets {[s, t]}")
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if t - s != n:
            raise CheckpointError(f"{path}: tensor {name}: {t - s} bytes for {dt} shape {shape}")
        spans.append((s, t, name, TensorInfo(name, DTYPES[dt], tuple(shape), base + s, n)))
    spans.sort(key=lambda x: (x[0], x[1]))
    end = 0
    for s, t, name, _ in spans:
        if s != end:
            raise CheckpointError(f"{path}: corrupt header: tensor {name} starts at byte {s}, expected {end}")
        if t > data:
            raise CheckpointError(f"{path}: truncated: tensor {name} ends at byte {t} of {data}")
        end = t
    if end != data:
        raise CheckpointError(f"{path}: corrupt: {data - end} bytes after the last tensor")
    tensors = {name: info for _, _, name, info in sorted(spans, key=lambda x: x[0])}
    return Header(path, tensors, dict(meta), size)


def pread_into(fd: int, offset: int, out: np.ndarray, what: str = ""):
    """Fill the C-contiguous array `out` with the file bytes at `offset` (no intermediate copy)."""
    if not out.flags.c_contiguous:
        raise ValueError("pread_into needs a C-contiguous destination")
    mv = memoryview(out.reshape(-1).view(np.uint8))
    done, n = 0, mv.nbytes
    while done < n:
        try:
            k = os.preadv(fd, [mv[done:]], offset + done)
        except OSError as e:
            raise CheckpointError(f"{what}: read failed ({e})") from None
        if k <= 0:
            raise CheckpointError(f"{what}: unexpected end of file after {done} of {n} bytes")
        done += k


def group_by_size(items: list, nbytes, budget: int, big_alone: bool = False) -> list[list]:
    """Greedy shard plan: consecutive items (tensors) while their `nbytes(item)` sum stays within `budget`.
    With big_alone, an item over the budget gets a group of its own and the group being filled goes on."""
    groups, cur, size = [], [], 0
    for it in items:
        n = nbytes(it)
        if big_alone and n > budget:
            groups.append([it])
            continue
        if cur and size + n > budget:
            groups.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    if cur:
        groups.append(cur)
    return groups


class ShardWriter:
    """Write one safetensors file: the header from `specs` [(name, dtype, shape)], then `write` each tensor
    in the same order (streams: only the tensor being written is in memory)."""

    def __init__(self, path, specs, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header, off = {}, 0
        self._specs = [(name, np.dtype(dt), tuple(int(x) for x in shape)) for name, dt, shape in specs]
        for name, dt, shape in self._specs:
            if dt not in NAMES:
                raise CheckpointError(f"{self.path}: tensor {name}: unsupported dtype {dt}")
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            header[name] = {"dtype": NAMES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(hb)))
        self._f.write(hb)
        self._i = 0

    def write(self, name: str, arr: np.ndarray):
        want, dt, shape = self._specs[self._i]
        arr = np.ascontiguousarray(arr)
        if name != want or arr.dtype != dt or arr.shape != shape:
            raise CheckpointError(f"{self.path}: tensor {name} {arr.dtype}{list(arr.shape)} written where "
                                  f"{want} {dt}{list(shape)} was planned")
        self._f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        self._i += 1

    def close(self):
        self._f.close()
        if self._i != len(self._specs):
            raise CheckpointError(f"{self.path}: only {self._i} of {len(self._specs)} tensors written")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *a):
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def save_file(tensors: dict[str, np.ndarray], path, metadata: dict[str, str] | None = None):
    """Write tensors (numpy arrays, ml_dtypes allowed) in safetensors layout."""
    for name, arr in tensors.items():
        if np.asarray(arr).dtype not in NAMES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {np.asarray(arr).dtype}")
    with ShardWriter(path, [(k, np.asarray(v).dtype, np.shape(v)) for k, v in tensors.items()], metadata) as w:
        for name, arr in tensors.items():
            w.write(name, np.asarray(arr))


class SafeOpen:
    """Lazy reader: `keys()`, `info(name) -> (dtype, shape)`, `get(name) -> np.ndarray` (a fresh array)."""

    def __init__(self, path):
        self.header = read_header(path)
        self.path = self.header.path
        self._fd = os.open(self.path, os.O_RDONLY)

    def keys(self):
        return list(self.header.tensors)

    @property
    def metadata(self) -> dict:
        return dict(self.header.metadata)

    def info(self, name):
        t = self.header.tensors[name]
        return t.dtype, t.shape

    def get(self, name) -> np.ndarray:
        if name not in self.header.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        t = self.header.tensors[name]
        out = np.empty(t.shape, t.dtype)
        pread_into(self._fd, t.start, out, f"{self.path}: tensor {name}")
        return out

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
