"""Synthetic AgentX-like traces in the Weka JSON format (bench/agentx/traces.py reads them).

    python -m bench.agentx.tracegen --num-traces 64 --scale 0.0625 --out /tmp/traces.jsonl   # + a calibration report

One trace = one Claude-Code-like session tree: a main agent of `T_main` turns whose context grows by the
recorded assistant output plus a tool result every turn, and (with probability `p_sub`) subagents spawned in
parallel batches that share the parent's tool-definition blocks, run their own short conversations and are
joined by the next parent turn (85%) or run in the background (15%). Every draw comes from
`numpy.random.default_rng(seed)`; the distributions' parameters are the `GenParams` defaults.

Block model (what a real capture's chained block hashes look like): a context of n tokens has
`ceil(n / 64)` hash ids; the full blocks keep their ids while the context grows, the trailing partial block
gets a fresh id every time (its content changed), and appended tokens first fill that partial block (a new
id, since the block's content is new). Block ids are unique per trace (`hash_id_scope: local`), so the
theoretical prefix-cache hit of a request is the leading run of its ids already sent earlier in the same
tree; the generator counts it exactly (`hit_blocks`), without materialising ids when only statistics are
needed.

Extensions to the Weka fields (ignored by other readers): a subagent entry carries `join` (true: the next
parent turn waits for it), and each "n" request `hit_blocks` (its theoretical hit). Scaled variant:
`scale` multiplies every context-size distribution (tools, system, first user message, tool results,
subagent briefs, compaction size), `out_scale` the output lengths; turns, subagent structure and timing are
unchanged. With `ctx_max` set, a turn that would not fit (ISL + OSL > ctx_max) compacts the context first
(as agents auto-compact), so generated traces never overflow the server they are sized for.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace

import numpy as np

BLOCK = 64
TARGETS = {"turns_median": 43, "isl_median": 142_000, "osl_median": 444, "p_sub": 0.44, "subagents_median": 4,
           "theoretical_hit": 0.96}


@dataclass(frozen=True)
class GenParams:
    """The trace distributions. Sizes are tokens at scale 1; lognormals are given by (median, sigma)."""
    turns: tuple[float, float] = (43, 0.8)
    turns_clip: tuple[int, int] = (20, 400)
    tools_tokens: int = 12_000
    system: tuple[float, float] = (3_000, 0.3)
    user0: tuple[float, float] = (1_500, 1.0)
    out: tuple[float, float] = (444, 1.1)
    out_clip: tuple[int, int] = (16, 16_384)
    p_tool_use: float = 0.9
    # tool results: mixture of (weight, median, sigma)
    result_mix: tuple[tuple[float, float, float], ...] = ((0.60, 600, 1.0), (0.35, 4_000, 0.8), (0.05, 20_000, 0.5))
    # multiplies the result medians; calibrate() with 400 traces (seed 0, scale 1) froze 0.755: median main-agent
    # ISL 140.9K (target 142K), 41 turns, OSL 488, 43.5% with subagents (median 4), theoretical hit 0.977
    result_scale: float = 0.755
    p_compact: float = 0.01  # per turn, once ISL > 0.8 ctx_max
    compact_keep: tuple[float, float] = (15_000, 0.5)
    # end-to-start gaps: (weight, median, sigma) lognormals, then the exponential (human) weight and mean
    gap_mix: tuple[tuple[float, float, float], ...] = ((0.75, 1.5, 0.8), (0.20, 15.0, 0.7))
    gap_human: tuple[float, float] = (0.05, 120.0)
    p_sub: float = 0.44
    sub_negbin_r: int = 2  # N_sub = 1 + NegBin(r, p) with p chosen so the median is sub_median
    sub_median: int = 4
    sub_max: int = 30
    batch_sizes: tuple[tuple[int, float], ...] = ((1, 0.45), (2, 0.2), (3, 0.15), (4, 0.1), (5, 0.1))
    spawn_window: tuple[float, float] = (0.1, 0.9)
    p_join: float = 0.85
    sub_turns: tuple[float, float] = (8, 0.9)
    sub_turns_clip: tuple[int, int] = (1, 100)
    sub_system: tuple[float, float] = (2_500, 0.3)
    sub_brief: tuple[float, float] = (800, 0.8)
    sub_out: tuple[float, float] = (600, 1.1)
    sub_final: tuple[float, float] = (900, 0.7)
    scale: float = 1.0  # context scale s
    out_scale: float = 1.0  # output scale
    ctx_max: int | None = None  # None: 990_000 * scale (the corpus cap)
    model: str = "dsv41"

    def scaled(self, scale: float, out_scale: float | None = None, ctx_max: int | None = None) -> GenParams:
        return replace(self, scale=scale, out_scale=scale if out_scale is None else out_scale, ctx_max=ctx_max)

    @property
    def context_max(self) -> int:
        return int(self.ctx_max if self.ctx_max is not None else 990_000 * self.scale)


def smoke_params(ctx_max: int = 256, turns: tuple[int, int] = (2, 4)) -> GenParams:
    """Tiny sessions for a 256-token server (tests, CPU smoke): one tool block and no system prompt, a few turns
    of ~20 new tokens, short outputs, quick gaps, most sessions with one subagent."""
    return GenParams(turns=(sum(turns) / 2, 0.3), turns_clip=turns, tools_tokens=64, system=(0, 0.0),
                     user0=(16, 0.3), out=(6, 0.3), out_clip=(2, 12), result_mix=((1.0, 14, 0.4),), result_scale=1.0,
                     compact_keep=(24, 0.2), gap_mix=((1.0, 0.05, 0.5),), gap_human=(0.0, 1.0), p_sub=0.6,
                     sub_median=1, sub_max=2, sub_turns=(2, 0.3), sub_turns_clip=(1, 3), sub_system=(0, 0.0),
                     sub_brief=(10, 0.3), sub_out=(5, 0.3), sub_final=(6, 0.3), ctx_max=ctx_max)


def auto_params(max_model_len: int, out_scale: float = 0.2) -> GenParams:
    """Scaled `GenParams` for a server of `max_model_len` tokens: median ISL about max_model_len / 3.5
    (scale <= 1), contexts compacted before they overflow; `smoke_params` below 2048 tokens."""
    if max_model_len < 2048:
        return smoke_params(max_model_len)
    s = min(1.0, max_model_len / (TARGETS["isl_median"] * 3.5))
    return GenParams().scaled(s, out_scale, ctx_max=int(max_model_len * 0.97) - BLOCK)  # room for chat markup


# ---------------------------------------------------------------------------------------------- draws
def _lognormal(rng, median_sigma, mult: float = 1.0) -> float:
    med, sigma = median_sigma
    return float(med * mult * math.exp(sigma * rng.standard_normal()))


def _tokens(x: float, lo: int = 1) -> int:
    return max(lo, int(round(x)))


def _size(rng, median_sigma, mult: float) -> int:
    """A lognormal size in tokens; a zero median means none."""
    return _tokens(_lognormal(rng, median_sigma, mult)) if median_sigma[0] > 0 else 0


def _blocks_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def negbin_p_for_median(r: int, median: int) -> float:
    """p such that NegBin(r, p) (failures before r successes) has the given median (midpoint of the range)."""
    def cdf(k, p):
        return sum(math.comb(i + r - 1, i) * p ** r * (1 - p) ** i for i in range(k + 1))

    def solve(k):  # p with cdf(k, p) = 0.5 (cdf increases with p)
        lo, hi = 1e-6, 1 - 1e-6
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cdf(k, mid) < 0.5 else (lo, mid)
        return (lo + hi) / 2

    return (solve(median) + solve(median - 1)) / 2 if median > 0 else 0.99


class _Ctx:
    """A conversation context in the block model: ids of full blocks + the partial tail length."""

    def __init__(self, ids_counter: list[int]):
        self.counter = ids_counter  # shared per trace: block ids are unique within it
        self.full: list[int] = []
        self.tail = 0  # tokens in the trailing partial block
        self.sent_full = 0  # leading full blocks already sent in a request of this tree

    @property
    def n(self) -> int:
        return len(self.full) * BLOCK + self.tail

    def _new(self, k: int) -> list[int]:
        c = self.counter[0]
        self.counter[0] += k
        return list(range(c, c + k))

    def append(self, m: int):
        tot = self.tail + m
        self.full += self._new(tot // BLOCK)
        self.tail = tot % BLOCK

    def request_ids(self) -> list[int]:
        """The ids a request of this context carries (the partial tail block gets a fresh id)."""
        return self.full + (self._new(1) if self.tail else [])


@dataclass
class _Req:
    isl: int
    osl: int
    hit_blocks: int
    n_blocks: int
    hash_ids: list[int] | None
    think: float
    stop: str
    input_type: str


@dataclass
class _Sub:
    agent_id: str
    join: bool
    system_tokens: int
    requests: list[_Req] = field(default_factory=list)


class TraceGen:
    def __init__(self, params: GenParams, seed: int = 0):
        self.p = params
        self.seed = seed
        self.nb_p = negbin_p_for_median(params.sub_negbin_r, params.sub_median - 1)

    # ---------------------------------------------------------------------------------- distributions
    def _result(self, rng) -> int:
        p = self.p
        w = np.array([m[0] for m in p.result_mix])
        i = rng.choice(len(w), p=w / w.sum())
        _, med, sigma = p.result_mix[i]
        return _tokens(_lognormal(rng, (med, sigma), p.scale * p.result_scale))

    def _out(self, rng, dist=None) -> int:
        p = self.p
        lo, hi = (max(1, round(c * p.out_scale)) for c in p.out_clip)
        return int(np.clip(_tokens(_lognormal(rng, dist or p.out, p.out_scale)), lo, hi))

    def _gap(self, rng) -> float:
        p = self.p
        ws = [m[0] for m in p.gap_mix] + [p.gap_human[0]]
        w = np.array(ws) / sum(ws)
        i = rng.choice(len(w), p=w)
        if i == len(p.gap_mix):
            return float(rng.exponential(p.gap_human[1]))
        return _lognormal(rng, p.gap_mix[i][1:])

    def _n_sub(self, rng) -> int:
        return int(min(self.p.sub_max, 1 + rng.negative_binomial(self.p.sub_negbin_r, self.nb_p)))

    @staticmethod
    def _service(new_tokens: int, out: int) -> float:
        """Nominal server time (informational `api_time`): a prefill of the new tokens plus the decode."""
        return round(0.3 + new_tokens / 20_000 + out / 60, 3)

    # ---------------------------------------------------------------------------------- one conversation
    def _fits(self, ctx: _Ctx, out: int) -> bool:
        return ctx.n + out <= self.p.context_max

    def _compact(self, rng, ctx: _Ctx, sys_blocks: list[int]):
        """Context compaction: the (block-aligned) system blocks stay, a fresh summary follows."""
        keep = _tokens(_lognormal(rng, self.p.compact_keep, self.p.scale))
        keep = min(keep, max(1, self.p.context_max // 4))
        ctx.full, ctx.tail = list(sys_blocks), 0
        ctx.sent_full = min(ctx.sent_full, len(sys_blocks))
        ctx.append(keep)

    def _request(self, ctx: _Ctx, out: int, think: float, stop: str, input_type: str, materialize: bool) -> _Req:
        ids = ctx.request_ids()
        hit = min(ctx.sent_full, len(ctx.full))
        ctx.sent_full = len(ctx.full)
        return _Req(ctx.n, out, hit, len(ids), ids if materialize else None, round(think, 3), stop, input_type)

    def _conversation(self, rng, ctx: _Ctx, turns: int, sys_blocks, out_dist, final_dist, materialize: bool,
                      spawns: dict[int, list] | None = None) -> list:
        """Items: _Req or ('sub', index, _Sub) in order; subagents planned in `spawns` start after turn k."""
        p = self.p
        items: list = []
        for k in range(turns):
            last = k == turns - 1
            out = self._out(rng, final_dist if (last and final_dist) else out_dist)
            stop = "end_turn" if last or rng.random() > p.p_tool_use else "tool_use"
            if not self._fits(ctx, out) or (ctx.n > 0.8 * p.context_max and rng.random() < p.p_compact):
                self._compact(rng, ctx, sys_blocks)
                out = min(out, max(1, p.context_max - ctx.n))
            think = 0.0 if k == 0 else self._gap(rng)
            items.append(self._request(ctx, out, think, stop, "text" if k == 0 else "tool_result", materialize))
            ctx.append(out)  # the recorded assistant output joins the context
            joined = []
            for sub in (spawns or {}).get(k, []):
                items.append(("sub", k, sub))
                if sub.join:
                    joined.append(sub.requests[-1].osl)
            if not last:  # the next turn's tool result: the joined subagents' final answers, else a tool output
                ctx.append(sum(joined) if joined else self._result(rng))
        return items

    def _subagent(self, rng, ids: list[int], tools_blocks: list[int], agent_id: str, join: bool,
                  materialize: bool) -> _Sub:
        p = self.p
        sys_tokens = _blocks_up(_size(rng, p.sub_system, p.scale))
        ctx = _Ctx(ids)
        ctx.full = list(tools_blocks)
        ctx.sent_full = len(tools_blocks)  # the parent sent the tool blocks already
        ctx.append(sys_tokens)
        sys_blocks = list(ctx.full)
        ctx.append(_tokens(_lognormal(rng, p.sub_brief, p.scale)))
        lo, hi = p.sub_turns_clip
        turns = int(np.clip(round(_lognormal(rng, p.sub_turns)), lo, hi))
        sub = _Sub(agent_id, join, sys_tokens)
        sub.requests = self._conversation(rng, ctx, turns, sys_blocks, p.sub_out, p.sub_final, materialize)
        return sub

    def _plan_spawns(self, rng, turns: int, ids, tools_blocks, materialize: bool) -> dict[int, list[_Sub]]:
        p = self.p
        if rng.random() >= p.p_sub or turns < 2:
            return {}
        n = self._n_sub(rng)
        sizes = np.array([b[0] for b in p.batch_sizes])
        w = np.array([b[1] for b in p.batch_sizes])
        plan: dict[int, list[_Sub]] = {}
        lo = max(0, int(p.spawn_window[0] * turns))
        hi = max(lo + 1, min(turns - 1, int(math.ceil(p.spawn_window[1] * turns))))
        made = 0
        while made < n:
            b = int(min(n - made, rng.choice(sizes, p=w / w.sum())))
            k = int(rng.integers(lo, hi))
            for _ in range(b):
                sub = self._subagent(rng, ids, tools_blocks, f"agent_{made:03d}", bool(rng.random() < p.p_join),
                                     materialize)
                plan.setdefault(k, []).append(sub)
                made += 1
        return plan

    # ---------------------------------------------------------------------------------- one trace
    def trace(self, index: int, materialize: bool = True) -> dict:
        rng = np.random.default_rng([self.seed, index])
        p = self.p
        ids = [0]
        tools = _blocks_up(_tokens(p.tools_tokens * p.scale))
        system = _blocks_up(_size(rng, p.system, p.scale))
        ctx = _Ctx(ids)
        ctx.append(tools)
        tools_blocks = list(ctx.full)
        ctx.append(system)
        sys_blocks = list(ctx.full)
        ctx.append(_tokens(_lognormal(rng, p.user0, p.scale)))
        lo, hi = p.turns_clip
        turns = int(np.clip(round(_lognormal(rng, p.turns)), lo, hi))
        spawns = self._plan_spawns(rng, turns, ids, tools_blocks, materialize)
        items = self._conversation(rng, ctx, turns, sys_blocks, p.out, None, materialize, spawns)
        return {"id": f"syn-{self.seed}-{index:05d}", "models": [p.model], "block_size": BLOCK,
                "hash_id_scope": "local", "tool_tokens": tools, "system_tokens": system,
                "requests": self._emit(items, 0.0, tools, materialize)}

    def _emit(self, items: list, t0: float, tools: int, materialize: bool) -> list[dict]:
        """Weka rows with nominal timestamps (end-to-start gaps plus nominal service times)."""
        p = self.p
        rows: list[dict] = []
        t = t0
        pending_join_end = 0.0
        for it in items:
            if isinstance(it, tuple):
                _, _, sub = it
                start = t + 0.05
                sub_rows = self._emit(sub.requests, start, tools, materialize)
                end = max(r["t"] + r["api_time"] for r in sub_rows if r["type"] == "n")
                if sub.join:
                    pending_join_end = max(pending_join_end, end)
                rows.append({"t": round(start, 3), "type": "subagent", "agent_id": sub.agent_id,
                             "subagent_type": "Explore", "status": "completed", "models": [p.model],
                             "tool_tokens": tools, "system_tokens": sub.system_tokens, "join": sub.join,
                             "requests": sub_rows})
                continue
            r: _Req = it
            start = max(t, pending_join_end) + r.think
            api = self._service(max(r.isl - r.hit_blocks * BLOCK, 0), r.osl)
            row = {"t": round(start, 3), "type": "n", "model": p.model, "in": r.isl, "out": r.osl,
                   "hash_ids": r.hash_ids, "input_types": [r.input_type], "output_types": ["text"], "stop": r.stop,
                   "api_time": api, "think_time": r.think, "hit_blocks": r.hit_blocks}
            if not materialize:
                row["n_blocks"] = r.n_blocks
            rows.append(row)
            t = start + api
            pending_join_end = 0.0
        return rows

    def traces(self, n: int, materialize: bool = True) -> list[dict]:
        return [self.trace(i, materialize) for i in range(n)]


# ---------------------------------------------------------------------------------------------- statistics
def _walk(requests: list[dict], top: bool = True):
    """(row, is_top_level) for every "n" row of a request list, subagents included (depth first)."""
    for r in requests:
        if r.get("type") == "subagent":
            yield from _walk(r.get("requests", []), False)
        else:
            yield r, top


def calibration(traces: list[dict], params: GenParams | None = None) -> dict:
    """Generated medians against the `TARGETS` (sizes scaled by the params' scale / out_scale)."""
    turns, isl_main, isl_all, osl, hit, blocks, n_sub_list = [], [], [], [], 0, 0, []
    over = 0
    ctx_max = params.context_max if params else None
    for tr in traces:
        main = [r for r in tr["requests"] if r.get("type") != "subagent"]
        turns.append(len(main))
        subs = _count_subagents(tr["requests"])
        n_sub_list.append(subs)
        for r, top in _walk(tr["requests"]):
            (isl_main if top else isl_all).append(r["in"])
            osl.append(r["out"])
            nb = len(r["hash_ids"]) if r.get("hash_ids") is not None else r.get("n_blocks", -(-r["in"] // BLOCK))
            blocks += nb
            hit += r.get("hit_blocks", 0)
            if ctx_max and r["in"] + r["out"] > ctx_max:
                over += 1
    isl_all = isl_all + isl_main
    with_sub = [n for n in n_sub_list if n > 0]
    s = params.scale if params else 1.0
    o = params.out_scale if params else 1.0
    got = {"turns_median": statistics.median(turns), "isl_median": statistics.median(isl_main),
           "osl_median": statistics.median(osl), "p_sub": len(with_sub) / len(traces),
           "subagents_median": statistics.median(with_sub) if with_sub else 0,
           "theoretical_hit": hit / max(blocks, 1)}
    target = dict(TARGETS, isl_median=TARGETS["isl_median"] * s, osl_median=TARGETS["osl_median"] * o)
    rep = {"n_traces": len(traces), "n_requests": len(osl), "scale": s, "out_scale": o,
           "isl_median_all_requests": statistics.median(isl_all), "isl_p90_main": float(np.percentile(isl_main, 90)),
           "isl_max": max(isl_all), "frac_over_ctx_max": over / max(len(osl), 1), "ctx_max": ctx_max,
           "metrics": {k: {"generated": round(float(v), 4), "target": round(float(target[k]), 4),
                           "rel_err": round(float(v) / target[k] - 1, 4) if target[k] else None}
                       for k, v in got.items()}}
    return rep


def _count_subagents(requests: list[dict]) -> int:
    return sum(1 + _count_subagents(r.get("requests", [])) for r in requests if r.get("type") == "subagent")


def calibrate(params: GenParams, seed: int = 0, n_traces: int = 400, tol: float = 0.05,
              max_iter: int = 12) -> tuple[GenParams, dict]:
    """Bisect `result_scale` until the median main-agent ISL is within tol of 142K x scale."""
    target = TARGETS["isl_median"] * params.scale
    lo, hi = 0.05, 20.0
    cur = params
    rep = {}
    for _ in range(max_iter):
        rep = calibration(TraceGen(cur, seed).traces(n_traces, materialize=False), cur)
        med = rep["metrics"]["isl_median"]["generated"]
        if abs(med / target - 1) <= tol:
            break
        if med < target:
            lo = cur.result_scale
        else:
            hi = cur.result_scale
        cur = replace(cur, result_scale=math.sqrt(lo * hi))
    return cur, rep


def write_jsonl(path, traces: list[dict]):
    with open(path, "w") as f:
        for tr in traces:
            f.write(json.dumps(tr, separators=(",", ":")) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-traces", type=int, default=64)
    ap.add_argument("--scale", type=float, default=1.0, help="context scale s (sizes x s)")
    ap.add_argument("--out-scale", type=float, default=None, help="output-length scale (default: 1)")
    ap.add_argument("--ctx-max", type=int, default=None, help="compact contexts before ISL + OSL exceeds this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calibrate", action="store_true", help="bisect the tool-result scale to the ISL target first")
    ap.add_argument("--out", default=None, help="traces.jsonl to write (and a .stats.json beside it)")
    a = ap.parse_args(argv)
    p = GenParams().scaled(a.scale, 1.0 if a.out_scale is None else a.out_scale, a.ctx_max)
    if a.calibrate:
        p, _ = calibrate(p, a.seed)
    traces = TraceGen(p, a.seed).traces(a.num_traces)
    rep = calibration(traces, p)
    rep["params"] = asdict(p)
    print(f"{'metric':>18} {'generated':>11} {'target':>11} {'rel err':>8}")
    for k, v in rep["metrics"].items():
        print(f"{k:>18} {v['generated']:>11} {v['target']:>11} {v['rel_err']:>8}")
    if a.out:
        write_jsonl(a.out, traces)
        with open(a.out.rsplit(".", 1)[0] + ".stats.json", "w") as f:
            json.dump(rep, f, indent=2)


if __name__ == "__main__":
    main()
