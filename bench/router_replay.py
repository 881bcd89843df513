"""The AgentX-style replay through an existing router against 2 replicas: sticky vs round-robin vs least-loaded.

    python -m bench.router_replay                      # CPU: 2 tiny replicas, 3 policies, a few minutes
    python -m bench.router_replay --model medium --server-args "..." --replica-env CUDA_VISIBLE_DEVICES=0,1

Two `python -m serving.run` replicas on loopback ports (with --replica-env K=V1,V2 each gets its own value, e.g.
one GPU each), then for each policy a `vllm-router` on them and one replay of the same generated traces
(bench/agentx: tracegen sessions, AgentX timing, InferenceX metrics) through it:

- sticky: `--policy consistent_hash` on the session header (the client sends X-Session-Id);
- round_robin: `--policy round_robin`;
- least_loaded: `--policy power_of_two` (over 2 replicas: the one with fewer in-flight requests).

Each policy's replay carries its own request-id tag and cache-bust marker, so it finds no prefix an earlier
policy left. Reported per policy: the server hit rate (prompt tokens served from the prefix cache, both
replicas' counters summed), TTFT p50 / p90, TPGS (total tokens per second per replica), requests. The result
file (bench/results/router_cpu.json by default) has device, date, commit and command (bench.common).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

from tqdm import tqdm

POLICIES = {"sticky": "consistent_hash", "round_robin": "round_robin", "least_loaded": "power_of_two"}
CPU_SERVER_ARGS = ("--model tiny --max-model-len 2048 --max-num-seqs 4 --max-num-batched-tokens 256 "
                   "--prefill-buckets 256 --decode-buckets 4 --no-enable-prompt-logprobs")


def router_binary() -> str | None:
    return shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(binary: str, urls: list[str], policy: str, timeout: float = 60.0):
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                             "--policy", policy, "--health-check-interval-secs", "2", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"vllm-router ({policy}) did not start")
        time.sleep(0.2)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def _scrape(urls: list[str]) -> dict:
    """Both replicas' Prometheus samples, summed per (name, labels)."""
    from bench.agentx.metrics import parse_prometheus
    from bench.agentx.run import _get_text

    out: dict = {}
    for u in urls:
        for k, v in parse_prometheus(await _get_text(u + "/metrics")).items():
            out[k] = out.get(k, 0.0) + v
    return out


def spawn_replicas(flags: list[str], env_split: tuple[str, list[str]] | None, timeout: float):
    from serving.spawn import spawn_server

    out, errs = [None, None], []

    def one(i):
        env = {env_split[0]: env_split[1][i]} if env_split else None
        try:
            out[i] = spawn_server(flags, grpc=False, timeout=timeout, env=env)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        for s in out:
            if s is not None:
                s.kill()
        raise RuntimeError(f"a replica did not start: {errs[0]}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.router_replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-args", default=CPU_SERVER_ARGS, help="python -m serving.run flags of both replicas")
    ap.add_argument("--replica-env", default=None, help="K=V1,V2: one value of K per replica (e.g. a GPU each)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {list(POLICIES)}")
    ap.add_argument("--concurrency", type=int, default=4, help="replay lanes (sessions in flight)")
    ap.add_argument("--duration", type=float, default=40.0, help="profiling seconds per policy")
    ap.add_argument("--num-traces", type=int, default=24)
    ap.add_argument("--gen-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="bench/results/router_cpu.json")
    a = ap.parse_args(argv)
    binary = router_binary()
    if binary is None:
        ap.error("vllm-router is not installed: pip install -e '.[bench]' (or pip install vllm-router)")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        ap.error(f"unknown policies {bad}; known: {list(POLICIES)}")
    env_split = None
    if a.replica_env:
        k, _, vals = a.replica_env.partition("=")
        env_split = (k, vals.split(","))
        if len(env_split[1]) != 2:
            ap.error("--replica-env needs two values, K=V1,V2")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process only talks HTTP

    from bench.agentx import tracegen
    from bench.agentx.clients import make_client
    from bench.agentx.metrics import headline, summarize
    from bench.agentx.replay import ReplayConfig, replay
    from bench.agentx.run import server_info
    from bench.agentx.traces import parse_trace, usable
    from bench.common import write_result

    t0 = time.monotonic()
    replicas = spawn_replicas(shlex.split(a.server_args), env_split, a.server_timeout)
    rows = {}
    try:
        urls = [r.http_url for r in replicas]
        max_len = server_info(urls[0])["max_model_len"]
        raw = tracegen.TraceGen(tracegen.auto_params(max_len), a.gen_seed).traces(a.num_traces)
        traces, dropped = usable([parse_trace(t) for t in raw], max_len)
        for i, name in enumerate(tqdm(policies, desc="policies")):
            proc, url = start_router(binary, urls, POLICIES[name])
            try:
                cfg = ReplayConfig(concurrency=a.concurrency, duration=a.duration, grace=30.0,
                                   max_warmup_s=max(2 * a.duration, 60.0), seed=a.seed,
                                   tag=f"rt{os.getpid()}p{i}")
                client = make_client("token", url=url, timeout=600.0)
                before: dict = {}

                async def go(client=client, cfg=cfg, before=before):
                    async def snap():
                        before.update(await _scrape(urls))

                    recs, info = await replay(client, traces, cfg, on_profiling_start=snap)
                    return recs, info, await _scrape(urls)

                records, info, after = asyncio.run(go())
            finally:
                stop(proc)
            summary = summarize(records, 2, before, after)
            rows[name] = {"router_policy": POLICIES[name], "headline": headline(summary), "metrics": summary,
                          "run": info}
    finally:
        for r in replicas:
            r.terminate()
    result = {"router": "vllm-router", "replicas": 2, "server_args": a.server_args, "concurrency": a.concurrency,
              "duration_s": a.duration, "traces": {"n": len(traces), "dropped_over_context": dropped,
                                                   "gen_seed": a.gen_seed}, "policies": rows,
              "wall_s": round(time.monotonic() - t0, 1)}
    write_result(a.out, result, "python -m bench.router_replay " + shlex.join(argv))
    print(f"{'policy':<14}{'requests':>9}{'server hit':>12}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'TPGS':>10}")
    for name, r in rows.items():
        h = r["headline"]
        f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
        print(f"{name:<14}{f(h['requests'], 'd'):>9}{f(h['server_hit'], '.3f'):>12}{f(h['ttft_p50'], '.3f'):>12}"
              f"{f(h['ttft_p90'], '.3f'):>12}{f(h['tpgs'], '.1f'):>10}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
