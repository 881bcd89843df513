"""AgentX-style replay of session trees against a server (bench/agentx/README.md, "What a run does").

- Concurrency = N lanes, each running one live session tree (a trace's main agent plus its subagents).
  Subagents run outside N, concurrently with the parent, and a joined subagent gates the parent's next turn
  (its errors still release the join). When a tree has drained (background subagents included) its lane
  draws the next trace (a seeded shuffle, reshuffled when exhausted) and replays it from turn 0.
- t* start: each lane's first tree starts at a random point t* ~ U[start_range] of its main agent's recorded
  time span; the `warmup_turns` main-agent turns just before t* are sent first (all lanes concurrently, no
  gaps), then profiling starts with every lane at its t* at the same instant. Spawns recorded after the last
  warm-up turn run; earlier ones are skipped (their work predates t*). A lane whose warm-up overflowed (or
  timed out) starts with a fresh tree from turn 0.
- Timing: a turn is sent `think_time x time_scale` after the previous turn of its conversation completed
  (end-to-start; after a join, after the join opened). Whole-system idle cap: whenever nothing is in flight
  and the next timer is more than `idle_cap` (10 s) away, every timer is pulled in so it fires in `idle_cap`
  (virtual time shift). Per-tree cap: a gap of a tree with nothing in flight is at most `tree_idle_cap`.
- Every turn sends the full history (the recorded assistant content, `prompts.TreePrompts`), max_tokens =
  recorded output, ignore_eos, streaming. A context-length error ends that conversation; other errors are
  counted and the conversation goes on.
- After `duration` seconds of profiling no new request starts; in-flight ones may finish for `grace`
  seconds, then they are cancelled (not recorded).

One `Record` per request (warm-up included, phase "warmup"); `metrics.summarize` keeps the profiling ones.
The theoretical hit of each request comes from a `PerfectCache` per tree instance fed in send order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.agentx.clients import WireRequest
from bench.agentx.prompts import TreePrompts, marker_text
from bench.agentx.traces import Conv, PerfectCache, Trace, Turn

log = logging.getLogger("bench.agentx.replay")


@dataclass
class ReplayConfig:
    concurrency: int = 4
    duration: float = 60.0
    warmup_turns: int = 1
    start_range: tuple[float, float] = (0.25, 0.75)
    idle_cap: float | None = 10.0
    tree_idle_cap: float | None = 300.0
    time_scale: float = 1.0
    grace: float = 60.0
    max_warmup_s: float | None = None
    seed: int = 42
    tag: str = "ax"  # request-id prefix (unique per run against one server)


@dataclass
class Record:
    lane: int
    tree: str
    trace: str
    conv: str
    turn: int
    phase: str  # warmup | profiling
    start: float  # seconds since the replay's origin
    end: float
    ttft: float | None
    isl_expected: int
    osl_expected: int
    isl: int | None  # server usage (prompt tokens)
    osl: int | None  # server usage (completion tokens), else the tokens counted in the stream
    cached: int | None
    hit_blocks: int
    n_blocks: int
    hit_tokens: int  # min(hit_blocks x block size, isl_expected)
    stream_tokens: int
    error: str | None
    overflow: bool

    def as_dict(self) -> dict:
        return asdict(self)


class Clock:
    """Timers in virtual time (real + shift); the idle cap advances the shift when nothing is in flight."""

    def __init__(self, idle_cap: float | None, tree_idle_cap: float | None = None):
        self.idle_cap = idle_cap
        self.tree_idle_cap = tree_idle_cap
        self.shift = 0.0
        self.in_flight = 0
        self.timers: dict[int, float] = {}
        self.stopping = False
        self._ev = asyncio.Event()
        self._n = 0

    def vnow(self) -> float:
        return time.perf_counter() + self.shift

    def wake(self):
        self._ev.set()
        self._ev = asyncio.Event()

    def stop(self):
        self.stopping = True
        self.wake()

    async def sleep(self, delay: float, tree=None) -> bool:
        """Wait `delay` virtual seconds; False when the replay is stopping."""
        if self.stopping:
            return False
        if self.tree_idle_cap is not None and tree is not None and tree.in_flight == 0:
            delay = min(delay, self.tree_idle_cap)
        if delay <= 0:
            return True
        key = self._n
        self._n += 1
        self.timers[key] = self.vnow() + delay
        try:
            self._check_idle()
            while not self.stopping:
                left = self.timers[key] - self.vnow()
                if left <= 0:
                    return True
                ev = self._ev
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except TimeoutError:
                    pass
            return False
        finally:
            self.timers.pop(key, None)

    def begin(self):
        self.in_flight += 1

    def end(self):
        self.in_flight -= 1
        if self.in_flight == 0:  # after the finishing task has registered its next timer
            asyncio.get_running_loop().call_soon(self._check_idle)

    def _check_idle(self):
        if self.in_flight or not self.timers or self.idle_cap is None or self.stopping:
            return
        gap = min(self.timers.values()) - self.vnow()
        if gap > self.idle_cap:
            self.shift += gap - self.idle_cap
            self.wake()


@dataclass
class _Tree:
    id: str
    lane: int
    trace: Trace
    prompts: TreePrompts
    cache: PerfectCache = field(default_factory=PerfectCache)
    in_flight: int = 0
    tasks: set = field(default_factory=set)


def start_turn(trace: Trace, frac: float) -> int:
    """The main agent's first turn at or after fraction `frac` of its recorded time span."""
    turns = trace.root.turns
    t0, t1 = turns[0].t, turns[-1].t
    cut = t0 + frac * (t1 - t0)
    for t in turns:
        if t.t >= cut:
            return t.index
    return turns[-1].index


