"""Engram tables in host memory: one read-only copy per host, filled straight from the checkpoint.

    tables = host_tables.from_hf(manifest, cfg, opts)     # an HF checkpoint's table tensors (pread)
    tables = host_tables.from_random(cfg, seed, opts)     # a preset's random tables (the device init's values)
    tables = host_tables.from_arrays(cfg, nodes, opts)    # table leaves already in memory (tests, benchmarks)
    tables.arrays[e]                                      # uint8 [rows_e, row_bytes] (dsv41_jax.engram_rows)

Storage (`StoreOptions`):
- shared (default): a file in `shm_dir` (/dev/shm) named by a content key (the checkpoint's table tensors:
  file, size, mtime, offset; or the preset config and seed), mapped by every process of the host that serves
  the same tables (the data-parallel ranks of one engine share the process's mapping; replicas and restarts
  map the file). The first process fills a temporary file under an exclusive lock and renames it into
  place, so a file under the final name is always complete; the others wait on the lock and map it
  read-only (MAP_POPULATE: prefaulted). Users hold a shared lock; the last one to close removes the file
  (`keep=True`: it stays for the next start). Too little space in shm_dir: private memory, with a warning.
- private: an anonymous mapping of this process.
- huge pages: madvise(MADV_HUGEPAGE) before the first touch (anonymous memory follows
  /sys/kernel/mm/transparent_hugepage/enabled, a tmpfs file its shmem_enabled; `huge_page_bytes()` reads
  /proc/self/smaps for what the kernel actually gave).

Invariants: the arrays are read-only once filled; a shared file's header (magic, version, key, row format,
rows) is checked before it is mapped, and a file under the final name that disagrees with it is rejected
with an error naming it (never silently used); every table row read from a checkpoint is checked for NaN
codes (`engram_rows.bad_rows`) while it is copied, and a bad or short tensor raises CheckpointError naming
the tensor and file before any row is served.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import glob
import hashlib
import logging
import math
import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from checkpoints.safetensors_io import CheckpointError, pread_into
from dsv41_jax import engram_rows
from dsv41_jax.engram_rows import RowFormat, row_format

log = logging.getLogger(__name__)

MAGIC = b"DSV41ENG"
VERSION = 1
HEADER = struct.Struct("<8sIIII32s")  # magic, version, n_tables, row_bytes, head_dim, key
ALIGN = 2 * 2 ** 20  # every table starts on a 2 MiB (huge page) boundary
SLAB_BYTES = 64 * 2 ** 20  # rows copied from a checkpoint per read


@dataclass(frozen=True)
class StoreOptions:
    shared: bool = True  # a /dev/shm file shared by the host's processes (else private memory)
    shm_dir: str = "/dev/shm"
    use_thp: bool = True  # madvise(MADV_HUGEPAGE)
    keep: bool = False  # leave the shared file for the next start when the last user closes


@dataclass
class HostTables:
    """The host copy of every Engram table (uint8 [rows, row_bytes] each) and how it is stored."""
    fmt: RowFormat
    arrays: list[np.ndarray]
    path: str | None = None  # the shared file, None for private memory
    created: bool = True  # this process filled the tables (False: mapped a file another process filled)
    _map: mmap.mmap | None = field(default=None, repr=False)
    _user_fd: int | None = field(default=None, repr=False)
    _opts: StoreOptions | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def huge_page_bytes(self) -> int:
        """Bytes of the tables the kernel maps with huge pages now (from /proc/self/smaps; 0 if unreadable)."""
        if self._map is None or not self.arrays:
            return 0
        lo = self.arrays[0].__array_interface__["data"][0]
        hi = lo + sum(a.nbytes for a in self.arrays)
        total, inside = 0, False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):
                        a, b = (int(x, 16) for x in head.split("-"))
                        inside = a < hi and b > lo
                    elif inside and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return total

    def describe(self) -> dict:
        return {"bytes": self.nbytes, "shared_file": self.path, "created_here": self.created,
                "huge_page_bytes": self.huge_page_bytes(), "thp_policy": thp_policy(self.path is not None),
                "rows": [a.shape[0] for a in self.arrays],
                "row_bytes": self.fmt.row_bytes}

    def close(self):
        """Drop this process's mapping; the last user of a shared file removes it (unless `keep`)."""
        self.arrays = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a numpy view still alive somewhere: the mapping goes with it
                pass
            self._map = None
        if self._user_fd is not None:
            fd, self._user_fd = self._user_fd, None
            opts = self._opts
            with _locked(self.path + ".create.lock", fcntl.LOCK_EX):
                fcntl.flock(fd, fcntl.LOCK_UN)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except OSError:
                    last = False
                if last and not opts.keep:
                    for p in (self.path, self.path + ".users.lock"):
                        _unlink(p)
                os.close(fd)


