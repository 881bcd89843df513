"""Session hints (issue 27): a session's cached prefix outlives anonymous pool pressure for --session-ttl-s,
is evicted last, expires, is released early by the end-of-session hint (X-Session-End, end_session, POST
/v1/sessions/{id}/end, gRPC end_session), and never crosses cache_salt."""

import json
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from serving.engine.block_hash import BLOCK
from serving.engine.page_pool import PagePool
from serving.engine.snapshots import SnapshotIndex
from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from tests.harness import shared_test_server, wait_idle

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------------- page pool
def test_pool_session_pages_are_evicted_last_and_expire():
    pool = PagePool(10, session_ttl=10.0)
    s = pool.allocate(3, 0.0)
    a = pool.allocate(3, 0.0)
    for i, p in enumerate(s):
        pool.register(p, b"s%d" % i)
    for i, p in enumerate(a):
        pool.register(p, b"a%d" % i)
    pool.release(s, "S", 1.0)  # released first: plain LRU would evict it first
    pool.release(a, None, 2.0)
    pool.check()
    assert pool.num_protected() == 3
    got = pool.allocate(6, 5.0)  # 3 never-used pages, then the anonymous cached ones, not the session's
    assert set(got) & set(s) == set() and set(a) <= set(got)
    assert pool.lookup([b"s0", b"s1", b"s2"]) == s
    for i, p in enumerate(got):
        pool.register(p, b"g%d" % i)
    pool.release(got, None, 5.5)
    pool.check()
    assert pool.allocate(1, 6.0)[0] in got  # still protected: an anonymous cached page goes
    assert pool.allocate(1, 20.0)[0] in s  # after the TTL: the head of the session queue goes first
    pool.check()


def test_pool_end_session_makes_its_pages_first_victims():
    pool = PagePool(8, session_ttl=100.0)
    s, t, a = pool.allocate(2, 0.0), pool.allocate(2, 0.0), pool.allocate(2, 0.0)
    for tag, pages in ((b"s", s), (b"t", t), (b"a", a)):
        for i, p in enumerate(pages):
            pool.register(p, tag + bytes([i]))
    pool.release(a, None, 1.0)  # anonymous, older
    pool.release(s, "S", 2.0)
    pool.release(t, "T", 3.0)
    assert pool.end_session("S") == 2 and pool.end_session("nobody") == 0
    pool.check()
    # the never-used page, then the ended session's pages in their release order (tail first), before `a`
    assert pool.allocate(4, 4.0) == [7, s[1], s[0], a[1]]
    assert pool.lookup([b"t\x00", b"t\x01"]) == t  # the other session keeps its protection
    pool.check()


def test_snapshot_index_protects_session_snapshots():
    idx = SnapshotIndex(2, session_ttl=10.0)
    sa = idx.claim(b"A", "S", 0.0)
    sb = idx.claim(b"B", None, 1.0)
    assert idx.claim(b"C", None, 2.0) == sb  # LRU would take A's slot; the session's snapshot stays
    assert idx.best([b"A"]) == (1, sa)
    idx.end_session("S")
    idx.claim(b"C", None, 3.0)  # refresh C: A is the LRU entry now
    assert idx.claim(b"D", None, 4.0) == sa
    idx2 = SnapshotIndex(1, session_ttl=1.0)
    s0 = idx2.claim(b"A", "S", 0.0)
    assert idx2.claim(b"B", None, 5.0) == s0  # expired protection: an ordinary LRU victim


# ---------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server():
    return shared_test_server()


def post(server, path, body, headers=None):
    req = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def turn(server, ids, session=None, salt=None, headers=None, **body):
    b = {"prompt": ids, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True, **body}
    if session is not None:
        b["session_id"] = session
    if salt is not None:
        b["cache_salt"] = salt
    status, out = post(server, "/v1/completions", b, headers)
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def on_engine(server, fn):
    return server.server.client.loop.call(fn).result(30)


def pressure(server, rng, rounds=2):
    """Anonymous prompts allocating twice the whole pool: every unprotected cached page is evicted."""
    pages = on_engine(server, lambda e: e.pool.num_pages)
    n = pages // 4 + 1
    for _ in range(rounds):
        prompts = [rng.integers(0, 256, 3 * BLOCK).tolist() for _ in range(n)]
        status, out = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "ignore_eos": True})
        assert status == 200, out


def test_session_retention_end_hints_ttl_and_salt(server):
    rng = np.random.default_rng(27)
    W = on_engine(server, lambda e: e.cfg.window_size)
    uid = rng.integers(1 << 30)
    P = {k: rng.integers(0, 256, 3 * BLOCK).tolist() for k in "KXHEBT"}
    sid = {k: f"s{uid}-{k}" for k in P}
    turn(server, P["K"], sid["K"])  # kept: a session, no end hint
    turn(server, P["X"])  # anonymous
    turn(server, P["H"], sid["H"], headers={"X-Session-End": "1"})  # ended by the header on its last turn
    turn(server, P["E"], sid["E"], end_session=True)  # ended by the body field
    turn(server, P["B"], sid["B"])
    status, out = post(server, f"/v1/sessions/{sid['B']}/end", {})  # ended after the fact
    assert status == 200 and out["released"] == 3, out
    pool = lambda e: e.pool  # noqa: E731
    ttl = on_engine(server, lambda e: pool(e).session_ttl)
    on_engine(server, lambda e: setattr(pool(e), "session_ttl", 0.5))
    try:
        turn(server, P["T"], sid["T"])  # protected for 0.5 s only
    finally:
        on_engine(server, lambda e: setattr(pool(e), "session_ttl", ttl))
    live = on_engine(server, lambda e: {s for s in sid.values() if s in pool(e).session_pages})
    assert live == {sid["K"], sid["T"]}
    time.sleep(0.6)
    pressure(server, rng)
    wait_idle(server)
    more = rng.integers(0, 256, 32).tolist()
    cached = {k: turn(server, P[k] + more, sid[k] if k != "X" else None) for k in "XHEBT"}
    assert cached == dict.fromkeys("XHEBT", 0)  # evicted: anonymous, ended three ways, expired
    assert turn(server, P["K"] + more, sid["K"], salt="other-tenant") == 0  # the salt isolates
    assert turn(server, P["K"] + more, sid["K"]) == 3 * BLOCK - W  # kept through the pressure
    on_engine(server, lambda e: e.end_session(sid["K"]))


def test_grpc_session_id_and_end_session(server):
    rng = np.random.default_rng(28)
    s = f"g{rng.integers(1 << 30)}"
    ids = rng.integers(0, 256, 2 * BLOCK).tolist()
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        sp = pb.SamplingParams(max_tokens=1, ignore_eos=True)
        for end in (False, True):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=sp, session_id=s,
                                     end_session=end)
            assert list(stub.Generate(req, timeout=60))[-1].WhichOneof("response") == "complete"
            held = on_engine(server, lambda e: len(e.pool.session_pages.get(s, ())))
            assert held == (0 if end else 2)


def test_bad_end_hint_is_a_clear_400(server):
    status, out = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1},
                       {"X-Session-End": "maybe", "X-Session-Id": "z"})
    assert status == 400 and "X-Session-End" in out["error"]["message"]
