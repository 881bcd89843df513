"""Host-memory tier for prefix-cache pages (`--kv-offloading-size GiB`, vLLM's flag; 0 = off).

When a page pool evicts a cached full page, the page's bytes (one row of the device `pages` pool: every global
group of its 64 positions, packed) are copied to host memory, and a later prompt whose prefix continues past
the device hits finds them by the same chained block hash and gets them copied back into freshly allocated
device pages before its first chunk runs. Pages are self-contained and SWA bounded replay rebuilds the window
from the global KV, so a restored page serves exactly like a kept one (exact mode restores its SWA snapshot
from the device or counts a snapshot miss and recomputes, as for a device hit).

Rows are global rows of the device `pages` pool (a data-parallel rank's page p is row rank * num_pages + p).

Save (`evicted`, called by `PagePool.allocate` before the evicted pages are handed out): one gather of the
evicted rows from the runner's current `pages` pool is dispatched at once (a new device array: the next
program may donate the pool, the gather was enqueued before it), its device-to-host copy starts
(`copy_to_host_async`), and a worker thread waits for it and files the bytes in the LRU: nothing blocks the
engine step. Restore (`PagePool.restore` queues, `flush` runs before the step's programs): the host bytes are
put on the device and scattered into the new pages by one donated program (the runner's `write_pages`).

Invariants:
- an entry is keyed by the chained block hash, which covers the whole prefix and the cache salt (block_hash):
  a host page is only ever found by the same tokens under the same salt (tenant);
- every entry owns its own numpy buffer; a dropped entry is gone from the index before its buffer is freed,
  so freed host memory never serves any lookup;
- the LRU holds at most `capacity` pages (`floor(GiB * 2**30 / page_bytes)`); saves still in flight count;
- a queued restore holds its own reference to the bytes, so dropping the entry from the LRU before the flush
  cannot leave a registered device page without its contents;
- a page with a queued restore that is evicted again before the flush loses its restore (never written late
  over its next owner's KV) and is not saved again (its bytes never reached the device);
- `drop_device()` (the device pools were rebuilt) forgets queued restores; host entries stay valid.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class HostTier:
    """The host LRU of page bytes shared by every data-parallel rank's pool (a hash names the same bytes on
    every rank). `read_rows(rows) -> device array` and `write_rows(rows, host array)` are the runner's."""

    def __init__(self, capacity_bytes: float, page_bytes: int, read_rows, write_rows, metrics=None):
        self.capacity = int(capacity_bytes // page_bytes)
        if self.capacity < 1:
            raise ValueError(f"--kv-offloading-size holds no page: a page is {page_bytes} bytes")
        self.page_bytes = page_bytes
        self.read_rows, self.write_rows = read_rows, write_rows
        self.metrics = metrics
        self.lock = threading.Lock()
        self.entries: OrderedDict[bytes, np.ndarray] = OrderedDict()  # hash -> page bytes (LRU first)
        self.in_flight: set[bytes] = set()  # saves whose copy has not landed yet
        self.pending: dict[int, np.ndarray] = {}  # row -> the bytes of a restore not yet flushed
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")

    def warm_up(self, max_rows: int):
        """Compile the copy programs for batches of up to `max_rows` pages (powers of two) at start-up, so the
        first evictions do not compile inside a step: row 0 (the null page) is read and written back."""
        n = 1
        while True:
            rows = np.zeros(n, np.int32)
            self.write_rows(rows, np.asarray(self.read_rows(rows))[:n])
            if n >= max_rows:
                return
            n *= 2

    # ------------------------------------------------------------------ queries
    def num_pages(self) -> int:
        with self.lock:
            return len(self.entries)

    def has(self, h: bytes) -> bool:
        with self.lock:
            return h in self.entries

    def _count(self, key: str, n: int = 1):
        if self.metrics is not None and n:
            self.metrics.inc(key, n)

    # ------------------------------------------------------------------ save (device -> host)
    def evicted(self, pairs: list[tuple[int, bytes]]):
        """(row, hash) of pages that lose their hashes: save the ones the host does not hold yet. Called before
        the pages are reused."""
        todo = []
        with self.lock:
            for row, h in pairs:
                restoring = self.pending.pop(row, None) is not None
                if restoring or h in self.entries or h in self.in_flight:
                    continue
                self.in_flight.add(h)
                todo.append((row, h))
        if not todo:
            return
        rows = np.asarray([r for r, _ in todo], np.int32)
        dev = self.read_rows(rows)  # dispatched now: ordered before any later program that donates the pool
        try:
            dev.copy_to_host_async()
        except AttributeError:  # noqa: PERF203 - not a jax.Array (e.g. a numpy stand-in)
            pass
        self._pool.submit(self._land, [h for _, h in todo], dev)

    def _land(self, hashes: list[bytes], dev):
        try:
            host = np.asarray(dev)
        except Exception:  # noqa: BLE001 - the device copy failed: these pages are simply not offloaded
            with self.lock:
                self.in_flight.difference_update(hashes)
            return
        dropped = 0
        with self.lock:
            for i, h in enumerate(hashes):
                self.in_flight.discard(h)
                self.entries[h] = host[i].copy()  # its own buffer (the batch array is not kept)
                self.entries.move_to_end(h)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
                dropped += 1
        self._count("offload_saved_pages", len(hashes))
        self._count("offload_dropped_pages", dropped)

    def wait(self):
        """Block until every save in flight has landed (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    # ------------------------------------------------------------------ restore (host -> device)
    def queue_restore(self, row: int, h: bytes) -> bool:
        """Device row `row` (a freshly allocated page) will hold prefix hash h; False if h is not held."""
        with self.lock:
            b = self.entries.get(h)
            if b is None:
                return False
            self.entries.move_to_end(h)
            self.pending[row] = b
            return True

    def flush(self):
        """Write every queued restore into its device page (one donated scatter); call before the programs of a
        step that may read those pages."""
        with self.lock:
            if not self.pending:
                return
            items = list(self.pending.items())
            self.pending.clear()
        self.write_rows(np.asarray([r for r, _ in items], np.int32), np.stack([b for _, b in items]))
        self._count("offload_restored_pages", len(items))

    def drop_device(self):
        """The device pools were rebuilt: queued restores target pages that no longer exist."""
        with self.lock:
            self.pending.clear()

    def close(self):
        self._pool.shutdown(wait=True)