# ----------------------------------------------------------------------------- mappings
def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _locked:
    def __init__(self, path, how):
        self.path, self.how = path, how

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, self.how)
        return self.fd

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _layout(fmt: RowFormat, rows: list[int]) -> tuple[list[int], int]:
    """(byte offset of each table, total bytes) with the header in the first aligned block."""
    off, out = ALIGN, []
    for r in rows:
        out.append(off)
        off += -(-(r * fmt.row_bytes) // ALIGN) * ALIGN
    return out, off


def _header(fmt: RowFormat, rows: list[int], key: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, len(rows), fmt.row_bytes, fmt.head_dim, key) + \
        struct.pack(f"<{len(rows)}Q", *rows)


def _madvise_huge(mm: mmap.mmap, use_thp: bool):
    if use_thp and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # the kernel or the filesystem does not do it: ordinary pages
            log.info("Engram tables: no transparent huge pages (%s)", e)


def thp_policy(shared: bool) -> str:
    """The kernel's transparent-huge-page policy for anonymous (private) or tmpfs (shared) memory: the selected
    word of /sys/kernel/mm/transparent_hugepage/{enabled,shmem_enabled}, or "unknown"."""
    name = "shmem_enabled" if shared else "enabled"
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def _views(mm, fmt: RowFormat, rows: list[int]) -> list[np.ndarray]:
    offs, _ = _layout(fmt, rows)
    return [np.frombuffer(mm, np.uint8, r * fmt.row_bytes, o).reshape(r, fmt.row_bytes) for o, r in zip(offs, rows)]


def _private(fmt, rows, fill, opts) -> HostTables:
    _, total = _layout(fmt, rows)
    mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _madvise_huge(mm, opts.use_thp)
    arrays = _views(mm, fmt, rows)
    fill(arrays)
    for a in arrays:
        a.flags.writeable = False
    return HostTables(fmt, arrays, None, True, mm)


def _check_file(path: str, fmt: RowFormat, rows: list[int], key: bytes, total: int):
    want = _header(fmt, rows, key)
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        got = f.read(len(want))
    if got != want or size != total:
        raise ValueError(f"{path}: a shared Engram table file that does not match these tables (header or size "
                         f"{size} != {total} bytes): it is damaged or was written by another version; remove it")


def _shared(fmt, rows, key: bytes, fill, opts) -> HostTables:
    os.makedirs(opts.shm_dir, exist_ok=True)
    if opts.use_thp and thp_policy(True) in ("never", "deny"):
        log.warning("Engram tables: the kernel gives shared memory no huge pages (transparent_hugepage/shmem_enabled "
                    "is %s): lookups pay TLB misses; 'advise' there, or dp_shared_memory=false (private memory, "
                    "one copy per process) enables them", thp_policy(True))
    path = os.path.join(opts.shm_dir, f"dsv41-engram-{key.hex()[:32]}")
    _, total = _layout(fmt, rows)
    with _locked(path + ".create.lock", fcntl.LOCK_EX):
        created = False
        if not os.path.exists(path):
            st = os.statvfs(opts.shm_dir)
            if st.f_bavail * st.f_frsize < total:
                log.warning("Engram tables: %s has %.1f GiB free, the tables need %.1f GiB: private memory instead "
                            "(not shared between processes)", opts.shm_dir, st.f_bavail * st.f_frsize / 2 ** 30,
                            total / 2 ** 30)
                return _private(fmt, rows, fill, opts)
            for stale in glob.glob(path + ".tmp.*"):  # a writer that died while filling (we hold the lock)
                _unlink(stale)
            tmp = f"{path}.tmp.{os.getpid()}"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, total)
                mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
                _madvise_huge(mm, opts.use_thp)
                arrays = _views(mm, fmt, rows)
                fill(arrays)
                del arrays
                hdr = _header(fmt, rows, key)
                mm[:len(hdr)] = hdr
                mm.close()
                os.rename(tmp, path)
            except BaseException:
                _unlink(tmp)
                raise
            finally:
                os.close(fd)
            created = True
        _check_file(path, fmt, rows, key, total)
        user_fd = os.open(path + ".users.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(user_fd, fcntl.LOCK_SH)
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    _madvise_huge(mm, opts.use_thp)
    tables = HostTables(fmt, _views(mm, fmt, rows), path, created, mm, user_fd, opts)
    atexit.register(tables.close)  # the last user of the file removes it
    return tables


def build(cfg, key: bytes | None, fill, opts: StoreOptions | None = None) -> HostTables:
    """Host tables of `cfg`'s Engram layers: `fill(arrays)` writes every row of each uint8 [rows, row_bytes]
    array once. Shared under `key` (a 32-byte digest of the contents' source) when opts.shared and key."""
    opts = opts or StoreOptions()
    fmt, rows = row_format(cfg), list(cfg.engram_rows)
    if opts.shared and key is not None:
        return _shared(fmt, rows, key, fill, opts)
    return _private(fmt, rows, fill, opts)


def content_key(*parts) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.digest()


def _cfg_key(cfg) -> tuple:
    return tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "name")


