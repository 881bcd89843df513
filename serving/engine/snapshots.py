"""Exact-mode SWA snapshots ('--no-swa-bounded-replay'): SWA rings + compressor state of every layer saved
at retained block boundaries (each prompt's last full block, and a shared-prefix junction once a second
request shows it is shared), keyed by the prefix hash there, LRU over a fixed number of device slots.
This is the memory that SWA bounded replay removes."""

from __future__ import annotations

from collections import OrderedDict


class SnapshotIndex:
    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(n_slots))[::-1]

    def best(self, hashes: list[bytes]) -> tuple[int, int | None]:
        """(k, slot): the largest k with a snapshot after block k-1 (k = 0: none)."""
        for k in range(len(hashes), 0, -1):
            s = self.by_hash.get(hashes[k - 1])
            if s is not None:
                self.by_hash.move_to_end(hashes[k - 1])
                return k, s
        return 0, None

    def claim(self, h: bytes) -> int | None:
        """A slot to save the snapshot of prefix hash h into (LRU eviction); None if already saved."""
        if h in self.by_hash:
            self.by_hash.move_to_end(h)
            return None
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.by_hash.popitem(last=False)
        self.by_hash[h] = slot
        return slot

    def clear(self):
        """Forget every snapshot (their device bytes are gone)."""
        self.by_hash.clear()
        self.free = list(range(self.n_slots))[::-1]
