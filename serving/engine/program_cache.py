"""Compiled programs on disk, found without tracing them: a restart loads its programs instead of lowering them.

JAX's persistent compilation cache keys an executable by its lowered module, so a restart that hits it still traces
and lowers every program (about 5 s each for medium with the Pallas kernels: 19 programs, ~100 s). This cache keys
each executable by what the program is made from, known before any tracing:
- a fingerprint of the process: this format's version, the jax and jaxlib versions, the backend, its platform
  version (the driver) and its devices' kinds; the source of every module a program is traced from (dsv41_jax,
  pallas_kernels, serving/engine, checkpoints); XLA_FLAGS and the JAX options that change a lowering;
- the model config, the resolved EngineArgs (minus the fields that change no program: the cache directory, the
  compile threads, time-outs and queue limits) and the mesh;
- the tree structure, shapes, dtypes and shardings of the parameters, the pools and the program's inputs;
- the program key.
An entry is the executable serialized by `jax.experimental.serialize_executable` with its argument and output trees,
written to a temporary file and renamed (a reader never sees half an entry). Only an executable XLA compiled in
this process is stored (`compile_fresh` tells it from one JAX's persistent cache served): XLA:CPU cannot serialize
again an executable that JAX's cache loaded (the stored copy fails when called: "Function ... not found"), and on a
GPU that round trip is not verified yet. So a program that JAX's cache serves is traced at every start until a start
compiles it (an empty or other --compilation-cache-dir). A missing,
unreadable or failing entry is a miss: the engine lowers and compiles that program as before (JAX's cache may still
serve it) and rewrites the entry. Invariant: an entry is only ever the executable of the same source, config,
flags, shapes and devices.

Not keyed, so not allowed while the cache is on: code that changes a traced function at run time (monkeypatching
model functions); the engine turns the cache on only for `--program-cache` (the server's default), not for
library callers (EngineArgs.program_cache defaults to False). Entries are not shared across processes of a
multi-host run (the engine keeps it off there). The most recently used entries within `MAX_BYTES` are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import jax

FORMAT = 1
MAX_BYTES = 8 * 2 ** 30  # entries beyond this many bytes go, least recently used first
SUBDIR = "dsv41_programs"
# EngineArgs fields that change no compiled program
UNKEYED_ARGS = ("compilation_cache_dir", "compile_threads", "program_cache", "session_ttl_s", "max_queued_requests",
                "dp_load_cap")
_PACKAGES = ("dsv41_jax", "pallas_kernels", "serving/engine", "checkpoints")
_JAX_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                "jax_threefry_partitionable", "jax_use_shardy_partitioner", "jax_numpy_dtype_promotion")
log = logging.getLogger(__name__)
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_local = threading.local()
_listening = threading.Lock()
_listener_installed = False


def _on_event(event: str, **_):
    if event == _JAX_CACHE_HIT:  # recorded synchronously, on the thread that compiles
        _local.jax_cache_hit = True


def compile_fresh(lowered):
    """`lowered.compile()`, and whether XLA compiled it here (False: JAX's persistent cache served it)."""
    global _listener_installed
    with _listening:
        if not _listener_installed:
            jax.monitoring.register_event_listener(_on_event)
            _listener_installed = True
    _local.jax_cache_hit = False
    compiled = lowered.compile()
    return compiled, not _local.jax_cache_hit


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the path and bytes of every .py file a program is traced from."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _process_fingerprint() -> list:
    import jaxlib

    dev = jax.devices()
    client = dev[0].client
    options = [(k, str(jax.config.values.get(k))) for k in _JAX_OPTIONS]
    return [FORMAT, jax.__version__, jaxlib.__version__, jax.default_backend(), client.platform_version,
            sorted({d.device_kind for d in dev}), len(dev), jax.process_count(), source_digest(),
            os.environ.get("XLA_FLAGS", ""), options]


def tree_signature(tree) -> str:
    """The structure, shapes, dtypes and shardings of a tree of arrays (or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(tree)
    sig = [(tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None))) for a in leaves]
    return f"{treedef}|{sig}"


class ProgramCache:
    """Executables under `<cache_dir>/dsv41_programs/`, keyed by `digest(key, *trees)` (see the module doc)."""

    def __init__(self, cache_dir: str, cfg, args, mesh, params, pools):
        self.dir = Path(cache_dir) / SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        keyed = {k: v for k, v in dataclasses.asdict(args).items() if k not in UNKEYED_ARGS}
        self._base = hashlib.sha256(repr([_process_fingerprint(), repr(cfg), repr(keyed), repr(mesh),
                                          tree_signature(params), tree_signature(pools)]).encode()).hexdigest()
        self.hits = self.misses = self.not_stored = 0
        self._count = threading.Lock()  # load() runs on several threads

    def digest(self, key, inputs) -> str:
        return hashlib.sha256(f"{self._base}|{key!r}|{tree_signature(inputs)}".encode()).hexdigest()

    def load(self, digest: str):
        """The executable stored under `digest`, or None (a miss; an unreadable entry is removed)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.dir / f"{digest}.pkl"
        if not path.is_file():
            self._counted("misses")
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - any failure is a miss: the program is compiled again
            log.warning("program cache entry %s unusable (%s: %s); compiling it again", path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            self._counted("misses")
            return None
        os.utime(path)  # recently used: kept by the trim
        self._counted("hits")
        return compiled

    def _counted(self, name: str):
        with self._count:
            setattr(self, name, getattr(self, name) + 1)

    def store(self, digest: str, compiled, fresh: bool = True) -> bool:
        """Write `compiled` under `digest` (atomically); False where it is not `fresh` (JAX's persistent cache
        served it) or cannot be serialized or written."""
        from jax.experimental.serialize_executable import serialize

        if not fresh:
            self.not_stored += 1
            return False
        tmp = None
        try:
            blob = pickle.dumps(serialize(compiled))
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.dir / f"{digest}.pkl")
            trim(self.dir, MAX_BYTES)
        except Exception as e:  # noqa: BLE001 - the cache is an optimisation: the engine runs without it
            log.warning("program cache: could not store %s (%s: %s)", digest[:12], type(e).__name__, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False
        return True


def trim(folder: Path, max_bytes: int):
    """Remove the least recently used entries (by modification time: `load` touches an entry) until the folder's
    entries fit in `max_bytes`; the newest entry always stays."""
    entries = []
    for p in folder.glob("*.pkl"):
        try:
            st = p.stat()
        except FileNotFoundError:  # another process removed it
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = 0
    for i, (_, size, p) in enumerate(sorted(entries, key=lambda e: e[0], reverse=True)):
        total += size
        if i > 0 and total > max_bytes:
            p.unlink(missing_ok=True)