# ----------------------------------------------------------------------------- sources
def from_arrays(cfg, nodes: list[dict], opts: StoreOptions | None = None, key: bytes | None = None) -> HostTables:
    """From table leaves in memory (`{"weight", "scale"?}` per Engram layer, numpy or jax arrays); shared only
    under a `key` naming their source."""
    fmt = row_format(cfg)

    def fill(arrays):
        for e, (node, out) in enumerate(zip(nodes, arrays)):
            w = np.asarray(node["weight"])
            s = np.asarray(node["scale"]) if "scale" in node else None
            _checked(fmt, engram_rows.pack_rows(fmt, w, s, out), f"Engram table {e}", 0)

    return build(cfg, key, fill, opts)


def _checked(fmt: RowFormat, rows: np.ndarray, what: str, first_row: int) -> np.ndarray:
    bad = engram_rows.bad_rows(fmt, rows)
    if len(bad):
        raise CheckpointError(f"{what}: row {first_row + int(bad[0])} holds a NaN code ({len(bad)} bad rows in rows "
                              f"{first_row}..{first_row + len(rows) - 1})")
    return rows


def table_tensors(man, cfg) -> list[tuple[str, str | None]]:
    """(weight tensor name, scale tensor name or None) of each Engram table in an HF manifest."""
    from checkpoints.hf_layout import scale_name

    out = {}
    for st in man.stored:
        e = st.entry
        if st.role == "weight" and len(e.path) == 3 and e.path[0] == "engram" and e.path[2] == "embed":
            out[e.path[1]] = (e.name, scale_name(e) if man.quantized else None)
    return [out[i] for i in range(len(cfg.engram_layer_ids))]


