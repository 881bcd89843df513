"""Import an official-layout HF checkpoint into the parameter tree, streaming, straight onto the device(s).

    cfg, params = import_hf(dir, weight_format=None, mesh=None)

1. `hf_manifest.inspect` validates everything first (config, index, every shard header, every name, dtype
   and shape); nothing is allocated before that succeeds, so bad input never yields partial weights.
2. Each leaf of `params.param_specs(cfg)` is filled by "pieces": one checkpoint tensor (plus its scale)
   per slice ``leaf[idx]`` (idx = layer, (layer, expert), source slot, or () for unstacked tensors). A
   piece is copied byte for byte (FP8 / FP4 / scales kept as stored when cfg.weight_format == "fp8"), cast
   (bf16 -> f32 head), or dequantized on the host (`host_quant`: wo_a always, every linear / expert /
   Engram table when weight_format == "bf16").
3. A leaf is assembled from host slabs of at most `slab_bytes` (whole pieces, or row ranges of one piece,
   32-row aligned for FP8 blocks) read with pread directly from the files; a leaf that fits in one slab
   is one device_put, a larger one is preallocated on device and updated in place slab by slab (a donated
   dynamic_update_slice). At most two slabs are alive on the host (one being read, one being transferred),
   so peak host memory is about 2 x slab_bytes plus temporaries, independent of the shard size and of the
   model size.
4. On a mesh each leaf is built shard by shard (`checkpoints.sharding`; `parallel=` an engine layout): every
   addressable device preallocates only its own shard and receives only the part of each slab that falls in
   it, then `jax.make_array_from_single_device_arrays` joins the shards. No device (and no host) ever holds a
   whole sharded tensor, and in a multi-host run a process reads only the slabs its devices need.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import SingleDeviceSharding
from tqdm import tqdm

from checkpoints import host_quant
from checkpoints.hf_layout import I8, U8, scale_name
from checkpoints.hf_manifest import Manifest, inspect
from checkpoints.safetensors_io import CheckpointError, pread_into
from checkpoints.sharding import leaf_sharding
from checkpoints.tree import unflat
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_rows import drop_tables
from dsv41_jax.params import abstract_params, param_specs

SLAB_BYTES = 256 * 2 ** 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    idx: tuple  # index prefix into the leaf
    kind: str  # copy | cast | fp8 | fp4 | table
    weight: str  # checkpoint tensor name
    scale: str | None  # its scale tensor (dequantizing kinds)
    shape: tuple  # shape of leaf[idx]


def _shardings(sharding):
    return {} if sharding is None else {"out_shardings": sharding}


@functools.cache
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), **_shardings(sharding))


@functools.cache
def _update_fn(sharding):
    return jax.jit(lambda buf, x, start: lax.dynamic_update_slice(buf, x, start), donate_argnums=0,
                   **_shardings(sharding))


def _slab_plan(shape, k, itemsize, budget, align):
    """(j, c): slabs are ``leaf[p + (a:a+c,)]`` for index prefixes p over axes < j; j <= k (pieces are never
    split below their first axis), c a multiple of `align` when the slab is a row range inside a piece."""
    jmax = min(k, len(shape) - 1)
    for j in range(jmax + 1):
        row = math.prod(shape[j + 1:]) * itemsize
        a = align if j == k else 1
        if row * a <= budget or j == jmax:
            c = min(shape[j], max(a, budget // max(row, 1)))
            n = -(-shape[j] // c)
            c = -(-shape[j] // n)
            if a > 1:
                c = min(shape[j], -(-c // a) * a)
            return j, c
    raise AssertionError("unreachable")


class _Importer:
    def __init__(self, cfg: ModelConfig, man: Manifest, mesh, expert_axis, slab_bytes, progress, parallel=None,
                 tables: bool = True):
        self.cfg, self.man, self.mesh, self.expert_axis, self.parallel = cfg, man, mesh, expert_axis, parallel
        self.slab_bytes = int(slab_bytes)
        self.tables = tables
        self.leaves = {p: lf for p, lf in param_specs(cfg).items() if tables or not _is_table(p)}
        self.pieces = self._pieces()
        self.fds: dict[Path, int] = {}
        self.inflight = None
        total = sum(math.prod(lf.shape) * np.dtype(lf.dtype).itemsize for lf in self.leaves.values())
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                        desc=f"import {man.directory.name}", mininterval=0.5)

    # ------------------------------------------------------------------ plan
    def _pieces(self) -> dict[tuple, dict[tuple, Piece]]:
        man, fp8 = self.man, self.cfg.weight_format == "fp8"
        out: dict[tuple, dict[tuple, Piece]] = {}

        def put(path, e, kind, w, s=None):
            shape = tuple(man.tensors[w].info.shape) if kind in ("copy", "cast") else tuple(e.shape)
            slot = out.setdefault(path, {})
            if e.index in slot:
                raise CheckpointError(f"tensors {slot[e.index].weight} and {w} both fill {path}{list(e.index)}")
            slot[e.index] = Piece(e.index, kind, w, s, shape)

        for st in man.stored:
            if st.role != "weight":
                continue
            e = st.entry
            if e.fmt == "dense":
                same = np.dtype(self.leaves[e.path].dtype) == st.dtype
                put(e.path, e, "copy" if same else "cast", e.name)
            elif not man.quantized:
                put(e.path if e.fmt == "fp8_to_bf16" else e.path + ("weight",), e, "copy", e.name)
            elif e.fmt == "fp8_to_bf16":
                put(e.path, e, "fp8", e.name, scale_name(e))
            elif fp8:
                put(e.path + ("weight",), e, "copy", e.name)
                put(e.path + ("scale",), e, "copy", scale_name(e))
            else:
                put(e.path + ("weight",), e, e.fmt, e.name, scale_name(e))
        if not self.tables:  # host Engram tables: read by checkpoints.host_tables, never onto a device
            out = {p: v for p, v in out.items() if not _is_table(p)}
        self._check(out)
        return out

    def _check(self, pieces):
        """Every leaf is tiled exactly by its pieces, with matching shapes and byte-compatible dtypes."""
        for path in set(pieces) - set(self.leaves):
            raise CheckpointError(f"checkpoint tensors fill {path}, which is not a parameter of this config")
        for path, leaf in self.leaves.items():
            ps = pieces.get(path)
            if not ps:
                raise CheckpointError(f"no checkpoint tensor fills parameter {'.'.join(map(str, path))}")
            k = len(next(iter(ps)))
            want = set(itertools.product(*map(range, leaf.shape[:k])))
            if set(ps) != want:
                raise CheckpointError(f"parameter {path}: checkpoint tensors cover {len(ps)} of {len(want)} slices")
            dt = np.dtype(leaf.dtype)
            for p in ps.values():
                if p.shape != tuple(leaf.shape[k:]):
                    raise CheckpointError(f"tensor {p.weight}: shape {list(p.shape)} does not fit parameter "
                                          f"{path} slice {list(leaf.shape[k:])}")
                fdt = self.man.tensors[p.weight].info.dtype
                if p.kind == "copy" and not (fdt == dt or (dt == U8 and fdt in (I8, U8))):
                    raise CheckpointError(f"tensor {p.weight}: stored {fdt} cannot be copied into {dt}")

    # ------------------------------------------------------------------ host reads
    def _fd(self, path: Path) -> int:
        if path not in self.fds:
            try:
                self.fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e})") from None
        return self.fds[path]

    def _rows(self, name, a, b, out=None):
        """Rows [a, b) (axis 0) of checkpoint tensor `name`, read into `out` or a new array of its dtype."""
        loc = self.man.tensors[name]
        info = loc.info
        if info.shape:
            a, b = (0, info.shape[0]) if a is None else (a, b)
            rb = math.prod(info.shape[1:]) * info.dtype.itemsize
            shape, off = (b - a, *info.shape[1:]), info.start + a * rb
        else:
            shape, off = (), info.start
        if out is None:
            out = np.empty(shape, info.dtype)
        elif out.nbytes != math.prod(shape) * info.dtype.itemsize:
            raise AssertionError(f"{name}: destination of {out.nbytes} bytes for rows {a}:{b}")
        pread_into(self._fd(loc.path), off, out, f"{loc.path}: tensor {name}")
        return out

    def _read(self, p: Piece, rows, dst: np.ndarray):
        a, b = rows if rows is not None else (None, None)
        if p.kind == "copy":
            self._rows(p.weight, a, b, dst)
            return
        w = self._rows(p.weight, a, b)
        if p.kind == "cast":
            dst[...] = w.astype(dst.dtype)
            return
        r0, r1 = (0, p.shape[0]) if rows is None else rows
        if p.kind == "fp8":
            s = self._rows(p.scale, r0 // 32, -(-r1 // 32))
            dst[...] = host_quant.dequant_fp8_block(w, s, dst.dtype)
        elif p.kind == "fp4":
            dst[...] = host_quant.dequant_fp4(w, self._rows(p.scale, r0, r1), dst.dtype)
        elif p.kind == "table":
            dst[...] = host_quant.dequant_rows32(w, self._rows(p.scale, r0, r1), dst.dtype)
        else:
            raise AssertionError(p.kind)

    def _slabs(self, path, shape, dtype, want=None):
        """(whole, j, pre, a, buf): slab ``leaf[pre + (a:a+len(buf),)]``; `want(pre, a, b)` False skips one
        unread."""
        ps = self.pieces[path]
        k = len(next(iter(ps)))
        align = 32 if any(p.kind == "fp8" for p in ps.values()) else 1
        j, c = _slab_plan(shape, k, np.dtype(dtype).itemsize, self.slab_bytes, align)
        whole = j == 0 and c >= shape[0]
        for pre in itertools.product(*map(range, shape[:j])):
            for a in range(0, shape[j], c):
                b = min(shape[j], a + c)
                if want is not None and not want(pre, a, b):
                    continue
                buf = np.empty((b - a, *shape[j + 1:]), dtype)
                if j < k:
                    for i in range(a, b):
                        for rest in itertools.product(*map(range, shape[j + 1:k])):
                            self._read(ps[(*pre, i, *rest)], None, buf[(i - a, *rest, Ellipsis)])
                else:
                    self._read(ps[pre], (a, b), buf)
                yield whole, j, pre, a, buf

    # ------------------------------------------------------------------ device
    def _put(self, buf, sharding):
        x = jax.device_put(buf) if sharding is None else jax.device_put(buf, sharding)
        if self.inflight is not None:  # bound host memory: the previous slab's transfer must be done
            self.inflight.block_until_ready()
        self.inflight = x
        self.bar.update(buf.nbytes)
        return x

    def _leaf(self, path, leaf):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if self.mesh is not None:
            return self._sharded_leaf(path, shape, dtype)
        # no mesh: uncommitted arrays on the default device, as jit outputs (init_params) are
        sharding = None
        dev = None
        for whole, j, pre, a, buf in self._slabs(path, shape, dtype):
            if whole:
                return self._put(buf, sharding)
            if dev is None:
                dev = _zeros_fn(shape, dtype, sharding)()
            x = self._put(buf.reshape((1,) * j + buf.shape), None)
            start = tuple(np.int32(v) for v in (*pre, a) + (0,) * (len(shape) - j - 1))
            dev = _update_fn(sharding)(dev, x, start)
        return dev

    def _sharded_leaf(self, path, shape, dtype):
        """Shard by shard: each addressable device allocates its shard and receives only its part of a slab."""
        sharding = leaf_sharding(self.cfg, path, shape, self.mesh, self.expert_axis, self.parallel)
        index = {d: tuple(sl.indices(n)[:2] for sl, n in zip(ix, shape))
                 for d, ix in sharding.addressable_devices_indices_map(shape).items()}
        groups: dict[tuple, list] = {}
        for d, box in index.items():
            groups.setdefault(box, []).append(d)
        bufs: dict = {}

        def region(pre, a, b):
            return [(i, i + 1) for i in pre] + [(a, b)] + [(0, n) for n in shape[len(pre) + 1:]]

        def meets(box, reg):
            return all(max(lo, r0) < min(hi, r1) for (lo, hi), (r0, r1) in zip(box, reg))

        want = lambda pre, a, b: any(meets(box, region(pre, a, b)) for box in groups)  # noqa: E731
        for whole, j, pre, a, buf in self._slabs(path, shape, dtype, want):
            if whole:
                self.bar.update(buf.nbytes)
                return jax.make_array_from_callback(shape, sharding, lambda ix: buf[ix])
            reg = region(pre, a, a + buf.shape[0])
            slab = buf.reshape((1,) * j + buf.shape)
            for box, devs in groups.items():
                if not meets(box, reg):
                    continue
                lo = [max(b0, r0) for (b0, _), (r0, _) in zip(box, reg)]
                hi = [min(b1, r1) for (_, b1), (_, r1) in zip(box, reg)]
                part = np.ascontiguousarray(slab[tuple(slice(l0 - r0, h0 - r0) for l0, h0, (r0, _)
                                                       in zip(lo, hi, reg))])
                start = tuple(np.int32(l0 - b0) for l0, (b0, _) in zip(lo, box))
                for d in devs:
                    one = SingleDeviceSharding(d)
                    if d not in bufs:
                        bufs[d] = _zeros_fn(tuple(b1 - b0 for b0, b1 in box), dtype, one)()
                    x = self._put(part, one)
                    bufs[d] = _update_fn(one)(bufs[d], x, start)
        return jax.make_array_from_single_device_arrays(shape, sharding, [bufs[d] for d in index])

    def run(self) -> dict:
        try:
            arrays = {path: self._leaf(path, leaf) for path, leaf in self.leaves.items()}
            jax.block_until_ready(arrays)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.bar.close()
        template = abstract_params(self.cfg)
        return unflat(template if self.tables else drop_tables(template), arrays)


def _is_table(path) -> bool:
    return len(path) >= 3 and path[0] == "engram" and path[2] == "embed"


def import_hf(directory, *, weight_format: str | None = None, mesh=None, expert_axis: str | None = None,
              slab_bytes: int = SLAB_BYTES, progress: bool = True, parallel=None,
              tables: bool = True) -> tuple[ModelConfig, dict]:
    """(cfg, params) from an HF-layout directory. weight_format None keeps the checkpoint's format (fp8 for
    the official quantized layout); "bf16" dequantizes every weight; "fp8" needs a quantized checkpoint.
    `mesh` (+ `parallel`, an engine layout): every leaf is built shard by shard on its devices.
    `tables=False`: the Engram tables are left out of the tree (host tables: checkpoints.host_tables)."""
    man = inspect(directory)
    wf = weight_format or man.cfg.weight_format
    if wf == "fp8" and not man.quantized:
        raise CheckpointError(f"{man.directory}: weight_format 'fp8' needs an FP8 checkpoint (config.json has no "
                              "fp8 quantization_config); load it with weight_format='bf16'")
    cfg = man.cfg.replace(weight_format=wf)
    if man.ignored:
        log.info("%s: %d tensors not used by the text model skipped (e.g. %s)", man.directory, len(man.ignored),
                 man.ignored[0])
    return cfg, _Importer(cfg, man, mesh, expert_axis, slab_bytes, progress, parallel, tables).run()
