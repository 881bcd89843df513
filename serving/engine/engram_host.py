"""Engram tables in host memory (`--engram-config '{"cpu_offload": true}'`, vLLM's spelling): the engine side.

With host tables the device parameters hold no Engram table (checkpoints.host_tables: read from the checkpoint
straight into host memory, one copy per host). The compiled programs take the rows a call needs as an input,
`ChunkInputs.engram_rows` (one uint8 [B, T, n_cols, row_bytes] per Engram layer; dsv41_jax.engram_rows), and
decode them in the program: no host callback inside a program, and outputs identical to device tables.

`EngramFeeder` produces those inputs. The engine's step is: collect the call in flight, schedule, dispatch; the
rows a call needs and that are not ready by its dispatch sit on the critical path between two device calls, so:
- a *span* is the rows of positions [pos0, pos0 + n) of one request: its Engram ids are hashed on the host
  (dsv41_jax.engram_hash, from the request's tokens and the n-1 tokens before pos0) and its rows gathered with
  np.take (which releases the GIL) into a buffer of its own;
- a prompt chunk's span is started by a worker as early as its tokens are known: when the request is added and is
  next in line (a guess of its first chunk from the prefix-cache hit as of now and the token budget), when the
  chunk is scheduled (`prefetch`, before the step's decode call is dispatched) and the request's next chunk as
  soon as this one is dispatched (a guess of its size). A wrong guess is gathered again at dispatch, never used;
- a large span (more than SPLIT_ROWS rows) is split into pieces over `gather_threads` threads (default
  GATHER_THREADS, capped by the CPUs), each piece hashed and gathered by one thread, one Engram layer after the
  other; where a one-chunk call can take a span as it is (`eager`: B == 1, no data-parallel prefill blocks; the
  span's buffer has the chunk's program bucket of rows), each layer's rows are sent to the device as soon as that
  layer is gathered, so the copy overlaps the next layer's gather and the engine thread waits only for the last;
- a call needing few rows that were not prefetched (at most INLINE_ROWS: decode batches up to 85 requests of the
  full model) hashes and gathers them on the engine thread, in one vectorised hash and one fancy index: a few
  tenths of a millisecond, with no handoff to a thread and back (each one a GIL round trip; the device is idle
  between collecting a step and dispatching the next, so a worker would not overlap anything). Larger decode
  batches are started on a worker when the previous step's tokens are collected (`prefetch_decode`);
- `inputs` (at dispatch, on the engine thread) takes an eager one-chunk span's device arrays as they are, or
  copies the call's spans into a [B, T] staging buffer per layer and copies that to the device in one `put` call
  for all layers (the program's input sharding). The time it spends is the `dsv41:engram_wait_seconds`
  histogram, the host work per call (hash, gather, staging, starting the copies) `dsv41:engram_lookup_seconds`;
- a call of at most INLINE_ROWS rows (decode) with `rows_in_call` (the default) hands its staged rows to the
  program as numpy arrays: jax copies them to the device within the program call, as it does the call's other
  host inputs (tokens, page tables), so the call pays no device_put of its own (a Python-level dispatch, a
  fixed cost per call; bench/engram_copy.py measures both); those buffers are fresh and never reused (the call
  may still read them after it returns);
- pooled span buffers and staging buffers come from `Staging` (engram_staging.py). With `pinned_staging` (the
  default; bench/results/engram_copy_medium_h200.json) on a GPU they are registered with the device client
  once and put with `alias`: the DMA reads them directly, with no host copy on the engine thread (device_put's
  copy semantics cost a memcpy of every row there); on a GPU client that cannot register memory they are plain
  buffers put with `alias` (staged on PjRt's thread); on the CPU backend plain buffers copied by `put` as before.

Invariants: a span is keyed by (request id, pos0) and holds rows of positions that never change (a request's
tokens are append-only), so a prefetched span is valid for any chunk it covers (n >= the chunk's); a pooled span
buffer goes back to the pool only once nothing reads it and its device copy completed (`_recycle`, on a worker);
a staging buffer put with `alias` likewise only once its copy completed (`Staging.recycle`, on a worker), one
put with copies is never reused; spans of finished requests are dropped (`forget`) and at most `max_spans` are
kept. Hashing and gathering on any thread or in any number of pieces give the same rows: outputs are identical
to device tables whichever path a call takes.
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
from serving.engine.engram_staging import Staging

# Default: tables above this many GiB (all Engram layers together) live in host memory. Below it they cost under
# 3% of an H200's memory and the in-program gather is free; V4.1-Flash's 189 GiB must leave the GPUs, medium's
# 0.5 GiB need not (docs/SERVING.md).
OFFLOAD_THRESHOLD_GIB = 4.0
SPLIT_ROWS = 4096  # a span gathering more rows (tokens x layers x columns) is split over the gather threads
PIECE_ROWS = 2048  # ... into pieces of at least this many rows
INLINE_ROWS = 4096  # a call needing at most this many rows not prefetched gathers them on the engine thread
# Default gather threads (capped by the CPUs this process may use). On the H200 host a 2,048-token chunk of the full
# model's tables (98,304 random rows of 264 B in a 94 GiB table) took 21.2 ms with 1 thread, 5.8 with 4 and 3.6 with
# 8 (bench/results/engram_host_lookup_medium_h200.json): the gather waits on memory latency, so threads keep more
# misses in flight; 8 is within 10% of the copy to the device, and 8 ranks of a host x 8 threads stay below its cores.
GATHER_THREADS = 8


@dataclass(frozen=True)
class EngramConfig:
    """`--engram-config` JSON. vLLM's keys: cpu_offload, use_thp, dp_shared_memory; ours: the rest."""
    cpu_offload: bool | None = None  # None: host tables above offload_threshold_gib
    use_thp: bool = True  # transparent huge pages for the host tables (madvise)
    dp_shared_memory: bool = True  # one copy per host in shm_dir, shared by every process serving them
    shm_dir: str = "/dev/shm"
    keep_shared: bool = False  # leave the shared copy for the next start
    offload_threshold_gib: float = OFFLOAD_THRESHOLD_GIB
    gather_threads: int = 0  # host threads gathering rows (0: GATHER_THREADS, capped by the CPUs)
    prefetch: bool = True  # start gathers when tokens are known (off: at dispatch; for measurements)
    rows_in_call: bool = True  # decode-size calls pass their rows to the program as numpy arrays (copied within
    # the program call like its other host inputs) instead of a device_put of their own (engram_host.py)
    pinned_staging: bool = True  # gather into buffers registered with the device client: no host copy before the
    # DMA (engram_staging.py; bench/results/engram_copy_medium_h200.json: a 2K chunk's rows 1.6 ms vs 5.2 copied);
    # CPU: rows copied as before

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
        for name in ("use_thp", "dp_shared_memory", "keep_shared", "prefetch", "pinned_staging", "rows_in_call"):
            if not isinstance(getattr(cfg, name), bool):
                raise ValueError(f"--engram-config: {name} must be true or false")
        if cfg.cpu_offload is not None and not isinstance(cfg.cpu_offload, bool):
            raise ValueError("--engram-config: cpu_offload must be true, false or null")
        if not isinstance(cfg.gather_threads, int) or isinstance(cfg.gather_threads, bool) or cfg.gather_threads < 0:
            raise ValueError("--engram-config: gather_threads must be an integer >= 0 (0: the default)")
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
class _Rows:
    """A span's gathered rows: `host` (one [cap, n_cols, row_bytes] array per layer) and, for an eager span,
    `dev` (the same rows on the device as a one-chunk call takes them, [1, cap, ...] per layer)."""
    __slots__ = ("host", "dev")

    def __init__(self, host: list[np.ndarray], dev: tuple | None):
        self.host, self.dev = host, dev


