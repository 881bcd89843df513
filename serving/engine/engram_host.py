"""Engram tables in host memory (`--engram-config '{"cpu_offload": true}'`, vLLM's spelling): the engine side.

With host tables the device parameters hold no Engram table (checkpoints.host_tables: read from the checkpoint
straight into host memory, one copy per host). The compiled programs take the rows a call needs as an input,
`ChunkInputs.engram_rows` (one uint8 [B, T, n_cols, row_bytes] per Engram layer; dsv41_jax.engram_rows), and
decode them in the program: no host callback inside a program, and outputs identical to device tables.

`EngramFeeder` produces those inputs off the engine thread:
- a *span* is the rows of positions [pos0, pos0 + n) of one request: its Engram ids are hashed on the host
  (dsv41_jax.engram_hash, from the request's tokens and the n-1 tokens before pos0) and its rows gathered
  (np.take, split over `gather_threads` threads for large spans) into a buffer of its own;
- spans are started as early as their tokens are known: a decode row's when the previous step's token is
  collected (`prefetch_decode`, one hash and gather for all the requests of a call), a prompt chunk's when it
  is scheduled (`prefetch`, before the step's decode call is dispatched) and the request's next chunk as soon
  as this one is dispatched (a guess of its size; a wrong guess is gathered again);
- `inputs` (at dispatch) copies a call's spans into a fixed-shape staging buffer per program shape (or uses a
  one-chunk call's span buffer as is), copies it to the device (`put`: the program's input sharding) and
  returns the StepInputs with the device arrays. The engine thread waits only for that copy when the spans
  were prefetched; the wait is the `dsv41:engram_wait_seconds` histogram, the worker time per call (hash,
  gather, staging, host-to-device copy) `dsv41:engram_lookup_seconds`.

Invariants: a span is keyed by (request id, pos0) and holds rows of positions that never change (a request's
tokens are append-only), so a prefetched span is always valid for any chunk it covers; a staging or span
buffer is reused only after its host-to-device copy completed; spans of finished requests are dropped
(`forget`) and at most `max_spans` are kept.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from checkpoints.host_tables import StoreOptions
from dsv41_jax.engram_rows import table_bytes

# Default: tables above this many GiB (all Engram layers together) live in host memory. Below it they cost under
# 3% of an H200's memory and the in-program gather is free; V4.1-Flash's 189 GiB must leave the GPUs, medium's
# 0.5 GiB need not (docs/SERVING.md).
OFFLOAD_THRESHOLD_GIB = 4.0
SPLIT_ROWS = 16384  # spans gathering more rows than this are split over the gather threads


@dataclass(frozen=True)
class EngramConfig:
    """`--engram-config` JSON. vLLM's keys: cpu_offload, use_thp, dp_shared_memory; ours: the rest."""
    cpu_offload: bool | None = None  # None: host tables above offload_threshold_gib
    use_thp: bool = True  # transparent huge pages for the host tables (madvise)
    dp_shared_memory: bool = True  # one copy per host in shm_dir, shared by every process serving them
    shm_dir: str = "/dev/shm"
    keep_shared: bool = False  # leave the shared copy for the next start
    offload_threshold_gib: float = OFFLOAD_THRESHOLD_GIB
    gather_threads: int = 2  # host threads gathering rows
    prefetch: bool = True  # start gathers when tokens are known (off: at dispatch; for measurements)

    @staticmethod
    def parse(value) -> EngramConfig:
        """From None / "" (defaults), a dict, a JSON object string, or an EngramConfig."""
        if isinstance(value, EngramConfig):
            return value
        if value in (None, ""):
            return EngramConfig()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--engram-config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--engram-config must be a JSON object, e.g. '{\"cpu_offload\": true}'")
        known = {f.name: f for f in dataclasses.fields(EngramConfig)}
        bad = sorted(set(value) - set(known))
        if bad:
            raise ValueError(f"--engram-config: unknown key(s) {bad}; known: {sorted(known)}")
        cfg = EngramConfig(**value)
        for name in ("use_thp", "dp_shared_memory", "keep_shared", "prefetch"):
            if not isinstance(getattr(cfg, name), bool):
                raise ValueError(f"--engram-config: {name} must be true or false")
        if cfg.cpu_offload is not None and not isinstance(cfg.cpu_offload, bool):
            raise ValueError("--engram-config: cpu_offload must be true, false or null")
        if not isinstance(cfg.gather_threads, int) or cfg.gather_threads < 1:
            raise ValueError("--engram-config: gather_threads must be an integer >= 1")
        return cfg

    def resolved(self, cfg) -> EngramConfig:
        """cpu_offload made concrete for a model (False when it has no Engram layer)."""
        if not cfg.engram_layer_ids:
            return dataclasses.replace(self, cpu_offload=False)
        if self.cpu_offload is None:
            big = sum(table_bytes(cfg)) > self.offload_threshold_gib * 2 ** 30
            return dataclasses.replace(self, cpu_offload=big)
        return self

    def store_options(self) -> StoreOptions:
        return StoreOptions(shared=self.dp_shared_memory, shm_dir=self.shm_dir, use_thp=self.use_thp,
                            keep=self.keep_shared)