class Replayer:
    def __init__(self, client, traces: list[Trace], cfg: ReplayConfig):
        if not traces:
            raise ValueError("no traces to replay")
        self.client = client
        self.traces = traces
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self._order: list[int] = []
        self.records: list[Record] = []
        self.origin = time.perf_counter()
        self.clock: Clock | None = None
        self.serial = 0
        self.trees_started = 0
        self.trees_done = 0
        self.cancelled = 0
        self.task_errors: list[str] = []
        self.shared_blocks: dict[str, set] = {}  # per trace: theoretical cache of the pre-marker blocks

    # ------------------------------------------------------------------ trees
    def _next_trace(self) -> Trace:
        if not self._order:
            self._order = list(self.rng.permutation(len(self.traces)))
        return self.traces[self._order.pop()]

    def _new_tree(self, lane: int) -> _Tree:
        tr = self._next_trace()
        self.trees_started += 1
        tid = f"{self.cfg.tag}-l{lane}-s{self.trees_started}"
        return _Tree(tid, lane, tr, TreePrompts(tr.id, tr.block_size, marker_text(self.rng), salt=self.cfg.tag),
                     PerfectCache(self.shared_blocks.setdefault(tr.id, set())))

    async def _send(self, tree: _Tree, conv: Conv, turn: Turn, phase: str) -> Record:
        if self.client.kind == "chat":
            wire = WireRequest("", f"{tree.id}:{conv.key}", turn.osl, messages=tree.prompts.messages(conv, turn))
        else:
            wire = WireRequest("", f"{tree.id}:{conv.key}", turn.osl, prompt_ids=tree.prompts.tokens(conv, turn))
        self.serial += 1
        wire.request_id = f"{self.cfg.tag}-{self.serial}"
        hit, nb = tree.cache.lookup_insert(turn.hash_ids, tree.prompts.shared_blocks(conv, turn))
        self.clock.begin()
        tree.in_flight += 1
        try:
            res = await self.client.generate(wire)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            tree.in_flight -= 1
            self.clock.end()
        o = self.origin
        osl = res.completion_tokens if res.completion_tokens is not None else (res.n_stream_tokens or None)
        rec = Record(tree.lane, tree.id, tree.trace.id, conv.key, turn.index, phase, res.start - o, res.end - o,
                     None if res.first is None else res.first - res.start, turn.isl, turn.osl, res.prompt_tokens,
                     osl if res.error is None else None, res.cached_tokens, hit, nb,
                     min(hit * tree.trace.block_size, turn.isl), res.n_stream_tokens, res.error, res.overflow)
        self.records.append(rec)
        return rec

    async def _spawn(self, tree: _Tree, sp):
        if await self.clock.sleep(sp.delay * self.cfg.time_scale, tree):
            await self._conv(tree, sp.conv, 0)

    def _start_spawns(self, tree: _Tree, conv: Conv, after: int, gates: dict):
        for sp in conv.spawns:
            if sp.after == after:
                task = asyncio.create_task(self._spawn(tree, sp))
                tree.tasks.add(task)
                if sp.join:
                    gates[after + 1].append(task)

    async def _conv(self, tree: _Tree, conv: Conv, first: int):
        gates: dict[int, list] = defaultdict(list)
        self._start_spawns(tree, conv, first - 1, gates)
        for i in range(first, len(conv.turns)):
            if self.clock.stopping:
                return
            turn = conv.turns[i]
            gate = gates.pop(i, None)
            if gate:
                await asyncio.gather(*gate, return_exceptions=True)
            if (i > first or gate) and not await self.clock.sleep(turn.think * self.cfg.time_scale, tree):
                return
            rec = await self._send(tree, conv, turn, "profiling")
            if rec.overflow:
                return  # a context-length error ends this conversation
            self._start_spawns(tree, conv, i, gates)

    async def _run_tree(self, tree: _Tree, first: int):
        root = asyncio.create_task(self._conv(tree, tree.trace.root, first))
        tree.tasks.add(root)
        while True:
            pending = [t for t in tree.tasks if not t.done()]
            if not pending:
                break
            await asyncio.gather(*pending, return_exceptions=True)
        for t in tree.tasks:
            if not t.cancelled() and t.exception() is not None:
                self.task_errors.append(f"{type(t.exception()).__name__}: {t.exception()}")
                log.error("replay task failed", exc_info=t.exception())
        if not self.clock.stopping:
            self.trees_done += 1

    async def _lane(self, tree: _Tree, first: int, alive: bool = True):
        while True:
            if alive:
                await self._run_tree(tree, first)
            alive = True
            if self.clock.stopping:
                return
            tree, first = self._new_tree(tree.lane), 0

    # ------------------------------------------------------------------ the run
    async def _warmup(self, tree: _Tree, first: int) -> bool:
        """Send the turns before t*; False when one overflowed (the session is over before it started)."""
        for turn in tree.trace.root.turns[max(0, first - self.cfg.warmup_turns):first]:
            if (await self._send(tree, tree.trace.root, turn, "warmup")).overflow:
                return False
        return True

    async def run(self, on_profiling_start=None) -> dict:
        cfg = self.cfg
        self.clock = Clock(cfg.idle_cap, cfg.tree_idle_cap)
        lanes = []
        for lane in range(cfg.concurrency):
            tree = self._new_tree(lane)
            lanes.append((tree, start_turn(tree.trace, float(self.rng.uniform(*cfg.start_range)))))
        t_w = time.perf_counter()
        warm = [asyncio.create_task(self._warmup(tree, first)) for tree, first in lanes]
        done, pending = await asyncio.wait(warm, timeout=cfg.max_warmup_s)
        for t in pending:
            t.cancel()
        ok = await asyncio.gather(*warm, return_exceptions=True)
        warmup_s = time.perf_counter() - t_w
        if on_profiling_start is not None:
            await on_profiling_start()
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(self._lane(tree, first, alive is True)) for (tree, first), alive in zip(lanes, ok)]
        stopper = asyncio.create_task(asyncio.sleep(cfg.duration))
        await asyncio.wait(tasks + [stopper], return_when=asyncio.FIRST_COMPLETED)
        if not stopper.done():  # every lane ended early (cannot happen while lanes recycle; kept for safety)
            await asyncio.wait(tasks + [stopper], return_when=asyncio.ALL_COMPLETED)
        self.clock.stop()
        t_stop = time.perf_counter()
        _, late = await asyncio.wait(tasks, timeout=cfg.grace)
        for t in late:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        prof = [r for r in self.records if r.phase == "profiling"]
        return {"warmup_s": round(warmup_s, 3), "warmup_requests": len(self.records) - len(prof),
                "warmup_timed_out": len(pending), "warmup_failed": sum(x is not True for x in ok),
                "profiling_start": round(t0 - self.origin, 3),
                "profiling_s": round(t_stop - t0, 3), "drain_s": round(time.perf_counter() - t_stop, 3),
                "idle_skipped_s": round(self.clock.shift, 3), "cancelled_in_flight": self.cancelled,
                "trees_started": self.trees_started, "trees_completed": self.trees_done,
                "start_turns": [first for _, first in lanes], "task_errors": self.task_errors[:5]}


async def replay(client, traces: list[Trace], cfg: ReplayConfig, on_profiling_start=None) -> tuple[list, dict]:
    """Start the client, replay, close it; returns (records, run info)."""
    info = await client.start()
    try:
        r = Replayer(client, traces, cfg)
        run = await r.run(on_profiling_start)
    finally:
        await client.close()
    return r.records, dict(run, server=info)
