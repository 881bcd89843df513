"""Where exact mode's time goes on AgentX traffic, without a model: replay generated traces against a simulated
server that keeps only the engine's prefix-cache and exact-mode snapshot bookkeeping.

    python -m bench.agentx.snapshot_sim --max-model-len 32768 --max-num-seqs 16 --concurrency 8 \\
        --slots 16,32,64,128,256 --out bench/results/agentx_snapshot_sim_ms0.json

The simulated server hashes each prompt into 64-token blocks (`serving.engine.block_hash`), finds its prefix-cache
hit in an LRU page cache of `--num-pages` pages (the engine's default size when 0), and, as the scheduler does in
exact mode (`--no-swa-bounded-replay`), resumes at the largest retained SWA snapshot inside the hit
(`serving.engine.snapshots.SnapshotIndex`, LRU over `slots`); the hit tokens after that snapshot are recomputed at
full depth. It then saves snapshots at the same boundaries the engine retains (the hit's end when it resumed
earlier, the prompt's last full block). With bounded replay the same turn recomputes only the last window (128)
of the hit. The replayer is the real one (`bench.agentx.replay`: lanes, subagents, think gaps, idle caps), run
`--time-scale` times faster; requests are answered after `--prefill-ms-per-token` x computed tokens (0:
instantly: the fewest conversations overlap, so misses are a lower bound; the server's batching and queueing
are not modelled). Prints, per slot count: warm turns, snapshot misses, and the tokens each mode computes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import OrderedDict

from bench.agentx.clients import Result, WireRequest


class SimServer:
    """Prefix cache + exact-mode snapshot index of one engine rank, with counters."""

    def __init__(self, slots: int, num_pages: int, window: int = 128, block: int = 64):
        from serving.engine.snapshots import SnapshotIndex

        self.snaps = SnapshotIndex(slots)
        self.pages: OrderedDict[bytes, None] = OrderedDict()  # cached block hashes, LRU
        self.num_pages, self.W, self.B = num_pages, window, block
        self.c = dict(turns=0, warm_turns=0, restores=0, misses=0, prompt_tokens=0, hit_tokens=0,
                      exact_computed=0, exact_recomputed_hit=0, bounded_computed=0, page_evictions=0,
                      first_turn_misses=0)
        self.sessions: set[str] = set()

    def admit(self, tokens: list[int], session: str | None = None) -> tuple[int, int]:
        """(exact-mode start, hit H) of one prompt; updates caches and counters (`session`: to tell a
        conversation's first turn, whose hit is a shared prefix with no snapshot kept, from later ones)."""
        from serving.engine.block_hash import block_hashes

        B, N = self.B, len(tokens)
        hashes = block_hashes(tokens)
        hits = 0
        for h in hashes[:(N - 1) // B]:
            if h not in self.pages:
                break
            self.pages.move_to_end(h)
            hits += 1
        H = hits * B
        k, slot = self.snaps.best(hashes[:hits]) if hits else (0, None)
        start = k * B
        c = self.c
        c["turns"] += 1
        c["prompt_tokens"] += N
        c["hit_tokens"] += H
        if hits:
            c["warm_turns"] += 1
            c["restores" if slot is not None else "misses"] += 1
            if slot is None and session is not None and session not in self.sessions:
                c["first_turn_misses"] += 1
        if session is not None:
            self.sessions.add(session)
        c["exact_computed"] += N - start
        c["exact_recomputed_hit"] += H - start
        c["bounded_computed"] += N - max(H - self.W, 0)
        for b in sorted({H, (N // B) * B}):  # the boundaries the engine retains
            if start < b < N and b >= B:
                self.snaps.claim(hashes[b // B - 1])
        for h in hashes:  # the prompt's pages stay cached after the request (LRU)
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) > self.num_pages:
            self.pages.popitem(last=False)
            c["page_evictions"] += 1
        return start, H


class SimClient:
    """The replayer's client interface, answered by a SimServer."""

    kind = "tokens"

    def __init__(self, server: SimServer, s_per_token: float):
        self.server, self.s_per_token = server, s_per_token

    async def start(self) -> dict:
        return {"simulated": True}

    async def close(self):
        pass

    async def generate(self, req: WireRequest) -> Result:
        t0 = time.perf_counter()
        start, _ = self.server.admit(req.prompt_ids, req.session_id)
        n = len(req.prompt_ids)
        if self.s_per_token:
            await asyncio.sleep(self.s_per_token * (n - start))
        t1 = time.perf_counter()
        return Result(start=t0, end=t1, first=t1, n_stream_tokens=req.max_tokens, prompt_tokens=n,
                      completion_tokens=req.max_tokens, cached_tokens=start)


def simulate(traces, slots: int, a) -> dict:
    from bench.agentx.replay import ReplayConfig, replay

    server = SimServer(slots, a.num_pages)
    ts = a.time_scale
    cfg = ReplayConfig(concurrency=a.concurrency, duration=a.duration * ts, idle_cap=10.0 * ts,
                       tree_idle_cap=300.0 * ts, time_scale=ts, grace=60.0, seed=a.seed, tag=f"sim{slots}")
    client = SimClient(server, a.prefill_ms_per_token / 1000.0 * ts)
    recs, _ = asyncio.run(replay(client, traces, cfg))
    c = dict(server.c)
    warm = max(c["warm_turns"], 1)
    c.update(slots=slots, requests=len(recs), miss_rate=round(c["misses"] / warm, 4),
             exact_over_bounded_computed=round(c["exact_computed"] / max(c["bounded_computed"], 1), 3),
             recomputed_share_of_exact=round(c["exact_recomputed_hit"] / max(c["exact_computed"], 1), 4))
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.agentx.snapshot_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="sets the engine's default page count")
    ap.add_argument("--num-pages", type=int, default=0, help="0: 1 + 2 x max_num_seqs x pages per max_model_len")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--slots", default="16,32,64,128,256", help="snapshot slot counts (the default is 2 x seqs)")
    ap.add_argument("--duration", type=float, default=600.0, help="simulated profiling seconds")
    ap.add_argument("--time-scale", type=float, default=0.01, help="wall seconds per simulated second")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    ap.add_argument("--num-traces", type=int, default=64)
    ap.add_argument("--out-scale", type=float, default=0.2)
    ap.add_argument("--gen-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from bench.agentx import tracegen
    from bench.agentx.traces import parse_trace, usable
    from dsv41_jax.kv_format import pages_for

    if not a.num_pages:
        a.num_pages = 1 + 2 * a.max_num_seqs * pages_for(a.max_model_len)
    p = tracegen.auto_params(a.max_model_len, a.out_scale)
    traces, dropped = usable([parse_trace(t) for t in tracegen.TraceGen(p, a.gen_seed).traces(a.num_traces)],
                             a.max_model_len)
    rows = []
    for s in [int(x) for x in a.slots.split(",")]:
        rows.append(simulate(traces, s, a))
        print(rows[-1], file=sys.stderr, flush=True)
    res = {"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs, "num_pages": a.num_pages,
           "concurrency": a.concurrency, "duration_s": a.duration, "prefill_ms_per_token": a.prefill_ms_per_token,
           "traces": len(traces), "dropped": dropped, "rows": rows}
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, "python -m bench.agentx.snapshot_sim " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    print(f"\n{'slots':>5} {'warm turns':>10} {'misses':>7} {'1st turn':>8} {'miss %':>7} {'exact tokens':>13} "
          f"{'of which recomputed hits':>25} {'bounded tokens':>15} {'exact/bounded':>13}")
    for r in rows:
        print(f"{r['slots']:5d} {r['warm_turns']:10d} {r['misses']:7d} {r['first_turn_misses']:8d} "
              f"{100 * r['miss_rate']:6.1f}% "
              f"{r['exact_computed']:13,d} {r['exact_recomputed_hit']:25,d} {r['bounded_computed']:15,d} "
              f"{r['exact_over_bounded_computed']:13.2f}")
    return res


if __name__ == "__main__":
    main()
