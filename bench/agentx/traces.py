"""Weka-format traces (real captures or `tracegen` output) read into session trees the replayer walks.

Format (the Weka trace format AgentX replays): one trace per JSON line, `{id, block_size, tool_tokens, system_tokens,
requests: [...]}` where a request is `{type: "n", t, in, out, hash_ids, think_time, api_time, ...}` or a
`{type: "subagent", agent_id, requests: [...]}` entry (nested, possibly recursively). A `.json` file holding
one trace or a list of traces loads too.

Normalised tree (`Conv`): the conversation's "n" turns in order, and its spawns. A subagent listed after the
conversation's turn k starts when turn k has completed, after `delay` (its first request's `think_time`, the
recorded end-to-start gap). It is *joined* when the conversation's next turn waits for it: the generator
writes `join` explicitly; for real captures it is inferred as recorded: the next parent turn started at or
after the subagent's last request ended (`t + api_time`, 1 s tolerance), otherwise the parent went on
without it (background). `extends[i]` says whether turn i's blocks start with all full blocks of turn i-1
(false after a compaction), which the chat client uses to rebuild message boundaries.

`PerfectCache` is the theoretical prefix cache (InferenceX's "theoretical hit"): an infinite cache of block
chains per session-tree instance (plus the system blocks before the cache-bust marker, shared by every
instance of a trace); a request hits the leading run of its blocks whose chained prefix was sent before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

JOIN_TOLERANCE_S = 1.0


@dataclass
class Turn:
    index: int
    t: float
    isl: int
    osl: int
    hash_ids: list[int]
    think: float
    api_time: float | None


@dataclass
class Spawn:
    conv: Conv
    after: int  # the parent's turn index after which it starts (-1: before the first turn)
    join: bool  # the parent's turn after+1 waits for it
    delay: float  # seconds after that turn completed


@dataclass
class Conv:
    key: str
    turns: list[Turn]
    spawns: list[Spawn]
    sys_tokens: int  # tool definitions + system prompt (block aligned): the system message
    extends: list[bool] = field(default_factory=list)

    def walk(self):
        yield self
        for s in self.spawns:
            yield from s.conv.walk()

    def end_time(self) -> float:
        """Recorded end of this conversation and of the subagents it joins."""
        ends = [t.t + (t.api_time or 0.0) for t in self.turns]
        ends += [s.conv.end_time() for s in self.spawns if s.join]
        return max(ends, default=0.0)


@dataclass
class Trace:
    id: str
    block_size: int
    root: Conv

    @property
    def n_requests(self) -> int:
        return sum(len(c.turns) for c in self.root.walk())

    @property
    def peak_tokens(self) -> int:
        return max((t.isl + t.osl for c in self.root.walk() for t in c.turns), default=0)

    @property
    def n_subagents(self) -> int:
        return sum(1 for _ in self.root.walk()) - 1


def _turn(row: dict, index: int, block: int) -> Turn:
    isl, osl = int(row["in"]), int(row["out"])
    ids = row.get("hash_ids")
    if ids is None:  # no block structure recorded: every block unique (no sharing)
        ids = [("u", id(row), j) for j in range(-(-isl // block))]
    return Turn(index, float(row.get("t", 0.0)), isl, max(osl, 1), list(ids), float(row.get("think_time") or 0.0),
                row.get("api_time"))


def _conv(rows: list[dict], key: str, sys_tokens: int, block: int) -> Conv:
    rows = sorted(rows, key=lambda r: float(r.get("t", 0.0)))  # stable: file order breaks ties
    turns: list[Turn] = []
    spawns: list[Spawn] = []
    pending: list[Spawn] = []
    for row in rows:
        if row.get("type") == "subagent":
            sub_sys = _block_up(int(row.get("tool_tokens") or 0) + int(row.get("system_tokens") or 0), block)
            child = _conv(row.get("requests", []), f"{key}/{row.get('agent_id', len(spawns))}", sub_sys, block)
            delay = child.turns[0].think if child.turns else 0.0
            sp = Spawn(child, len(turns) - 1, bool(row.get("join", False)), delay)
            spawns.append(sp)
            if "join" not in row:
                pending.append(sp)
        elif "in" in row:
            turns.append(_turn(row, len(turns), block))
    for sp in pending:  # infer joins from timing (real captures)
        nxt = sp.after + 1
        sp.join = nxt < len(turns) and turns[nxt].t >= sp.conv.end_time() - JOIN_TOLERANCE_S
    conv = Conv(key, turns, spawns, sys_tokens)
    conv.extends = [False] + [_extends(turns[i - 1], turns[i], block) for i in range(1, len(turns))]
    return conv


def _extends(a: Turn, b: Turn, block: int) -> bool:
    k = a.isl // block
    return len(b.hash_ids) >= k and b.hash_ids[:k] == a.hash_ids[:k]


def _block_up(n: int, block: int) -> int:
    return -(-n // block) * block


def parse_trace(obj: dict) -> Trace:
    block = int(obj.get("block_size", 64))
    sys_tokens = _block_up(int(obj.get("tool_tokens") or 0) + int(obj.get("system_tokens") or 0), block)
    return Trace(str(obj.get("id", "trace")), block, _conv(obj.get("requests", []), "root", sys_tokens, block))


def load_traces(path) -> list[dict]:
    """Raw trace dicts from a .jsonl (one per line) or .json (one trace or a list) file."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        obj = json.loads(text)
        return obj if isinstance(obj, list) else [obj]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def usable(traces: list[Trace], max_context: int | None) -> tuple[list[Trace], int]:
    """Drop whole traces whose peak ISL + OSL exceeds max_context (AIPerf's --max-context-length)."""
    keep = [t for t in traces if t.root.turns and (max_context is None or t.peak_tokens <= max_context)]
    return keep, len(traces) - len(keep)


class PerfectCache:
    """Theoretical prefix cache of one session-tree instance: chained block keys seen so far.

    The cache-bust marker sits right after a conversation's system region, so those leading blocks are the same
    in every instance of a trace and may be shared across instances: they are kept in `shared` (one set per
    trace, passed in), the rest per instance.
    """

    def __init__(self, shared: set | None = None):
        self.seen: set[int] = set()
        self.shared = shared if shared is not None else set()

    def lookup_insert(self, hash_ids: list, shared_blocks: int = 0) -> tuple[int, int]:
        """(hit blocks, total blocks) for a request whose first `shared_blocks` precede the marker; then
        remember its blocks."""
        key, hit, leading = 0, 0, True
        for j, h in enumerate(hash_ids):
            key = hash((key, h))
            where = self.shared if j < shared_blocks else self.seen
            if leading and key in where:
                hit += 1
            else:
                leading = False
                where.add(key)
        return hit, len(hash_ids)
