"""Data-parallel ranks inside one engine (one controller process): who owns what, where a new request goes,
and how the ranks' work is packed into the SPMD program calls.

Ownership: every rank is a `Rank` with its own `PagePool` (page ids are rank-local), `Scheduler` (requests,
ring slots, token budget, preemption) and exact-mode `SnapshotIndex`; the device pools hold one block per
rank (serving.engine.runner). A request lives on one rank from admission to its end; its pages, rings and
cached prefix never leave that rank.

Placement (`Placement.place`), per new request:
1. loads: requests running + waiting on each rank; a rank is eligible while its load is at most the least
   load + `load_cap` (EngineArgs.dp_load_cap; a cap on how unbalanced stickiness may make the ranks);
2. a session (session_id) seen before goes back to its rank if that rank is eligible ("sticky": the prefix
   of its earlier turns is cached there, protected by the session TTL);
3. otherwise the eligible rank holding the longest cached prefix of the prompt (its block hashes looked up in
   each rank's pool: a shared system prompt or an earlier turn without a session id), then the least
   loaded, then the lowest index. The session is (re)bound to the chosen rank.

Packing (`decode_rows`, `chunk_groups`): a step's decodes from every rank run in one decode call whose
bucket covers the busiest rank (rank r's rows at r*B ..); prefill chunks run in calls of one chunk per rank,
grouped by program kind (decoder rows, sampling, prompt logprobs), so every rank joins every call (ranks
without work get padding rows). With one rank both reduce to the single-device engine's calls.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from serving.engine.block_hash import BLOCK, block_hashes
from serving.engine.chunk_plan import ChunkPlan
from serving.engine.page_pool import PagePool
from serving.engine.scheduler import Scheduler

MAX_SESSIONS = 1 << 16  # session -> rank entries kept (LRU)


@dataclass
class Rank:
    index: int
    pool: PagePool
    scheduler: Scheduler
    snapshots: object | None  # SnapshotIndex in exact mode

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)


class Placement:
    def __init__(self, load_cap: int, caching: bool):
        self.load_cap = load_cap
        self.caching = caching
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.counts = {"sticky": 0, "cache": 0, "load": 0, "moved": 0}

    def place(self, ranks: list[Rank], tokens: list[int], session_id: str | None, cache_salt: str | None,
              use_cache: bool = True) -> int:
        """The rank a new request runs on (module docstring)."""
        if len(ranks) == 1:
            return 0
        loads = [r.load for r in ranks]
        least = min(loads)
        eligible = [i for i, v in enumerate(loads) if v <= least + self.load_cap]
        sticky = self.sessions.get(session_id) if session_id is not None else None
        if sticky is not None and sticky in eligible:
            choice, why = sticky, "sticky"
        else:
            hits = [0] * len(ranks)
            if self.caching and use_cache:
                hashes = block_hashes(tokens, cache_salt)[:(len(tokens) - 1) // BLOCK]
                hits = [len(ranks[i].pool.lookup(hashes)) for i in range(len(ranks))]
            choice = max(eligible, key=lambda i: (hits[i], -loads[i], -i))
            why = "cache" if hits[choice] else "load"
            if sticky is not None:
                self.counts["moved"] += 1
        self.counts[why] += 1
        if session_id is not None:
            self.sessions[session_id] = choice
            self.sessions.move_to_end(session_id)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return choice


def decode_rows(plans: list[ChunkPlan], rank_of) -> tuple[int, list[int]]:
    """(rows per rank, row of each plan) for one decode call carrying every rank's decodes."""
    per: dict[int, int] = {}
    idx = []
    for p in plans:
        r = rank_of(p.req)
        idx.append((r, per.get(r, 0)))
        per[r] = per.get(r, 0) + 1
    B = max(per.values())
    return B, [r * B + i for r, i in idx]


def chunk_groups(plans: list[ChunkPlan], rank_of) -> list[tuple[list[ChunkPlan], list[int]]]:
    """Prefill chunks packed into calls of at most one chunk per rank and one program kind; each call's plans
    with their output rows (= their rank: one row per rank). Keeps each rank's chunks in plan order."""
    by_kind: dict[tuple, list[list[ChunkPlan]]] = {}
    order: list[tuple] = []
    for p in plans:
        kind = (p.decoder, p.sample, p.all_logits)
        if kind not in by_kind:
            by_kind[kind] = []
            order.append(kind)
        calls = by_kind[kind]
        r = rank_of(p.req)
        for call in calls:  # the first call of this kind without a chunk of rank r
            if all(rank_of(q.req) != r for q in call):
                call.append(p)
                break
        else:
            calls.append([p])
    return [(call, [rank_of(p.req) for p in call]) for kind in order for call in by_kind[kind]]
