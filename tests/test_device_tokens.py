"""Async scheduling (serving/engine/device_tokens.py): the device-side Engram hash equals the host's, and an engine
that dispatches each step before collecting the previous one gives exactly the outputs of one that collects first."""
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from serving.engine import Engine, EngineArgs, SamplingParams
from serving.engine.config import SMALL_ENGINE_ARGS
from serving.engine.device_tokens import EngramFeedback
from serving.engine.structured import StructuredOutputs


@pytest.mark.parametrize("preset", ["tiny", "medium"])
@pytest.mark.parametrize("wrap", [False, True])
def test_device_engram_rows_equal_the_host_hash(preset, wrap):
    cfg = ModelConfig.preset(preset)
    h = EngramHasher(cfg)
    if wrap:  # multipliers whose products wrap around int64 (the model's are bounded so that they never do)
        h.mult = (h.mult << np.int64(40)) | np.int64(1)
    fb = EngramFeedback(h)
    rng = np.random.default_rng(1)
    B = 64
    tokens = rng.integers(0, cfg.vocab_size, B)
    hist = h.compress(rng.integers(0, cfg.vocab_size, (B, h.n - 1)))
    for b in range(0, B, 4):  # sequence starts: the oldest lookbacks missing
        hist[b, :b // 4 % h.n] = -1
    want = h.hash_ids(tokens[:, None], hist)[:, 0]  # [B, E, n_cols]
    hi, lo = fb.known(hist)
    got = np.asarray(fb.ids(jnp.asarray(tokens, jnp.int32), jnp.asarray(hi), jnp.asarray(lo)))
    np.testing.assert_array_equal(got, want)
    p_neg = np.asarray(fb.p_hi) >> 31
    assert p_neg.max() == int(wrap)  # with wrapping, negative int64 values: the floor-modulo branch


def test_device_hash_rejects_primes_beyond_its_range():
    cfg = ModelConfig.preset("tiny").replace(engram_vocab_size=1 << 24)
    with pytest.raises(ValueError, match="primes"):
        EngramFeedback(EngramHasher(cfg))


def _serve(engine, jobs):
    """Requests arriving over the first steps (prompt, sampling, arrival step); outputs by request."""
    out = {rid: {"ids": [], "lps": [], "reason": None} for rid, *_ in jobs}
    step = 0
    while step <= max(j[3] for j in jobs) or engine.has_unfinished():
        for rid, prompt, sp, at in jobs:
            if at == step:
                engine.add_request(rid, prompt, sp)
        for o in engine.step():
            r = out[o.request_id]
            r["ids"] += o.new_token_ids
            r["lps"] += [d[t] for d, t in zip(o.new_logprobs or [], o.new_token_ids)]
            r["reason"] = o.finish_reason or r["reason"]
        step += 1
    return out


@pytest.fixture(scope="module")
def engines(tiny, tiny_params):
    kw = dict(SMALL_ENGINE_ARGS)
    a = Engine(tiny, EngineArgs(**kw, async_scheduling=True), params=tiny_params, progress=False)
    s = Engine(tiny, EngineArgs(**kw, async_scheduling=False), params=tiny_params, progress=False)
    return a, s


def test_async_engine_equals_the_collecting_engine(engines):
    eng_async, eng_sync = engines
    assert eng_async.device_tokens is not None and eng_sync.device_tokens is None
    rng = np.random.default_rng(7)
    V = eng_async.cfg.vocab_size
    greedy = dict(temperature=0.0, logprobs=1)
    jobs = []
    for i in range(7):
        prompt = rng.integers(3, V, int(rng.integers(5, 140))).tolist()
        sp = SamplingParams(max_tokens=int(rng.integers(1, 24)), ignore_eos=True, **greedy) if i % 2 else \
            SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.8, top_p=0.9, seed=i, logprobs=1,
                           ignore_eos=True)
        jobs.append((f"r{i}", prompt, sp, int(rng.integers(0, 6))))
    # a stop token found while the next step already runs: the row computed after it is dropped
    probe = _serve(eng_sync, [("p", jobs[1][1], SamplingParams(max_tokens=12, ignore_eos=True, **greedy), 0)])
    stop_at = probe["p"]["ids"][5]
    jobs.append(("stop", jobs[1][1], SamplingParams(max_tokens=12, stop_token_ids=[stop_at], **greedy), 2))
    patched = []
    orig = eng_async.device_tokens.patch

    def spy(inp, rows, hist=None):
        patched.append(len(rows))
        return orig(inp, rows, hist)

    eng_async.device_tokens.patch = spy
    try:
        got = _serve(eng_async, jobs)
    finally:
        del eng_async.device_tokens.patch
    want = _serve(eng_sync, jobs)
    for rid, *_ in jobs:
        assert got[rid]["ids"] == want[rid]["ids"], rid
        np.testing.assert_allclose(got[rid]["lps"], want[rid]["lps"], rtol=0, atol=1e-6)
        assert got[rid]["reason"] == want[rid]["reason"]
    assert got["stop"]["ids"][-1] == stop_at and got["stop"]["reason"] == "stop"
    assert len(got["stop"]["ids"]) <= 6
    assert sum(patched) > 20  # most decode rows took their token from the device
    for e in engines:  # every page and slot came back
        assert not e.has_unfinished() and len(e.scheduler.free_slots) == e.args.max_num_seqs