# ----------------------------------------------------------------------------- loading
def load_host_model(model, seed: int, weight_format, mesh, parallel, ecfg: EngramConfig):
    """(cfg, device params without tables, HostTables) of a preset, a ModelConfig or a checkpoint directory."""
    import os

    import checkpoints
    from checkpoints import host_tables
    from dsv41_jax.config import ModelConfig

    opts = ecfg.store_options()
    if isinstance(model, ModelConfig) or (isinstance(model, str) and not os.path.isdir(model)):
        cfg = model if isinstance(model, ModelConfig) else ModelConfig.preset(model)
        tables = host_tables.from_random(cfg, seed, opts)
        return cfg, checkpoints.random_init(cfg, seed, mesh, parallel=parallel, tables=False), tables
    return checkpoints.load(model, weight_format=weight_format, mesh=mesh, parallel=parallel, host_tables=opts)


def tables_to_host(cfg, params, ecfg: EngramConfig):
    """Given parameters with device tables: (params without them, HostTables holding a copy). The caller's
    arrays are left alone (tests and benchmarks share one parameter tree between engines)."""
    from checkpoints import host_tables
    from dsv41_jax.engram_rows import split_tables

    params, nodes = split_tables(params)
    if any(n is None for n in nodes):
        raise ValueError("host Engram tables: the parameters hold no table; pass engram_tables= as well")
    return params, host_tables.from_arrays(cfg, nodes, dataclasses.replace(ecfg.store_options(), shared=False))


# ----------------------------------------------------------------------------- the feeder
class _Span:
    __slots__ = ("n", "future", "pooled", "gather_s")

    def __init__(self, n: int, pooled: bool):
        self.n, self.pooled, self.gather_s = n, pooled, 0.0
        self.future: Future | None = None  # -> list of per-layer arrays [cap >= n, n_cols, row_bytes]


class _BufferPool:
    """Free buffers by shape (a staging or span buffer goes back once its host-to-device copy is done)."""

    def __init__(self, per_shape: int = 4):
        self.free: dict[tuple, list] = {}
        self.lock = threading.Lock()
        self.per_shape = per_shape

    def get(self, shape: tuple, n_layers: int) -> list[np.ndarray]:
        with self.lock:
            lst = self.free.get(shape)
            if lst:
                return lst.pop()
        return [np.zeros(shape, np.uint8) for _ in range(n_layers)]

    def put(self, shape: tuple, bufs: list[np.ndarray]):
        with self.lock:
            lst = self.free.setdefault(shape, [])
            if len(lst) < self.per_shape:
                lst.append(bufs)


