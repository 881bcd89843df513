"""Server start-up: a cold start (empty persistent compilation cache) and a restart on that cache, to first token.

    python -m bench.server_startup --model medium --server-args "--weight-format fp8" --threads 1,8 \
        --out /tmp/server_startup.json

For each `--threads` value (the server's `--compile-threads`) the script starts
`python -m serving.run --model M SERVER_ARGS` on a fresh cache directory (cold), sends one request, stops it, then
starts it again on the same directory (`--restarts` times: the restart an operator does after a crash or an
upgrade that kept the cache) and sends the request again. Per start it records:
- `ready_s`: from the process start to the server listening (imports, weights, the programs, the sockets);
- `compile_s` and `programs`: the engine's own "engine ready: N programs in S s" line (tracing, lowering, XLA's
  compilation or the cache reads);
- `first_request_s`: one greedy completion of `--max-tokens` tokens after ready (that it serves), its tokens/s
  and a hash of its tokens with their logprobs: every start of one model must give the same hash (the programs
  loaded from the program cache compute what the compiled ones did, bit for bit).
The table printed last has one row per start. The result file keeps every server's last output lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import sys
import tempfile
import time
import urllib.request

from bench.common import write_result
from serving.spawn import spawn_server

_READY_LINE = re.compile(r"engine ready: (\d+) programs in ([\d.]+) s(?:.*?(\d+) loaded from the program cache)?")


def one_request(url: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": "def main():\n", "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0.0, "logprobs": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    dt = time.perf_counter() - t0
    n = out["usage"]["completion_tokens"]
    # the tokens and their logprobs (a random-weight model's text can be empty: bytes that decode to nothing)
    seen = json.dumps(out["choices"][0]["logprobs"], sort_keys=True)
    return {"first_request_s": round(dt, 3), "completion_tokens": n, "tokens_per_s": round(n / dt, 1),
            "logprobs_sha256": hashlib.sha256(seen.encode()).hexdigest()[:16]}


def start(model: str, server_args: list[str], cache: str, threads: int, max_tokens: int, timeout: float) -> dict:
    args = ["--model", model, *server_args, "--compilation-cache-dir", cache, "--compile-threads", str(threads)]
    t0 = time.perf_counter()
    srv = spawn_server(args, timeout=timeout, grpc=False)
    ready = time.perf_counter() - t0
    try:
        m = _READY_LINE.search(srv.output())
        row = {"threads": threads, "ready_s": round(ready, 1), "programs": int(m.group(1)) if m else None,
               "compile_s": float(m.group(2)) if m else None,
               "loaded": int(m.group(3)) if m and m.group(3) else 0}
        row.update(one_request(srv.http_url, max_tokens))
    finally:
        srv.terminate()
    row["log_tail"] = srv.output().splitlines()[-40:]
    return row


def save(a, argv, rows, skipped):
    if a.out:
        result = {"model": a.model, "server_args": a.server_args, "rows": rows, "skipped_threads": skipped}
        words = sys.argv[1:] if argv is None else argv
        write_result(a.out, result, "python -m bench.server_startup " + " ".join(map(shlex.quote, words)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="medium")
    ap.add_argument("--server-args", default="", help="more `python -m serving.run` flags, one string")
    ap.add_argument("--threads", default="1", help="comma-separated --compile-threads values, one cold start each")
    ap.add_argument("--restarts", type=int, default=1, help="warm restarts after each cold start")
    ap.add_argument("--cold-args", default="", help="flags for the cold starts only (e.g. --no-program-cache: "
                    "the restarts then store what JAX's own cache loads)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds: start no new cold start after this (0: none)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t_begin = time.perf_counter()
    rows, skipped = [], []
    for threads in [int(t) for t in a.threads.split(",")]:
        if a.budget and time.perf_counter() - t_begin > a.budget:
            skipped.append(threads)
            continue
        with tempfile.TemporaryDirectory(prefix="startup_cache_") as cache:
            for i in range(1 + a.restarts):
                extra = shlex.split(a.cold_args) if i == 0 else []
                row = start(a.model, shlex.split(a.server_args) + extra, cache, threads, a.max_tokens, a.timeout)
                row["cache"] = "cold" if i == 0 else "warm"
                rows.append(row)
                print(f"threads {threads} {row['cache']}: ready {row['ready_s']} s, compile {row['compile_s']} s, "
                      f"first request {row['first_request_s']} s", flush=True)
                save(a, argv, rows, skipped)  # after every start: a run cut short keeps what it measured
    save(a, argv, rows, skipped)
    print("| threads | cache | ready s | programs (loaded) | compile s | first request s | tokens/s | logprobs hash |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['cache']} | {r['ready_s']} | {r['programs']} ({r['loaded']}) | "
              f"{r['compile_s']} | {r['first_request_s']} | {r['tokens_per_s']} | {r['logprobs_sha256'][:8]} |")


if __name__ == "__main__":
    main()
