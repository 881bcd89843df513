"""Page pool for the global KV with a prefix cache (host-side bookkeeping only; the bytes live on device).

A page holds the global KV of 64 token positions (every global group, packed: see dsv41_jax.kv_cache).

Invariants (checked by `check()` and by the property tests):
- page 0 is the null page: never allocated, referenced or freed;
- ref[p] >= 0; a page with ref > 0 is in no free queue; a page with ref == 0 is in exactly one free queue;
- a page is in the cached queues iff it has a hash, and `by_hash[h] == p` for that hash;
- allocation takes pages with ref == 0 only (eviction never takes a referenced page) and drops their hash,
  so a cache hit never returns a page whose bytes were recycled;
- a hit never rewrites a cached page: pages are filled only while their owner is its sole writer, and the
  engine writes global KV only for positions >= the hit length.

Eviction order: uncached free pages first (most recently freed first), then cached pages LRU by release
time (a request releases tail-first, so a shared prefix outlives the unique suffix), and last the pages of a
session whose next turn is still expected (released with a session id, protected for `session_ttl` s).
A page whose protection has expired is moved to the front of the cached LRU (older than anything released
since) by the next allocation.
`end_session(id)` (the client's end-of-session hint) lifts a session's protection early: its free pages become
the first cached victims (they stay hits until reused). A page is protected by the session that released it
last (`session_pages[id]` is exactly the set of pages in `free_session` released by that session).

Host tier (`attach_tier`, serving/engine/host_tier.py): every eviction of a hashed page is reported to the tier
(global row, hash) before `allocate` returns the page, so its bytes are copied out before anyone rewrites them;
`restore(hashes)` continues a device hit with pages whose bytes the tier writes back before the next programs.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class PagePool:
    def __init__(self, num_pages: int, enable_caching: bool = True, session_ttl: float = 600.0):
        if num_pages < 2:
            raise ValueError("need at least one page besides the null page")
        self.num_pages = num_pages
        self.caching = enable_caching
        self.session_ttl = session_ttl
        self.ref = np.zeros(num_pages, np.int32)
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.free_uncached: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.free_session: OrderedDict[int, float] = OrderedDict()  # page -> protected until
        self.session_of: dict[int, str] = {}  # page in free_session -> the session protecting it
        self.session_pages: dict[str, set[int]] = {}  # session -> its pages in free_session
        self._next_expiry = float("inf")  # min of free_session's deadlines (or earlier)
        self.tier = None  # a serving.engine.host_tier.HostTier (--kv-offloading-size), see attach_tier
        self.rows_base = 0  # this pool's first row in the device pages pool (data-parallel rank * num_pages)
        self.evictions = 0

    # ------------------------------------------------------------------ queries
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.free_cached) + len(self.free_session)

    def usage(self) -> float:
        return 1.0 - self.num_free() / (self.num_pages - 1)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `hashes` (downward closed: stop at the first miss)."""
        out = []
        if not self.caching:
            return out
        for h in hashes:
            p = self.by_hash.get(h)
            if p is None:
                break
            out.append(p)
        return out

    # ------------------------------------------------------------------ ownership
    def num_protected(self) -> int:
        """Free cached pages protected by a session."""
        return len(self.free_session)

    def _unprotect(self, p: int):
        """Take page p out of free_session (it must be there) and its session's index."""
        del self.free_session[p]
        sid = self.session_of.pop(p)
        pages = self.session_pages[sid]
        pages.discard(p)
        if not pages:
            del self.session_pages[sid]

    def _unqueue(self, p: int):
        if p in self.free_session:
            self._unprotect(p)
            return
        for q in (self.free_uncached, self.free_cached):
            if p in q:
                del q[p]
                return

    def acquire(self, pages: list[int]):
        """A request starts using cached pages (a prefix hit): resurrect free ones, bump ref counts."""
        for p in pages:
            if self.ref[p] == 0:
                self._unqueue(p)
            self.ref[p] += 1

    def _to_cached_front(self, pages: list[int]):
        """Unprotect free session pages (oldest first in `pages`); they become the first cached victims."""
        for p in reversed(pages):
            self._unprotect(p)
            self.free_cached[p] = None
            self.free_cached.move_to_end(p, last=False)

    def _expire(self, now: float):
        if now < self._next_expiry:
            return
        self._to_cached_front([p for p, until in self.free_session.items() if until <= now])
        self._next_expiry = min(self.free_session.values(), default=float("inf"))

    def _pop_victim(self) -> int | None:
        for q in (self.free_uncached, self.free_cached, self.free_session):
            if q:
                p = next(iter(q))
                if q is self.free_session:
                    self._unprotect(p)
                else:
                    del q[p]
                return p
        return None

    def allocate(self, n: int, now: float = 0.0) -> list[int] | None:
        """n fresh pages (ref = 1), or None if fewer than n can be freed. Evicted pages lose their hash."""
        if n > self.num_free():
            return None
        self._expire(now)
        out, evicted = [], []
        for _ in range(n):
            p = self._pop_victim()
            h = self.hash_of.pop(p, None)
            if h is not None:
                if self.by_hash.get(h) == p:
                    del self.by_hash[h]
                self.evictions += 1
                evicted.append((self.rows_base + p, h))
            self.ref[p] = 1
            out.append(p)
        if evicted and self.tier is not None:  # before anyone writes these pages: their bytes go to the host
            self.tier.evicted(evicted)
        return out

    def attach_tier(self, tier, rows_base: int = 0):
        """Offload evicted cached pages to a host tier and restore from it (`restore`)."""
        self.tier, self.rows_base = tier, rows_base

    def restore(self, hashes: list[bytes], now: float = 0.0) -> list[int]:
        """Pages for the longest prefix of `hashes` (the blocks right after the device hits) that the host tier
        holds: freshly allocated (ref = 1), registered under their hashes, their bytes queued for the copy
        back (HostTier.flush, before the next programs run)."""
        out = []
        if self.tier is None or not self.caching:
            return out
        for h in hashes:
            if h in self.by_hash or not self.tier.has(h):
                break
            got = self.allocate(1, now)
            if got is None:
                break
            if not self.tier.queue_restore(self.rows_base + got[0], h):
                self.release(got)
                break
            self.register(got[0], h)
            out.append(got[0])
        return out

    def release(self, pages: list[int], session: str | None = None, now: float = 0.0):
        """Drop one reference of each page of a request (given in request order; freed tail first)."""
        for p in reversed(pages):
            if p == 0:
                continue
            if self.ref[p] <= 0:
                raise AssertionError(f"page {p} released more often than acquired")
            self.ref[p] -= 1
            if self.ref[p] > 0:
                continue
            if p in self.hash_of:
                if session is not None and self.session_ttl > 0:
                    self.free_session[p] = now + self.session_ttl
                    self._next_expiry = min(self._next_expiry, now + self.session_ttl)
                    self.session_of[p] = session
                    self.session_pages.setdefault(session, set()).add(p)
                else:
                    self.free_cached[p] = None
            else:
                self.free_uncached[p] = None
                self.free_uncached.move_to_end(p, last=False)  # reused first

    def end_session(self, session: str) -> int:
        """The end-of-session hint: the session's protected free pages become the first cached victims (in their
        release order). Pages the session's running requests hold are not touched (they are released without
        protection when those requests end, if the engine is told). Returns the number of pages unprotected."""
        if session not in self.session_pages:
            return 0
        pages = [p for p in self.free_session if self.session_of[p] == session]
        self._to_cached_front(pages)
        return len(pages)

    def register(self, page: int, h: bytes) -> bool:
        """Mark a filled page as the cached copy of prefix hash h. False if another page already is."""
        if not self.caching or page == 0 or page in self.hash_of:
            return False
        if h in self.by_hash:
            return False
        self.hash_of[page] = h
        self.by_hash[h] = page
        return True

    def drop_cache(self):
        """Forget every cached prefix (the page bytes are gone, e.g. after the device pools were rebuilt):
        free cached pages become plain free pages; referenced pages stay with their owners, unhashed."""
        for p in list(self.free_cached) + list(self.free_session):
            self.free_uncached[p] = None
        self.free_cached.clear()
        self.free_session.clear()
        self.session_of.clear()
        self.session_pages.clear()
        if self.tier is not None:
            self.tier.drop_device()
        self.hash_of.clear()
        self.by_hash.clear()

    # ------------------------------------------------------------------ checks
    def check(self):
        """Verify the invariants of the module docstring; raises AssertionError naming the first violation."""
        def need(ok, msg):
            if not ok:
                raise AssertionError(f"page pool invariant violated: {msg}")

        queues = [set(self.free_uncached), set(self.free_cached), set(self.free_session)]
        need(all(not (a & b) for i, a in enumerate(queues) for b in queues[i + 1:]), "page in two free queues")
        free = set().union(*queues)
        need(0 not in free and self.ref[0] == 0, "null page in use")
        for p in range(1, self.num_pages):
            need(self.ref[p] >= 0, f"page {p} has a negative reference count")
            need((self.ref[p] == 0) == (p in free), f"page {p}: ref {self.ref[p]} vs free {p in free}")
        for p, h in self.hash_of.items():
            need(self.by_hash.get(h) == p, f"page {p}: hash index out of sync")
        for p in set(self.free_cached) | set(self.free_session):
            need(p in self.hash_of, f"cached free page {p} has no hash")
        for p in self.free_uncached:
            need(p not in self.hash_of, f"uncached free page {p} has a hash")
        need(set(self.session_of) == set(self.free_session), "session owners out of sync with free_session")
        need({(s, p) for s, ps in self.session_pages.items() for p in ps} ==
             {(s, p) for p, s in self.session_of.items()}, "session page index out of sync")