def from_hf(man, cfg, opts: StoreOptions | None = None) -> HostTables:
    """The table tensors of an inspected HF checkpoint (`hf_manifest.inspect`), read with pread slab by slab
    into the host tables (dequantized on the host when cfg.weight_format is bf16 and the file FP8)."""
    from checkpoints import host_quant

    fmt = row_format(cfg)
    names = table_tensors(man, cfg)
    src = []
    for w, s in names:
        for n in (w, s):
            if n is not None:
                loc = man.tensors[n]
                st = os.stat(loc.path)
                src.append((n, os.path.realpath(loc.path), st.st_size, st.st_mtime_ns, loc.info.start))
    key = content_key("hf", VERSION, fmt, tuple(cfg.engram_rows), tuple(src))

    def read(name, a, b):
        loc = man.tensors[name]
        info = loc.info
        row = math.prod(info.shape[1:]) * info.dtype.itemsize
        out = np.empty((b - a, *info.shape[1:]), info.dtype)
        fd = os.open(loc.path, os.O_RDONLY)
        try:
            pread_into(fd, info.start + a * row, out, f"{loc.path}: tensor {name}")
        finally:
            os.close(fd)
        return out

    def fill(arrays):
        for (wn, sn), out in zip(names, arrays):
            n = out.shape[0]
            step = max(1, SLAB_BYTES // fmt.row_bytes)
            for a in range(0, n, step):
                b = min(n, a + step)
                w = read(wn, a, b)
                s = read(sn, a, b) if sn is not None else None
                if s is not None and not fmt.fp8:  # FP8 file, bf16 model: check the codes, dequantize on the host
                    stored = RowFormat(fmt.head_dim, True)
                    _checked(stored, engram_rows.pack_rows(stored, w, s), f"tensor {wn} in {man.tensors[wn].path}", a)
                    w, s = host_quant.dequant_rows32(w, s, fmt.weight_dtype), None
                engram_rows.pack_rows(fmt, w, s, out[a:b])
                _checked(fmt, out[a:b], f"tensor {wn} in {man.tensors[wn].path}", a)

    return build(cfg, key, fill, opts)


def from_random(cfg, seed: int, opts: StoreOptions | None = None) -> HostTables:
    """A preset's random tables, generated on the host CPU device with the keys and init of the device
    parameters (checkpoints.random_params): bit-identical to `random_init`'s tables when run on a CPU."""
    import jax

    from checkpoints.random_params import chunk_rows
    from dsv41_jax.params import _init_tensor, tensor_specs

    fmt = row_format(cfg)
    specs = list(tensor_specs(cfg).items())
    key = content_key("random", VERSION, fmt, _cfg_key(cfg), seed)

    def fill(arrays):
        try:
            cpu = jax.devices("cpu")[0]
        except RuntimeError:  # JAX_PLATFORMS without cpu: the default device, copied out chunk by chunk
            cpu = jax.devices()[0]
        with jax.default_device(cpu):
            keys = jax.random.split(jax.random.key(seed), len(specs))
            e = 0
            for i, (path, t) in enumerate(specs):
                if t.fmt != "table":
                    continue
                out, c = arrays[e], chunk_rows(t)
                if c is None:
                    vals = jax.jit(lambda k, t=t, path=path: _init_tensor(cfg, k, t, path))(keys[i])
                    _pack_leaves(fmt, vals, path, out)
                else:  # the same chunks as random_params._chunked
                    sub = dataclasses.replace(t, shape=(c, *t.shape[1:]))
                    gen = jax.jit(lambda k, sub=sub, path=path: _init_tensor(cfg, k, sub, path))
                    for j in range(t.shape[0] // c):
                        _pack_leaves(fmt, gen(jax.random.fold_in(keys[i], j)), path, out[j * c:(j + 1) * c])
                e += 1

    return build(cfg, key, fill, opts)


def _pack_leaves(fmt, vals: dict, path, out):
    w = np.asarray(vals[path + ("weight",)])
    s = vals.get(path + ("scale",))
    engram_rows.pack_rows(fmt, w, None if s is None else np.asarray(s), out)