class EngramFeeder:
    """Gathers host-table rows for the engine's programs (module docstring). `put(list of per-layer numpy
    arrays) -> tuple of device arrays` places a call's rows with its programs' input sharding."""

    def __init__(self, cfg, tables, hasher, put, metrics=None, *, gather_threads: int = 2, prefetch: bool = True,
                 max_spans: int = 256):
        self.cfg, self.tables, self.hasher, self.put, self.metrics = cfg, tables, hasher, put, metrics
        self.E, self.C, self.RB = len(tables.arrays), hasher.layout.n_cols, tables.fmt.row_bytes
        self.h = hasher.n - 1
        self.prefetching = prefetch
        self.max_spans = max_spans
        self.spans: OrderedDict[tuple, _Span] = OrderedDict()
        self.lock = threading.Lock()
        self.pool = _BufferPool()
        self.threads = gather_threads
        self._gather = ThreadPoolExecutor(gather_threads + 1, thread_name_prefix="engram-gather")
        self._split = ThreadPoolExecutor(gather_threads, thread_name_prefix="engram-split")
        self._stage = ThreadPoolExecutor(1, thread_name_prefix="engram-stage")

    # ------------------------------------------------------------------ host work (worker threads)
    def _ids(self, toks: np.ndarray, hist: np.ndarray) -> np.ndarray:
        """[k, n] tokens + [k, h] compressed history -> [k, n, E, C] int32 row ids."""
        return self.hasher.hash_ids(toks, hist)

    def _take(self, ids: np.ndarray, bufs: list[np.ndarray]):
        """ids [m, E, C] -> bufs[e][:m] ([m, C, RB] each), split over the gather threads when large."""
        m = ids.shape[0]
        if m * self.C * self.E <= SPLIT_ROWS or self.threads == 1:
            for e in range(self.E):
                np.take(self.tables.arrays[e], ids[:, e].reshape(-1), axis=0,
                        out=bufs[e][:m].reshape(m * self.C, self.RB))
            return
        step = -(-m // self.threads)

        def part(a):
            b = min(m, a + step)
            for e in range(self.E):
                np.take(self.tables.arrays[e], ids[a:b, e].reshape(-1), axis=0,
                        out=bufs[e][a:b].reshape((b - a) * self.C, self.RB))

        for f in [self._split.submit(part, a) for a in range(0, m, step)]:
            f.result()

    def _history(self, tokens: list[int], pos0: int) -> np.ndarray:
        hist = np.full(self.h, -1, np.int64)
        prev = tokens[max(pos0 - self.h, 0):pos0]
        if prev:
            hist[self.h - len(prev):] = self.hasher.compress(np.asarray(prev))
        return hist

    def _gather_span(self, span: _Span, toks: list[int], pos0: int, cap: int):
        t0 = time.perf_counter()
        n = span.n
        bufs = self.pool.get((cap, self.C, self.RB), self.E) if span.pooled else \
            [np.empty((cap, self.C, self.RB), np.uint8) for _ in range(self.E)]
        ids = self._ids(np.asarray(toks[pos0:pos0 + n], np.int64)[None], self._history(toks, pos0)[None])[0]
        self._take(ids, bufs)
        span.gather_s = time.perf_counter() - t0
        return bufs

    def _gather_decode(self, spans: list[_Span], toks: np.ndarray, hist: np.ndarray, futs: list[Future]):
        try:
            t0 = time.perf_counter()
            k = len(spans)
            bufs = [np.empty((k, self.C, self.RB), np.uint8) for _ in range(self.E)]
            self._take(self._ids(toks, hist)[:, 0], bufs)
            dt = (time.perf_counter() - t0) / k
            for j, (s, f) in enumerate(zip(spans, futs)):
                s.gather_s = dt
                f.set_result([b[j:j + 1] for b in bufs])
        except BaseException as e:  # noqa: BLE001 - surfaced by the staging that waits for these spans
            for f in futs:
                if not f.done():
                    f.set_exception(e)

    # ------------------------------------------------------------------ spans
    def _remember(self, key, span: _Span):
        with self.lock:
            old = self.spans.pop(key, None)
            self.spans[key] = span
            while len(self.spans) > self.max_spans:
                _, dropped = self.spans.popitem(last=False)
                self._release_later(dropped)
        if old is not None:
            self._release_later(old)

    def _release_later(self, span: _Span):
        if span.pooled:
            span.future.add_done_callback(lambda f, s=span: self._recycle(s, f))

    def _recycle(self, span: _Span, fut: Future):
        if fut.exception() is None:
            bufs = fut.result()
            self.pool.put(bufs[0].shape, bufs)

    def prefetch(self, req, pos0: int, n: int, cap: int | None = None):
        """Start gathering rows [pos0, pos0 + n) of `req` (a prompt chunk); `cap`: the buffer's rows (the
        chunk's program bucket, so a one-chunk call sends the span buffer itself)."""
        if n <= 0 or not self.prefetching:
            return
        key = (req.request_id, pos0)
        with self.lock:
            have = self.spans.get(key)
        if have is not None and have.n >= n:
            return
        self._remember(key, self._start(req.tokens, pos0, n, cap))

    def _start(self, tokens: list[int], pos0: int, n: int, cap: int | None) -> _Span:
        """A span gathered by a worker; `cap` (a program bucket): its buffer comes from the pool (fixed shapes),
        else a buffer of its own."""
        span = _Span(n, pooled=cap is not None)
        cap = cap or n
        toks = tokens[max(pos0 - self.h, 0):pos0 + n]  # a snapshot: the list grows on the engine thread
        base = max(pos0 - self.h, 0)
        span.future = self._gather.submit(lambda: self._gather_span(span, toks, pos0 - base, cap))
        return span

    def prefetch_decode(self, reqs: list):
        """Start gathering the next decode row of each request (its last token, just collected): one hash and
        one gather for all of them."""
        if not reqs or not self.prefetching:
            return
        toks = np.asarray([[r.tokens[-1]] for r in reqs], np.int64)
        hist = np.stack([self._history(r.tokens, len(r.tokens) - 1) for r in reqs])
        spans, futs = [], []
        for r in reqs:
            s = _Span(1, pooled=False)
            s.future = Future()
            spans.append(s)
            futs.append(s.future)
            self._remember((r.request_id, len(r.tokens) - 1), s)
        self._gather.submit(self._gather_decode, spans, toks, hist, futs)

    def forget(self, request_id: str):
        with self.lock:
            keys = [k for k in self.spans if k[0] == request_id]
            dropped = [self.spans.pop(k) for k in keys]
        for s in dropped:
            self._release_later(s)

    def _take_span(self, req, pos0: int, n: int) -> tuple[_Span, bool]:
        """The span covering [pos0, pos0 + n) of req (popped from the prefetched ones, or started now)."""
        with self.lock:
            span = self.spans.pop((req.request_id, pos0), None)
        if span is not None and span.n >= n:
            return span, True
        if span is not None:
            self._release_later(span)
        return self._start(req.tokens, pos0, n, None), False

    # ------------------------------------------------------------------ staging
    def inputs(self, inp, rows: list[tuple[int, object, int, int]]):
        """`inp` (a program's StepInputs) with its Engram rows on the device. rows: (row, request, pos0, n) of
        every row the call carries; padding rows keep whatever the staging buffer holds (never read)."""
        B, T = inp.chunk.tokens.shape
        spans, misses = [], 0
        for row, req, pos0, n in rows:
            span, hit = self._take_span(req, pos0, n)
            misses += not hit
            spans.append((row, n, span))
        if self.metrics is not None and misses and self.prefetching:
            self.metrics.inc("engram_prefetch_misses", misses)
        ready: Future = Future()
        done = self._stage.submit(self._stage_call, B, T, spans, ready)
        t0 = time.perf_counter()
        try:
            arrays = ready.result()
        except BaseException:
            done.result()  # the staging's own error, if it failed before `ready` was set
            raise
        if self.metrics is not None:
            self.metrics.observe("engram_wait", time.perf_counter() - t0)
        return dataclasses.replace(inp, chunk=dataclasses.replace(inp.chunk, engram_rows=arrays))

    def _stage_call(self, B: int, T: int, spans, ready: Future):
        try:
            self._stage_rows(B, T, spans, ready)
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread waiting on `ready`
            if not ready.done():
                ready.set_exception(e)

    def _stage_rows(self, B: int, T: int, spans, ready: Future):
        done = [(row, n, s, s.future.result()) for row, n, s in spans]
        t1 = time.perf_counter()
        direct = B == 1 and len(done) == 1 and done[0][0] == 0 and done[0][3][0].shape[0] == T
        if direct:  # one chunk whose span buffer has the program's shape: sent as it is
            stage_shape, bufs = None, [b.reshape(1, T, self.C, self.RB) for b in done[0][3]]
        else:
            stage_shape = (B, T, self.C, self.RB)
            bufs = self.pool.get(stage_shape, self.E)
            for row, n, _, src in done:
                for e in range(self.E):
                    bufs[e][row, :n] = src[e][:n]
        arrays = tuple(self.put(bufs))
        t2 = time.perf_counter()
        ready.set_result(arrays)  # the engine thread dispatches now; the copy may still be in flight
        for a in arrays:
            a.block_until_ready()  # the copy has read the host buffers: they may be reused
        if stage_shape is not None:
            self.pool.put(stage_shape, bufs)
        for _, _, s, src in done:
            if s.pooled:
                self.pool.put(src[0].shape, src)
        if self.metrics is not None:
            gather = sum(s.gather_s for _, _, s, _ in done)
            self.metrics.observe("engram_lookup", gather + (t2 - t1))
            self.metrics.inc("engram_rows", sum(n for _, n, _, _ in done) * self.E * self.C)

    def close(self):
        for ex in (self._stage, self._gather, self._split):
            ex.shutdown(wait=True)
