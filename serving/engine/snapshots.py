"""Exact-mode SWA snapshots ('--no-swa-bounded-replay'): SWA rings + compressor state of every layer saved
at retained block boundaries (each prompt's last full block, and a shared-prefix junction once a second
request shows it is shared), keyed by the prefix hash there, LRU over a fixed number of device slots.
This is the memory that SWA bounded replay removes.

Sessions: a snapshot claimed or restored by a request with a session id is protected for `session_ttl` s
from then; eviction takes the least recently used unprotected (or expired) snapshot first and a protected one
only when every slot is protected. `end_session(id)` lifts that session's protection (the end hint)."""

from __future__ import annotations

from collections import OrderedDict


class SnapshotIndex:
    def __init__(self, n_slots: int, session_ttl: float = 0.0):
        self.n_slots = n_slots
        self.session_ttl = session_ttl
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(n_slots))[::-1]
        self.protected: dict[bytes, tuple[str, float]] = {}  # hash -> (session, protected until)

    def _protect(self, h: bytes, session: str | None, now: float):
        if session is not None and self.session_ttl > 0:
            self.protected[h] = (session, now + self.session_ttl)

    def best(self, hashes: list[bytes], session: str | None = None, now: float = 0.0) -> tuple[int, int | None]:
        """(k, slot): the largest k with a snapshot after block k-1 (k = 0: none)."""
        for k in range(len(hashes), 0, -1):
            s = self.by_hash.get(hashes[k - 1])
            if s is not None:
                self.by_hash.move_to_end(hashes[k - 1])
                self._protect(hashes[k - 1], session, now)
                return k, s
        return 0, None

    def _victim(self, now: float) -> bytes:
        for h in self.by_hash:  # LRU first
            p = self.protected.get(h)
            if p is None or p[1] <= now:
                return h
        return next(iter(self.by_hash))

    def claim(self, h: bytes, session: str | None = None, now: float = 0.0) -> int | None:
        """A slot to save the snapshot of prefix hash h into (LRU eviction, sessions' snapshots last); None if
        already saved."""
        if h in self.by_hash:
            self.by_hash.move_to_end(h)
            self._protect(h, session, now)
            return None
        if self.free:
            slot = self.free.pop()
        else:
            old = self._victim(now)
            slot = self.by_hash.pop(old)
            self.protected.pop(old, None)
        self.by_hash[h] = slot
        self._protect(h, session, now)
        return slot

    def end_session(self, session: str) -> int:
        """Lift a session's protection (its snapshots stay, as ordinary LRU entries). Returns how many."""
        ended = [h for h, (s, _) in self.protected.items() if s == session]
        for h in ended:
            del self.protected[h]
        return len(ended)

    def clear(self):
        """Forget every snapshot (their device bytes are gone)."""
        self.by_hash.clear()
        self.protected.clear()
        self.free = list(range(self.n_slots))[::-1]