class _Span:
    __slots__ = ("n", "cap", "future", "pooled", "eager", "gather_s")

    def __init__(self, n: int, cap: int, pooled: bool, eager: bool):
        self.n, self.cap, self.pooled, self.eager, self.gather_s = n, cap, pooled, eager, 0.0
        self.future: Future | None = None  # -> _Rows


def default_gather_threads() -> int:
    """GATHER_THREADS, or this process's CPUs when fewer."""
    import os

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(GATHER_THREADS, cpus))


class EngramFeeder:
    """Gathers host-table rows for the engine's programs (module docstring). `put(list of per-layer numpy
    arrays) -> list of device arrays` places a call's rows with its programs' input sharding; `eager`: a
    one-chunk prefill call takes a span's rows as they are (B == 1: no data-parallel prefill blocks), so a
    prefetched chunk's rows go to the device layer by layer as soon as they are gathered."""

    def __init__(self, cfg, tables, hasher, put, metrics=None, *, gather_threads: int = 0, prefetch: bool = True,
                 max_spans: int = 256, eager: bool = True, pinned: bool = False, mapper=None,
                 in_call: bool = False):
        self.cfg, self.tables, self.hasher, self.put, self.metrics = cfg, tables, hasher, put, metrics
        self.E, self.C, self.RB = len(tables.arrays), hasher.layout.n_cols, tables.fmt.row_bytes
        self.h = hasher.n - 1
        self.prefetching = prefetch
        self.eager = eager
        self.max_spans = max_spans
        self.spans: OrderedDict[tuple, _Span] = OrderedDict()
        self.lock = threading.Lock()
        self.staging = Staging(self.E, pinned, mapper)  # pooled span buffers and staging buffers
        self.alias = self.staging.alias  # put(..., alias): the transfer reads our buffers after put returns
        self.in_call = in_call  # small calls (decode) hand their rows to the program as numpy arrays
        self.threads = gather_threads or default_gather_threads()
        self._gather = ThreadPoolExecutor(3, thread_name_prefix="engram-gather")  # a span at a time each
        self._split = ThreadPoolExecutor(self.threads, thread_name_prefix="engram-split")
        self._release_ex = ThreadPoolExecutor(1, thread_name_prefix="engram-release")

    # ------------------------------------------------------------------ host work
    def _inline(self, tokens: int) -> bool:
        """Small enough to hash and gather on the engine thread (module docstring)."""
        return tokens * self.E * self.C <= INLINE_ROWS

    def _hist(self, toks, end: int) -> np.ndarray:
        """Compressed history [h] of the tokens before `end` of `toks` (-1 before the sequence's start)."""
        hist = np.full(self.h, -1, np.int64)
        prev = toks[max(end - self.h, 0):end]
        if len(prev):
            hist[self.h - len(prev):] = self.hasher.compress(np.asarray(prev))
        return hist

    def _hash(self, toks, a: int, b: int) -> np.ndarray:
        """[b - a, E, C] int32 row ids of positions [a, b) of `toks` (a snapshot that starts at the sequence's
        start or at least h tokens before a)."""
        return self.hasher.hash_ids(np.asarray(toks[a:b], np.int64)[None], self._hist(toks, a)[None])[0]

    def _take_layer(self, ids: np.ndarray, e: int, out: np.ndarray):
        """ids [m, E, C] -> out [m, C, RB]: layer e's rows (np.take releases the GIL)."""
        m = ids.shape[0]
        np.take(self.tables.arrays[e], ids[:, e].reshape(-1), axis=0, out=out.reshape(m * self.C, self.RB))

    def _take(self, ids: np.ndarray, bufs: list[np.ndarray]):
        """ids [m, E, C] -> bufs[e][:m] ([m, C, RB] each), split over the gather threads when large."""
        m = ids.shape[0]
        pieces = self._pieces(m)
        for e in range(self.E):
            if len(pieces) == 1:
                self._take_layer(ids, e, bufs[e][:m])
            else:
                self._map(lambda ab, e=e: self._take_layer(ids[ab[0]:ab[1]], e, bufs[e][ab[0]:ab[1]]), pieces)

    def _pieces(self, m: int) -> list[tuple[int, int]]:
        rows = m * self.C * self.E
        if rows <= SPLIT_ROWS or self.threads == 1:
            return [(0, m)]
        step = -(-m // min(self.threads, -(-rows // PIECE_ROWS)))
        return [(a, min(m, a + step)) for a in range(0, m, step)]

    def _map(self, fn, pieces):
        return [f.result() for f in [self._split.submit(fn, p) for p in pieces]]

    def _gather_span(self, span: _Span, toks: list[int], off: int) -> _Rows:
        """Worker: rows of positions [off, off + n) of the snapshot `toks`. Large spans are split over the gather
        threads (each piece hashed and gathered by one thread), layer by layer; an eager span's layer is sent to
        the device as soon as it is gathered, so its copy overlaps the next layer's gather."""
        t0 = time.perf_counter()
        n, cap = span.n, span.cap
        bufs = self.staging.get((cap, self.C, self.RB)) if span.pooled else \
            [np.empty((cap, self.C, self.RB), np.uint8) for _ in range(self.E)]
        dev = []
        pieces = self._pieces(n)
        ids: list = [None] * len(pieces)

        def first(i):  # hash a piece, gather its layer-0 rows
            a, b = pieces[i]
            ids[i] = self._hash(toks, off + a, off + b)
            self._take_layer(ids[i], 0, bufs[0][a:b])

        if len(pieces) == 1:
            first(0)
        else:
            self._map(first, range(len(pieces)))
        for e in range(self.E):
            if e:
                if len(pieces) == 1:
                    self._take_layer(ids[0], e, bufs[e][:n])
                else:
                    self._map(lambda i, e=e: self._take_layer(ids[i], e, bufs[e][pieces[i][0]:pieces[i][1]]),
                              range(len(pieces)))
            if span.eager:
                dev += self.put([bufs[e][None]], self.alias)  # asynchronous: copied while the next layer is gathered
        span.gather_s = time.perf_counter() - t0
        return _Rows(bufs, tuple(dev) if span.eager else None)

    def _gather_decode(self, spans: list[_Span], toks: np.ndarray, hist: np.ndarray, futs: list[Future]):
        try:
            t0 = time.perf_counter()
            k = len(spans)
            bufs = [np.empty((k, self.C, self.RB), np.uint8) for _ in range(self.E)]
            self._take(self.hasher.hash_ids(toks, hist)[:, 0], bufs)
            dt = (time.perf_counter() - t0) / k
            for j, (s, f) in enumerate(zip(spans, futs)):
                s.gather_s = dt
                f.set_result(_Rows([b[j:j + 1] for b in bufs], None))
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
                self._release(dropped)
        if old is not None:
            self._release(old)

    def _release(self, span: _Span):
        """A pooled span's buffers go back once its gather and its device copy are done (on a worker)."""
        if span.pooled:
            self._release_ex.submit(self._recycle, span)

    def _recycle(self, span: _Span):
        try:
            rows = span.future.result()
            self.staging.recycle(rows.host, rows.dev or ())  # once the copies have read the host buffers
        except BaseException:  # noqa: BLE001 - a failed span's buffers are not reused
            return

    def prefetch(self, req, pos0: int, n: int, cap: int | None = None):
        """Start gathering rows [pos0, pos0 + n) of `req` (a prompt chunk); `cap`: the buffer's rows (the
        chunk's program bucket, so a one-chunk call takes the span's rows as they are)."""
        if n <= 0 or not self.prefetching:
            return
        key = (req.request_id, pos0)
        with self.lock:
            have = self.spans.get(key)
        if have is not None and have.n >= n:
            return
        self._remember(key, self._start(req.tokens, pos0, n, cap))

    def _start(self, tokens: list[int], pos0: int, n: int, cap: int | None) -> _Span:
        """A span gathered by a worker; `cap` (a program bucket): pooled buffers of that many rows (fixed
        shapes), eager when the feeder is; else buffers of its own."""
        span = _Span(n, cap or n, pooled=cap is not None, eager=cap is not None and self.eager)
        base = max(pos0 - self.h, 0)
        toks = tokens[base:pos0 + n]  # a snapshot: the list grows on the engine thread
        span.future = self._gather.submit(self._gather_span, span, toks, pos0 - base)
        return span

    def prefetch_decode(self, reqs: list):
        """Start gathering the next decode row of each request (its last token, just collected): one hash and
        one gather for all of them. A small batch is left to `inputs` (gathered inline: cheaper than a handoff)."""
        if not reqs or not self.prefetching or self._inline(len(reqs)):
            return
        toks, hist = self._decode_window([(r.tokens, len(r.tokens) - 1) for r in reqs])
        spans, futs = [], []
        for r in reqs:
            s = _Span(1, 1, pooled=False, eager=False)
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
            self._release(s)

    # ------------------------------------------------------------------ staging (the engine thread)
    def inputs(self, inp, rows: list[tuple[int, object, int, int]]):
        """`inp` (a program's StepInputs) with its Engram rows on the device. rows: (row, request, pos0, n) of
        every row the call carries; padding rows hold arbitrary table rows (never read)."""
        B, T = inp.chunk.tokens.shape
        t0 = time.perf_counter()
        taken, missing = [], []
        for row, req, pos0, n in rows:
            with self.lock:
                span = self.spans.pop((req.request_id, pos0), None)
            if span is not None and span.n < n:
                self._release(span)
                span = None
            taken.append([row, req, pos0, n, span])
            if span is None:
                missing.append(taken[-1])
        inline = self._inline(sum(t[3] for t in missing))
        if missing and not inline:  # started now, on the workers
            if self.metrics is not None and self.prefetching:
                self.metrics.inc("engram_prefetch_misses", len(missing))
            for t in missing:
                t[4] = self._start(t[1].tokens, t[2], t[3], None)
        one = taken[0][4] if len(taken) == 1 else None
        if B == 1 and one is not None and taken[0][0] == 0 and one.eager and one.cap == T:
            arrays = one.future.result().dev  # a prefetched one-chunk call: its rows are on their way
            lookup = one.gather_s
            self._release(one)
        else:
            got = [(row, n, span, span.future.result().host) for row, _, _, n, span in taken if span is not None]
            t1 = time.perf_counter()
            # a small call's rows ride in the program call (fresh buffers: the call's transfer may read them after
            # it returns, and nothing tells us when it did); registered staging goes back to the pool once copied;
            # other plain buffers are never reused either
            in_call = self.in_call and self._inline(B * T)
            pooled = self.alias and not in_call
            bufs = self.staging.get((B, T, self.C, self.RB)) if pooled else \
                [np.empty((B, T, self.C, self.RB), np.uint8) for _ in range(self.E)]
            if missing and inline:  # one hash and one gather on this thread
                self._inline_rows(missing, bufs)
            for row, n, span, src in got:
                for e in range(self.E):
                    bufs[e][row, :n] = src[e][:n]
                self._release(span)
            if in_call:
                arrays = tuple(bufs)  # numpy: copied by the program call with its other host inputs
            else:
                arrays = tuple(self.put(bufs, self.alias))  # one device_put call for every layer
                if pooled:
                    self._release_ex.submit(self.staging.recycle, bufs, arrays)
            lookup = sum(g[2].gather_s for g in got) + time.perf_counter() - t1
        if self.metrics is not None:
            self.metrics.observe("engram_wait", time.perf_counter() - t0)
            self.metrics.observe("engram_lookup", lookup)
            self.metrics.inc("engram_rows", sum(t[3] for t in taken) * self.E * self.C)
        return dataclasses.replace(inp, chunk=dataclasses.replace(inp.chunk, engram_rows=arrays))

    def _decode_window(self, at: list[tuple[list, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [k, 1], compressed history [k, h]) of position p of each (tokens, p): one array for all rows
        when every p has h tokens before it (a decode batch), else row by row."""
        h = self.h
        if all(p >= h for _, p in at):
            win = np.asarray([t[p - h:p + 1] for t, p in at], np.int64)  # [k, h + 1]
            return win[:, h:], self.hasher.compress(win[:, :h])
        toks = np.asarray([[t[p]] for t, p in at], np.int64)
        return toks, np.stack([self._hist(t, p) for t, p in at])

    def _inline_rows(self, missing: list, bufs: list[np.ndarray]):
        """Hash and gather the rows of `missing` spans into the staging buffers, on the calling thread."""
        if all(t[3] == 1 for t in missing):  # decode rows: one hash and one index for all
            ids = self.hasher.hash_ids(*self._decode_window([(t[1].tokens, t[2]) for t in missing]))[:, 0]
            rows = np.asarray([t[0] for t in missing])
            for e in range(self.E):
                bufs[e][rows, 0] = self.tables.arrays[e][ids[:, e]]
            return
        parts = [(t[0], t[3], self._hash(t[1].tokens, t[2], t[2] + t[3])) for t in missing]
        rows = np.concatenate([np.full(n, r) for r, n, _ in parts])
        cols = np.concatenate([np.arange(n) for _, n, _ in parts])
        ids = np.concatenate([i for _, _, i in parts])
        for e in range(self.E):
            bufs[e][rows, cols] = self.tables.arrays[e][ids[:, e]]

    def close(self):
        for ex in (self._gather, self._split, self._release_ex):
            ex.shutdown(wait=True)
