"""`python -m bench.agentx`: the AgentX-style A/B, day-0 baseline vs optimised server, over a concurrency sweep.

    # the GPU sweep (bench/agentx/README.md has the H200 commands): one or two sides per command, then re-plot
    python -m bench.agentx --model medium --server-args "--max-model-len 32768 --max-num-seqs 16 \
        --max-num-batched-tokens 2048 --prefill-buckets 2048 --decode-buckets 16 --no-enable-prompt-logprobs" \
        --sides optimised,exact --concurrency 2,4,8 --duration 30 --budget 565 --out-dir $OUT --tag h200
    python -m bench.agentx.plot bench/results/agentx_h200_*_c*.json --out bench/results/agentx_h200_pareto.png \
        --summary bench/results/agentx_h200_summary.json
    # a CPU smoke (the default model, 2 points per side, seconds per point):
    python -m bench.agentx --cpu-smoke
    # against a running server (one side, named by --label):
    python -m bench.agentx --url http://127.0.0.1:8000 --grpc 127.0.0.1:50051 --label mine --concurrency 4

The sides are defined in bench/agentx/sides.py: the day-0 baseline (`DAY0`: a straightforward compiled port:
exact SWA snapshots, XLA kernels, each step collected before the next, ...; `day0-eager` adds eager execution)
against optimised (the server's defaults). Both sides get the same `--model` /
`--server-args`.

Traces: `--traces FILE` (Weka .jsonl / .json, real or generated), else `--num-traces` generated ones
(`tracegen`), sized from the server's max_model_len unless `--scale` is given (`tracegen.auto_params`), with
outputs x `--out-scale`. Traces whose peak ISL + OSL exceeds the server's context are dropped whole.

Budget: `--budget` seconds of wall clock for everything (server starts included) is split evenly between the
sides still to run; a point is skipped when its estimate (duration + last warm-up + grace) does not fit the
side's share. Every finished point is written at once (one JSON per run, `bench.common.write_result`), so a
killed command keeps what it measured. Last: the Pareto PNG, a summary JSON and a short table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from bench.agentx.metrics import slo_targets
from bench.agentx.sides import DAY0, SIDES, server_flags

log = logging.getLogger("bench.agentx")


# ---------------------------------------------------------------------------------------------- helpers
async def _get_text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.get(url) as r:
            return await r.text()


def scrape(url: str) -> dict:
    from bench.agentx.metrics import parse_prometheus

    return parse_prometheus(asyncio.run(_get_text(url.rstrip("/") + "/metrics")))


def wait_idle(url: str, timeout: float = 120.0) -> bool:
    from bench.agentx.metrics import metric_sum

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(url)
        busy = (metric_sum(m, "vllm:num_requests_running") or 0) + (metric_sum(m, "vllm:num_requests_waiting") or 0)
        if busy == 0:
            return True
        time.sleep(0.5)
    return False


def server_info(url: str) -> dict:
    card = json.loads(asyncio.run(_get_text(url.rstrip("/") + "/v1/models")))["data"][0]
    return {"model": card["id"], "max_model_len": card.get("max_model_len")}


def build_traces(a, max_model_len: int | None):
    from bench.agentx import tracegen
    from bench.agentx.traces import load_traces, parse_trace, usable

    info: dict = {}
    if a.traces:
        raw = load_traces(a.traces)
        info["source"] = a.traces
    else:
        if a.scale is not None:
            p = tracegen.GenParams().scaled(a.scale, a.out_scale,
                                            int(max_model_len * 0.97) - 64 if max_model_len else None)
        else:
            p = tracegen.auto_params(max_model_len or 8192, a.out_scale)
        if a.calibrate:
            p, _ = tracegen.calibrate(p, a.gen_seed, n_traces=200)
        raw = tracegen.TraceGen(p, a.gen_seed).traces(a.num_traces)
        info.update(source="tracegen", seed=a.gen_seed, scale=p.scale, out_scale=p.out_scale, ctx_max=p.ctx_max,
                    result_scale=p.result_scale, calibration=tracegen.calibration(raw, p)["metrics"])
    traces, dropped = usable([parse_trace(t) for t in raw], max_model_len)
    info.update(n_traces=len(traces), dropped_over_context=dropped,
                n_requests=sum(t.n_requests for t in traces))
    return traces, info


def replay_config(a, concurrency: int, point: int):
    """The replay settings of one point. Its seed (which trees the lanes draw, and their start turns t*) depends
    on --seed and N only, not on the point's place in the sweep: the same N replays the same workload on every
    side and in every command, so points of an A/B made in separate commands are paired."""
    from bench.agentx.replay import ReplayConfig

    return ReplayConfig(concurrency=concurrency, duration=a.duration, warmup_turns=a.warmup_turns,
                        start_range=(a.start_min, a.start_max), idle_cap=a.idle_cap, tree_idle_cap=a.tree_idle_cap,
                        time_scale=a.time_scale, grace=a.grace, max_warmup_s=a.max_warmup,
                        seed=a.seed + concurrency, tag=f"ax{os.getpid()}p{point}")


def run_point(a, side: str, url: str, grpc_target: str | None, traces, concurrency: int, point: int):
    from bench.agentx.clients import make_client
    from bench.agentx.metrics import headline, parse_prometheus, summarize
    from bench.agentx.replay import replay

    cfg = replay_config(a, concurrency, point)
    client = make_client(a.client, url=url, grpc_target=grpc_target, timeout=a.request_timeout)
    before: dict = {}

    async def go():
        async def snap():
            before.update(parse_prometheus(await _get_text(url.rstrip("/") + "/metrics")))

        recs, info = await replay(client, traces, cfg, on_profiling_start=snap)
        after = parse_prometheus(await _get_text(url.rstrip("/") + "/metrics"))
        return recs, info, after

    records, info, after = asyncio.run(go())
    summary = summarize(records, a.num_gpus, before, after)
    return records, {"side": side, "concurrency": concurrency, "client": a.client, "duration_target_s": a.duration,
                     "replay": {k: v for k, v in vars(cfg).items() if k != "tag"}, "run": info,
                     "headline": headline(summary), "metrics": summary}


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(rows: list[dict]):
    print(f"{'side':>10} {'N':>4} {'reqs':>5} {'TPGS':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'intvty p90':>10} "
          f"{'e2e-norm p90':>12} {'hit srv':>8} {'hit theo':>8} {'err':>6} {'ovf':>6}  (hits: token fractions)")
    for r in rows:
        print(f"{r['side']:>10} {r['concurrency']:>4} {_fmt(r.get('requests'), 'd'):>5} "
              f"{_fmt(r.get('tpgs'), '.1f'):>9} {_fmt(r.get('ttft_p50'), '.3f'):>9} "
              f"{_fmt(r.get('ttft_p90'), '.3f'):>9} "
              f"{_fmt(r.get('intvty_p90'), '.2f'):>10} {_fmt(r.get('e2e_norm_intvty_p90'), '.2f'):>12} "
              f"{_fmt(r.get('server_hit'), '.3f'):>8} {_fmt(r.get('theoretical_hit_tokens'), '.3f'):>8} "
              f"{_fmt(r.get('error_rate'), '.3f'):>6} {_fmt(r.get('overflow_rate'), '.3f'):>6}")


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.agentx", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("servers")
    g.add_argument("--sides", default="day0,optimised", help=f"comma list of {sorted(SIDES)}")
    g.add_argument("--model", default=None, help="passed to both servers (None: the server default)")
    g.add_argument("--server-args", default="", help="extra python -m serving.run flags for both servers")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to start")
    g.add_argument("--url", default=None, help="replay against this running server instead (one side)")
    g.add_argument("--grpc", default=None, help="its gRPC target host:port (for --client grpc)")
    g.add_argument("--label", default="server", help="the side's name with --url")
    g = ap.add_argument_group("sweep")
    g.add_argument("--concurrency", default="1,2,4,8", help="comma list of lane counts")
    g.add_argument("--duration", type=float, default=120.0, help="profiling seconds per point")
    g.add_argument("--budget", type=float, default=3600.0, help="wall-clock seconds for the whole command")
    g.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests may finish after a point")
    g.add_argument("--max-warmup", type=float, default=None,
                   help="bound on a point's warm-up phase, s (default: max(2 x duration, 120); the first point's "
                        "warm-up also pays the eager server's op compilations)")
    g.add_argument("--client", default="token", choices=("token", "chat", "grpc"))
    g.add_argument("--request-timeout", type=float, default=1800.0)
    g.add_argument("--num-gpus", type=int, default=1, help="TPGS divisor")
    g = ap.add_argument_group("replay")
    g.add_argument("--warmup-turns", type=int, default=1)
    g.add_argument("--start-min", type=float, default=0.25)
    g.add_argument("--start-max", type=float, default=0.75)
    g.add_argument("--idle-cap", type=float, default=10.0, help="whole-system idle cap, seconds")
    g.add_argument("--tree-idle-cap", type=float, default=300.0, help="per-tree idle cap, seconds")
    g.add_argument("--time-scale", type=float, default=1.0, help="think times x this")
    g.add_argument("--seed", type=int, default=42)
    g = ap.add_argument_group("traces")
    g.add_argument("--traces", default=None, help="a Weka .jsonl / .json file (else generated)")
    g.add_argument("--num-traces", type=int, default=64)
    g.add_argument("--scale", type=float, default=None, help="context scale (None: from the server's context)")
    g.add_argument("--out-scale", type=float, default=0.2, help="output-length scale of generated traces")
    g.add_argument("--gen-seed", type=int, default=0)
    g.add_argument("--calibrate", action="store_true", help="calibrate the generator's ISL median first")
    g = ap.add_argument_group("output")
    g.add_argument("--out-dir", default="bench/results")
    g.add_argument("--tag", default=None, help="file name tag (default: cpu with --cpu-smoke, else run)")
    g.add_argument("--records", action="store_true", help="also write every request record (.records.jsonl)")
    g.add_argument("--server-log", action="store_true", help="also write each spawned server's output (.log)")
    g.add_argument("--cpu-smoke", action="store_true",
                   help="small sizes: concurrency 1,2, 10 s points, 16 traces, budget 900 s (flags given win)")
    return ap


SMOKE = {"concurrency": "1,2", "duration": 10.0, "grace": 20.0, "budget": 900.0, "num_traces": 16,
         "max_warmup": 120.0}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cpu_smoke:  # smoke sizes for every option not given explicitly
        given = {x.split("=")[0] for x in argv if x.startswith("--")}
        for k, v in SMOKE.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    a.max_warmup = max(2 * a.duration, 120.0) if a.max_warmup is None else a.max_warmup
    tag = a.tag or ("cpu" if a.cpu_smoke else "run")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    # this process only talks HTTP/gRPC; if it touches JAX (device name in the result files), it must not grab
    # the accelerator's memory from the server
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from bench.agentx.plot import plot_pareto
    from bench.common import write_result

    t0 = time.monotonic()
    deadline = t0 + a.budget
    sweep = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if a.url:
        sides = [(a.label, None)]
    else:
        names = [s.strip() for s in a.sides.split(",") if s.strip()]
        unknown = [s for s in names if s not in SIDES]
        if unknown:
            ap.error(f"unknown side(s) {unknown}; known: {sorted(SIDES)}")
        sides = [(s, SIDES[s]) for s in names]
    out_dir = Path(a.out_dir)
    command = "python -m bench.agentx " + shlex.join(argv)
    traces, trace_info = None, None
    rows, skipped, failures = [], [], []
    for si, (side, overrides) in enumerate(sides):
        side_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(sides) - si)
        server = None
        flags = None
        try:
            if a.url:
                url, grpc_target = a.url, a.grpc
            else:
                from serving.spawn import spawn_server

                flags = (["--model", a.model] if a.model else []) + shlex.split(a.server_args) + server_flags(overrides)
                log.info("starting the %s server: python -m serving.run %s", side, shlex.join(flags))
                t_s = time.monotonic()
                server = spawn_server(flags, timeout=max(30.0, min(a.server_timeout, side_deadline - time.monotonic())),
                                      env={"XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("DSV41_SERVER_PREALLOCATE",
                                                                                          "true")})
                url, grpc_target = server.http_url, server.grpc_target
                log.info("%s server ready in %.0f s", side, time.monotonic() - t_s)
            info = server_info(url)
            if traces is None:
                traces, trace_info = build_traces(a, info["max_model_len"])
                log.info("traces: %s", {k: v for k, v in trace_info.items() if k != "calibration"})
            last_warm = None
            for point, conc in enumerate(sweep):
                est = a.duration + (last_warm or 0.0) + (a.grace if point else 0.0)
                if time.monotonic() + est > side_deadline:
                    skipped.append({"side": side, "concurrency": conc, "why": "budget"})
                    log.info("skipping %s N=%d: not enough budget left", side, conc)
                    continue
                log.info("%s: N=%d for %.0f s", side, conc, a.duration)
                records, res = run_point(a, side, url, grpc_target, traces, conc, point)
                last_warm = res["run"]["warmup_s"]
                res.update(server_flags=flags, url=None if server else url, traces=trace_info)
                name = f"agentx_{tag}_{side}_c{conc}"
                write_result(out_dir / f"{name}.json", res, command)
                if a.records:
                    with open(out_dir / f"{name}.records.jsonl", "w") as f:
                        for r in records:
                            f.write(json.dumps(r.as_dict()) + "\n")
                rows.append(dict(res["headline"], side=side, concurrency=conc))
                print_table(rows[-1:])
                wait_idle(url)
        except Exception as e:  # noqa: BLE001 - one side failing must not lose the other
            log.exception("side %s failed", side)
            failures.append({"side": side, "error": f"{type(e).__name__}: {e}",
                             "server_output": server.output()[-4000:] if server else None})
        finally:
            if server is not None:
                server.terminate()
                if a.server_log:  # the server's own output (start-up, compilation, per-request lines)
                    out_dir.mkdir(parents=True, exist_ok=True)
                    (out_dir / f"agentx_{tag}_{side}_server.log").write_text(server.output()[-2_000_000:])
    summary = {"rows": rows, "skipped": skipped, "failures": failures, "traces": trace_info,
               "slo_50": slo_targets(rows), "day0_flags": server_flags(DAY0),
               "wall_s": round(time.monotonic() - t0, 1)}
    png = plot_pareto(rows, out_dir / f"agentx_{tag}_pareto.png", f"AgentX-style sweep ({tag})") if rows else None
    summary["png"] = png
    write_result(out_dir / f"agentx_{tag}_summary.json", summary, command)
    for f in failures:
        print(f"FAILED {f['side']}: {f['error']}")
    for key, v in summary["slo_50"].items():
        print(f"best TPGS at {key} >= 50: {v['best_tpgs']} (optimised / day0: {v['optimised_over_day0']})")
    if skipped:
        print("skipped (budget): " + ", ".join(f"{s['side']} N={s['concurrency']}" for s in skipped))
    print_table(rows)
    return 1 if failures and not rows else 0
