"""Two CPU replicas behind an existing router (vllm-router from PyPI; issue 27), on loopback ports.

- the end-of-session hints (`POST /v1/sessions/{id}/end` with the session header, `X-Session-End: 1`) reach the
  replica holding the session through the router;
- with `X-Session-Id` and the router's `consistent_hash` policy every warm turn of a replayed multi-turn session
  set lands on the replica holding its prefix (cached_tokens > 0); with `round_robin` fewer do;
- a replica killed between turns: its sessions move to the other one and still complete (cold), nothing is lost;
- the router-facing metrics under load: vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc and the
  prefix-cache counters match what the engine did;
- graceful drain: after SIGTERM `/health` and new requests get 503 while the in-flight stream finishes, then the
  replica exits 0.
The replicas run `python -m serving.run` with the test shapes (tests.harness.small_server_args); the router tests
skip (saying why) when the vllm-router binary is absent.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import pytest

from serving.spawn import spawn_server
from tests.harness import small_server_args

pytestmark = pytest.mark.timeout(400)

# the console script of the interpreter's environment (a venv not on PATH), else one on PATH
ROUTER = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")
needs_router = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")
W = 8  # the tiny preset's sliding window: a warm turn's cached tokens are its hit minus W (bounded replay)


def request(url, path, body=None, headers=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text, status = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def prompt_tokens(url) -> float:
    return metric(request(url, "/metrics")[1], "vllm:prompt_tokens_total")


@pytest.fixture(scope="module")
def fleet():
    """Two replicas started in parallel (each on its own free port), stopped at the end."""
    out, errs = [None, None], []

    def start(i):
        try:
            out[i] = spawn_server(small_server_args(), grpc=False)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errs, errs
        yield out
    finally:
        for s in out:
            if s is not None:
                s.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def router(urls, policy):
    port = free_port()
    proc = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                             "--policy", policy, "--health-check-interval-secs", "1",
                             "--health-failure-threshold", "1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if request(url, "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Sessions:
    """n multi-turn sessions: turn t's prompt is the session's base text plus t 50-character appends."""

    def __init__(self, n, seed):
        rng = np.random.default_rng(seed)
        text = lambda k: "".join(chr(c) for c in rng.integers(97, 123, k))  # noqa: E731
        self.uid = rng.integers(1 << 30)
        self.base = [text(100) for _ in range(n)]
        self.ext = [[text(50) for _ in range(2)] for _ in range(n)]

    def turn(self, url, s, t, header=True, extra_headers=None):
        body = {"model": "tiny", "prompt": self.base[s] + "".join(self.ext[s][:t]), "max_tokens": 2,
                "temperature": 0.0, "ignore_eos": True}
        headers = {"X-Session-Id": f"r{self.uid}-{s}", **(extra_headers or {})} if header else {}
        status, out = request(url, "/v1/completions", body, headers)
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]


@needs_router
def test_session_affinity_beats_round_robin(fleet):
    urls = [s.http_url for s in fleet]
    n = 5  # odd: round robin over 2 replicas sends each session's next turn to the other replica
    warm = {}
    for policy, seed in (("consistent_hash", 1), ("round_robin", 2)):
        ss = Sessions(n, seed)
        with router(urls, policy) as url:
            cached = [[ss.turn(url, s, t) for s in range(n)] for t in range(3)]
        assert cached[0] == [0] * n  # cold first turns
        warm[policy] = sum(c > 0 for row in cached[1:] for c in row)
        if policy == "consistent_hash":  # every warm turn hit its prefix on the replica that served the last
            assert cached[1] == [64 - W] * n and cached[2] == [128 - W] * n
    assert warm["consistent_hash"] == 2 * n > warm["round_robin"]


def protected(urls) -> int:
    return sum(request(u, "/engine/stats")[1]["pages"]["session_protected"] for u in urls)


@needs_router
def test_end_of_session_hints_pass_through_the_router(fleet):
    urls = [s.http_url for s in fleet]
    ss = Sessions(3, 7)
    with router(urls, "consistent_hash") as url:
        p0 = protected(urls)
        ss.turn(url, 0, 2)  # 201 tokens: 3 full pages protected for the session
        assert protected(urls) == p0 + 3
        sid = f"r{ss.uid}-0"
        status, out = request(url, f"/v1/sessions/{sid}/end", {}, {"X-Session-Id": sid})
        assert status == 200 and out["released"] == 3
        assert protected(urls) == p0
        ss.turn(url, 1, 2, extra_headers={"X-Session-End": "1"})  # the in-band hint on the last turn
        assert protected(urls) == p0


@needs_router
def test_killed_replica_sessions_move_and_complete(fleet):
    urls = [s.http_url for s in fleet]
    n = 6
    ss = Sessions(n, 3)
    home = {}
    with router(urls, "consistent_hash") as url:
        for t in range(2):
            for s in range(n):
                before = [prompt_tokens(u) for u in urls]
                ss.turn(url, s, t)
                after = [prompt_tokens(u) for u in urls]
                served = [i for i in range(2) if after[i] > before[i]]
                assert len(served) == 1 and home.setdefault(s, served[0]) == served[0]  # sticky
        victim = max((0, 1), key=lambda i: sum(h == i for h in home.values()))
        fleet[victim].kill()
        time.sleep(3)  # the router's health check (1 s interval, 1 failure) drops the dead replica
        cached = {s: ss.turn(url, s, 2) for s in range(n)}  # every request completes (asserted in turn)
    for s, c in cached.items():
        assert (c == 0) if home[s] == victim else (c == 128 - W), (s, home[s], victim, c)
    assert any(home[s] == victim for s in range(n))


def _survivor(fleet):
    alive = [s for s in fleet if s.proc.poll() is None]
    assert alive
    return alive[0]


def test_router_facing_metrics_under_load(fleet):
    url = _survivor(fleet).http_url
    rng = np.random.default_rng(4)
    text = lambda k: "".join(chr(c) for c in rng.integers(97, 123, k))  # noqa: E731
    prefix = text(128)
    assert request(url, "/v1/completions", {"prompt": prefix, "max_tokens": 1})[0] == 200  # registers 2 pages
    m0 = request(url, "/metrics")[1]
    n, seqs = 12, 8  # max_num_seqs of the test shapes: 8 run, 4 wait
    results = []

    def one():
        results.append(request(url, "/v1/completions", {"prompt": prefix + text(20), "max_tokens": 100,
                                                        "ignore_eos": True, "temperature": 0.0}))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        m = request(url, "/metrics")[1]
        seen.append((metric(m, "vllm:num_requests_running"), metric(m, "vllm:num_requests_waiting"),
                     metric(m, "vllm:kv_cache_usage_perc")))
        time.sleep(0.02)
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == [200] * n
    full = [s for s in seen if s[:2] == (seqs, n - seqs)]
    assert full, f"never saw {seqs} running and {n - seqs} waiting: {seen[:20]}"
    usable = request(url, "/engine/stats")[1]["pages"]["total"]
    # 8 running requests of 149 prompt + decoded tokens hold 3-4 pages each, the 2 shared prefix pages once
    held = [round(u * usable) for *_, u in full]
    assert all(2 + seqs * 1 <= h <= 2 + seqs * 2 for h in held), (held, usable)
    assert all(0 <= r <= seqs and 0 <= w <= n for r, w, _ in seen)
    m1 = request(url, "/metrics")[1]
    d = lambda name: metric(m1, name) - metric(m0, name)  # noqa: E731
    assert (metric(m1, "vllm:num_requests_running"), metric(m1, "vllm:num_requests_waiting"),
            metric(m1, "vllm:kv_cache_usage_perc")) == (0, 0, 0)
    assert d("vllm:prefix_cache_queries_total") == n * 149  # BOS + 148 characters each
    assert d("vllm:prefix_cache_hits_total") == n * 128
    assert all(r[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 128 - W for r in results)


def test_sigterm_drains_with_health_503_then_exits(fleet):
    srv = _survivor(fleet)
    url = srv.http_url
    result, first = {}, threading.Event()

    def stream():
        body = {"prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk["choices"]:
                    result["reason"] = ch["finish_reason"] or result.get("reason")
                if chunk.get("usage"):
                    result["tokens"] = chunk["usage"]["completion_tokens"]
                first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    srv.proc.send_signal(15)  # SIGTERM
    time.sleep(0.2)  # the signal handler runs on the server's event loop
    health, late = set(), set()
    while t.is_alive():
        try:
            health.add(request(url, "/health", timeout=5)[0])
            late.add(request(url, "/v1/completions", {"prompt": "late", "max_tokens": 1}, timeout=5)[0])
        except OSError:
            break  # the listener closed: the engine had nothing left to run
        time.sleep(0.02)
    t.join(60)
    assert health == {503} and late == {503}, (health, late)  # the drain is visible, nothing new is admitted
    assert result == {"reason": "length", "tokens": 200}  # the in-flight request finished completely
    assert srv.proc.wait(60) == 0