def test_structured_requests_make_the_step_collect_first(engines):
    eng_async, _ = engines
    calls = []
    orig = eng_async.device_tokens.patch
    eng_async.device_tokens.patch = lambda inp, rows, hist=None: calls.append(rows) or orig(inp, rows, hist)
    try:
        eng_async.add_request("g", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0,
                                                           structured=StructuredOutputs(regex="[ab]{3,6}")))
        while eng_async.has_unfinished():
            assert not eng_async._async_step() or not eng_async.scheduler.running
            eng_async.step()
    finally:
        del eng_async.device_tokens.patch
    assert calls == []


class _Failing:
    """A call's outputs whose copy fails: the failed call itself (it also loses the pools), or a call dispatched
    after it on those pools."""

    def __init__(self, pending, runner, loses_pools):
        self.packed, self.runner, self.loses_pools = pending.packed, runner, loses_pools

    def get(self):
        if self.loses_pools:
            for v in self.runner.pools.values():
                v.delete()
            raise RuntimeError("injected asynchronous failure")
        raise RuntimeError("ran on the lost pools")


def test_an_asynchronous_failure_drops_the_step_dispatched_after_it(engines):
    """The failure of step j-1 surfaces while step j (dispatched on the same pools) is in flight: the failed
    request errors, step j is dropped, and the innocent decoding request is recomputed and finishes as in a
    clean run."""
    eng, _ = engines
    rng = np.random.default_rng(3)
    pa, pc = (rng.integers(3, eng.cfg.vocab_size, n).tolist() for n in (40, 60))
    greedy = dict(temperature=0.0, ignore_eos=True)
    clean = _serve(eng, [("clean", pa, SamplingParams(max_tokens=10, **greedy), 0)])["clean"]["ids"]
    runner = eng.runner
    state = {"armed": False, "failures": 0}

    def run(key, inp):
        pending = type(runner).run(runner, key, inp)
        if pending is None:
            return pending
        if key.kind == "prefill" and not state["armed"] and not state["failures"]:
            state["armed"] = True
            return _Failing(pending, runner, True)
        return _Failing(pending, runner, False) if state["armed"] else pending

    def on_fail(reqs, e):
        state["armed"] = False
        state["failures"] += 1
        return type(eng)._fail(eng, reqs, e)

    outs = {}

    def cb(o):
        outs.setdefault(o.request_id, []).append(o)

    eng.add_request("a", pa, SamplingParams(max_tokens=10, **greedy), callback=cb)
    while not outs.get("a"):
        eng.step()
    runner.run, eng._fail = run, on_fail
    try:
        eng.add_request("c", pc, SamplingParams(max_tokens=4, **greedy), callback=cb)
        while eng.has_unfinished():
            eng.step()
    finally:
        del runner.run, eng._fail
    assert state["failures"] == 1
    assert outs["c"][-1].finished and "injected asynchronous failure" in outs["c"][-1].error
    assert outs["a"][-1].error is None and outs["a"][-1].finish_reason == "length"
    assert [t for o in outs["a"] for t in o.new_token_ids] == clean
    assert all(r.in_flight == 0 for r in eng.scheduler.running)
    eng.pool.check()
