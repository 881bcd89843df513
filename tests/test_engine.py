"""The engine (paged, batched, bucketed, compiled) against the model's own CED reference paths."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import paths
from dsv41_jax.engram_hash import EngramHasher
from serving.engine import Engine, EngineArgs, SamplingParams
from serving.engine.config import SMALL_ENGINE_ARGS
from serving.engine.engine import QueueFull
from tests.harness import EXACT_ENGINE_ARGS

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def eng(tiny, tiny_params):
    """bf16 + every qdq point on: FP4 pages, FP8 rings (the production formats); SWA bounded replay. The API
    test server's shapes (SMALL_ENGINE_ARGS: 128-token chunks, 8 sequences): the same programs, so whichever
    test compiles them first fills the persistent compilation cache for the others."""
    return Engine(tiny, EngineArgs(**SMALL_ENGINE_ARGS), params=tiny_params, progress=False)


@pytest.fixture(scope="module")
def eng_exact(tiny32, tiny32_params):
    """f32, qdq off, exact mode (--no-swa-bounded-replay): SWA snapshots instead of replay; several prefill and
    decode buckets. Shapes shared with tests/test_host_tier.py (EXACT_ENGINE_ARGS in tests/harness.py)."""
    return Engine(tiny32, EngineArgs(**EXACT_ENGINE_ARGS), params=tiny32_params, progress=False)


def run(engine, prompts, n=6, salt=None, concurrent=True, **sp):
    sp = {**GREEDY, **sp}
    res = {}

    def drain():
        for o in engine.run_until_done():
            r = res[o.request_id]
            r["ids"] += o.new_token_ids
            r["lps"] += [d[t] for d, t in zip(o.new_logprobs or [], o.new_token_ids)]
            r["cached"] = o.num_cached_tokens
            r["reason"] = o.finish_reason or r["reason"]

    for i, p in enumerate(prompts):
        rid = f"{salt}-{i}-{len(res)}-{np.random.randint(1 << 30)}"
        res[rid] = {"ids": [], "lps": [], "cached": 0, "reason": None}
        engine.add_request(rid, p, SamplingParams(max_tokens=n, **sp), cache_salt=salt)
        if not concurrent:
            drain()
    drain()
    return list(res.values())


def greedy_reference(cfg, params, prompt, n, *, state=None, logits=None):
    if state is None:
        logits, state, _ = paths.ced_prefill(cfg, params, np.asarray([prompt]), mode="bounded", fresh=False,
                                             max_len=256)
        logits = np.asarray(logits[:, -1])
    ids, lps = [], []
    for _ in range(n):
        t = int(logits.argmax())
        ids.append(t)
        lps.append(float(jax.nn.log_softmax(jnp.asarray(logits))[0, t]))
        logits, state = paths.decode_step(cfg, params, state, [t])
        logits = np.asarray(logits)
    return ids, lps


def prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lens]


def test_matches_model_ced_path(eng, tiny, tiny_params):
    """Chunked (128 + 22), paged, bucketed, FP4 pages: equals the model's CED prefill + decode."""
    p = prompts(0, [150])[0]
    out = run(eng, [p], salt="ref")[0]
    ids, lps = greedy_reference(tiny, tiny_params, p, 6)
    assert out["ids"] == ids
    np.testing.assert_allclose(out["lps"], lps, atol=1e-4)
    assert out["cached"] == 0 and out["reason"] == "length"


def test_warm_turn_equals_model_replay(eng, tiny, tiny_params):
    """Second turn hits 128 cached tokens: the engine replays [H-W, N) exactly as the model's replay path."""
    W = tiny.window_size
    p1, extra = prompts(1, [150, 30])
    before = eng.metrics.snapshot()["counters"]
    first = run(eng, [p1], salt="turns", n=4)[0]
    p2 = p1 + first["ids"] + extra
    second = run(eng, [p2], salt="turns")[0]
    H = 128
    assert second["cached"] == H - W  # cached_tokens: the hit minus the W replayed tokens (really skipped)
    c = eng.metrics.snapshot()["counters"]
    assert c["replayed_tokens"] - before["replayed_tokens"] == W
    assert c["prefix_cache_hits"] - before["prefix_cache_hits"] == H
    # the model's own path: cold prefill of turn 1, rewind to H - W, replay with the SWA clipped there
    _, ds, _ = paths.ced_prefill(tiny, tiny_params, np.asarray([p1]), mode="bounded", fresh=False, max_len=256)
    ds = paths.rewind(ds, H - W)
    ds = paths.replace(ds, history=EngramHasher(tiny).next_history(None, np.asarray([p2[:H - W]])))
    logits, ds, _ = paths.prefill_chunk(tiny, tiny_params, ds, np.asarray([p2[H - W:]]), mode="bounded",
                                        write_from=H, fresh=False)
    ids, lps = greedy_reference(tiny, tiny_params, None, 6, state=ds, logits=np.asarray(logits[:, -1]))
    assert second["ids"] == ids
    np.testing.assert_allclose(second["lps"], lps, atol=1e-4)


def test_exact_mode_second_turn_equals_cold(eng_exact):
    p1, extra = prompts(2, [150, 40])
    first = run(eng_exact, [p1], salt="x", n=4)[0]
    p2 = p1 + first["ids"] + extra
    warm = run(eng_exact, [p2], salt="x")[0]
    cold = run(eng_exact, [p2], salt="cold")[0]
    assert warm["cached"] == 128 and cold["cached"] == 0  # 154 computed tokens: two full pages
    assert warm["ids"] == cold["ids"]
    np.testing.assert_allclose(warm["lps"], cold["lps"], atol=1e-4)
    assert eng_exact.metrics.snapshot()["gauges"]["snapshot_bytes"] > 0


def test_concurrent_shared_prefixes_equal_one_at_a_time(eng_exact):
    base = prompts(3, [90])[0]
    tails = prompts(4, [5, 40, 77, 1, 64, 20])
    ps = [base[:k] + t for k, t in zip([90, 70, 90, 64, 20, 90], tails)]
    conc = run(eng_exact, ps, salt="c1", n=5)
    seq = run(eng_exact, ps, salt="c2", n=5, concurrent=False)
    assert [r["ids"] for r in conc] == [r["ids"] for r in seq]
    for a, b in zip(conc, seq):
        np.testing.assert_allclose(a["lps"], b["lps"], atol=1e-4)
    assert sum(r["cached"] for r in seq) > 0  # the one-at-a-time run did hit the shared prefix


def test_poisoned_free_pages_are_never_read(eng):
    p = prompts(5, [120])[0]
    clean = run(eng, [p], salt="p1")[0]
    pool = eng.pool
    victims = [0] + list(pool.free_uncached)
    assert len(victims) > 1
    pages = eng.runner.pools["pages"]
    eng.runner.pools["pages"] = pages.at[jnp.asarray(victims)].set(jnp.uint8(0xFF))  # NaN scales everywhere
    dirty = run(eng, [p], salt="p2")[0]
    assert dirty["ids"] == clean["ids"] and np.isfinite(dirty["lps"]).all()
    np.testing.assert_allclose(dirty["lps"], clean["lps"], atol=1e-6)


def test_abort_and_finish_free_every_page(eng):
    ps = prompts(6, [70, 100, 30])
    for i, p in enumerate(ps):
        eng.add_request(f"ab{i}", p, SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        eng.step()
    assert eng.abort("ab1") and not eng.abort("ab1") and not eng.abort("nope")
    eng.run_until_done()
    eng.pool.check()
    assert eng.pool.num_free() == eng.pool.num_pages - 1  # every page free or cached
    assert len(eng.scheduler.free_slots) == eng.args.max_num_seqs


def test_sampling_controls(eng):
    p = prompts(7, [40])[0]
    a = run(eng, [p], salt="s", n=8, temperature=1.0, seed=11)[0]["ids"]
    b = run(eng, [p], salt="s", n=8, temperature=1.0, seed=11)[0]["ids"]
    c = run(eng, [p], salt="s", n=8, temperature=1.0, seed=12)[0]["ids"]
    assert a == b and a != c
    g = run(eng, [p], salt="s", n=8)[0]["ids"]
    k1 = run(eng, [p], salt="s", n=8, temperature=1.0, top_k=1, seed=3)[0]["ids"]
    assert k1 == g  # top-k 1 is greedy
    stop = run(eng, [p], salt="s", n=8, stop_token_ids=[g[2]])[0]
    assert stop["ids"] == g[:3] and stop["reason"] == "stop"


def test_bad_requests_rejected_without_side_effects(eng):
    n_req = len(eng.requests)
    for bad in ([], [512], [-1], ["a"]):
        with pytest.raises(ValueError):
            eng.add_request("bad", bad, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context length"):
        eng.add_request("long", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError):
        eng.add_request("t", [1, 2], SamplingParams(max_tokens=2, top_p=0))
    eng.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="in use"):
        eng.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    eng.run_until_done()
    assert len(eng.requests) == n_req
    old = eng.args.max_queued_requests
    eng.args.max_queued_requests = 0
    with pytest.raises(QueueFull):
        eng.add_request("q", [1, 2], SamplingParams(max_tokens=1))
    eng.args.max_queued_requests = old


def _compile_events(engine, ps):
    """Run prompts of assorted lengths (sampled, seeded) to the end; the compile events JAX reported meanwhile."""
    events = []

    def listener(name, *a, **k):
        if "compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for i, p in enumerate(ps):
            engine.add_request(f"nc{i}-{np.random.randint(1 << 30)}", p,
                               SamplingParams(max_tokens=3 + i, temperature=0.7, top_p=0.9, seed=i))
        engine.run_until_done()
    finally:
        jax.monitoring.clear_event_listeners()
    return events


def test_no_compilation_after_warmup(eng):
    assert _compile_events(eng, prompts(8, [5, 33, 64, 100, 9, 130])) == []
    # bounded replay: per prefill bucket a chunk program without and one with the decoder (+ prompt logprobs),
    # and one decode program per batch bucket
    a = eng.args
    expected = len(a.prefill_buckets) * (2 + int(a.enable_prompt_logprobs)) + len(a.decode_buckets)
    assert eng.metrics.snapshot()["gauges"]["compiled_programs"] == len(eng.runner.program_keys()) == expected


def test_exact_mode_no_compilation_after_warmup(eng_exact):
    """Several prefill and decode buckets: every chunk and batch size finds its bucket's program."""
    assert _compile_events(eng_exact, prompts(13, [5, 33, 64, 100, 9, 130])) == []
    # exact mode: per prefill bucket a chunk program without and one with sampling (decoder on every row), one
    # decode program per batch bucket, and the SWA snapshot save / load programs
    a = eng_exact.args
    expected = len(a.prefill_buckets) * 2 + len(a.decode_buckets) + 2
    assert len(a.prefill_buckets) > 1 and len(a.decode_buckets) > 1
    assert eng_exact.metrics.snapshot()["gauges"]["compiled_programs"] == len(eng_exact.runner.program_keys()) \
        == expected


def test_prompt_logprobs_equal_full_forward(eng, tiny, tiny_params):
    """echo + logprobs: every prompt position scored exactly as the full forward (a), across chunks (128 + 22)."""
    p = prompts(9, [150])[0]
    outs = []
    eng.add_request("plp", p, SamplingParams(max_tokens=0, prompt_logprobs=3),
                    callback=outs.append)
    eng.run_until_done()
    final = outs[-1]
    assert final.finished and final.finish_reason == "length" and final.new_token_ids == []
    plp = final.prompt_logprobs
    assert len(plp) == 150 and plp[0] is None and all(len(d) >= 1 for d in plp[1:])
    ref = np.asarray(jax.nn.log_softmax(paths.forward(tiny, tiny_params, np.asarray([p]))[0], axis=-1))
    got = np.array([plp[i + 1][p[i + 1]] for i in range(149)])
    want = ref[np.arange(149), p[1:]]
    np.testing.assert_allclose(got, want, atol=2e-3)
    top = max(plp[10].items(), key=lambda kv: kv[1])
    assert top[0] == int(ref[9].argmax())


def _sampled(engine, prompts_, n=6, **sp):
    outs = {}
    for i, p in enumerate(prompts_):
        rid = f"seed-{np.random.randint(1 << 30)}-{i}"  # random ids: the outputs must not depend on them
        outs[i] = rid
        engine.add_request(rid, p, SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, **sp))
    got = {}
    for o in engine.run_until_done():
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[outs[i]] for i in range(len(prompts_))]


def test_unseeded_requests_reproduce_after_a_restart_with_the_same_seed(tiny, tiny_params):
    """--seed drives the seeds of unseeded requests in arrival order (as vLLM): a restarted engine with the same
    seed gives the same outputs for the same sequence of requests; another seed does not."""
    ps = prompts(11, [20, 45, 70])

    def fresh(seed):  # `eng`'s shapes (programs from the persistent compilation cache), but for prompt logprobs
        return Engine(tiny, EngineArgs(**SMALL_ENGINE_ARGS, seed=seed), params=tiny_params, progress=False,
                      programs=lambda k: not k.all_logits)

    a = _sampled(fresh(5), ps)
    b = _sampled(fresh(5), ps)
    c = _sampled(fresh(6), ps)
    assert a == b
    assert a != c
    assert len({tuple(x) for x in a}) == 3  # the three requests got different seeds


def test_a_failed_call_that_lost_the_pools_fails_only_its_request(eng_exact):
    """Inject a failure into the prefill program after it consumed (donated) the device pools: the request it
    carried fails with an error, the decoding request is recomputed on rebuilt pools and finishes exactly as
    in a clean run, and the engine serves the failed prompt normally afterwards."""
    p1, p2 = prompts(12, [70, 90])
    clean1 = run(eng_exact, [p1], salt="f-clean", n=10)[0]
    clean2 = run(eng_exact, [p2], salt="f-clean2", n=4)[0]
    runner = eng_exact.runner
    originals = dict(runner.programs)
    calls = []

    def poisoned(key):
        def fn(params, pools, inp):
            calls.append(key)
            runner.programs.update(originals)  # fail once
            for v in pools.values():
                v.delete()  # what a donated call that then fails leaves behind
            raise RuntimeError("injected device failure")
        return fn

    outs = {}

    def cb(o):
        outs.setdefault(o.request_id, []).append(o)

    eng_exact.add_request("f1", p1, SamplingParams(max_tokens=10, **GREEDY), cache_salt="f1", callback=cb)
    while not any(o.new_token_ids for o in outs.get("f1", [])):
        eng_exact.step()
    for key in originals:
        if key.kind == "prefill":
            runner.programs[key] = poisoned(key)
    eng_exact.add_request("f2", p2, SamplingParams(max_tokens=4, **GREEDY), cache_salt="f2", callback=cb)
    try:
        eng_exact.run_until_done()
    finally:
        runner.programs.update(originals)
    assert calls, "the failure was not injected"
    f2 = outs["f2"][-1]
    assert f2.finished and f2.finish_reason == "abort" and "injected device failure" in f2.error
    f1_ids = [t for o in outs["f1"] for t in o.new_token_ids]
    f1_lps = [d[t] for o in outs["f1"] for d, t in zip(o.new_logprobs or [], o.new_token_ids)]
    assert outs["f1"][-1].error is None and outs["f1"][-1].finish_reason == "length"
    assert f1_ids == clean1["ids"]
    np.testing.assert_allclose(f1_lps, clean1["lps"], atol=1e-4)
    assert eng_exact.metrics.snapshot()["counters"]["preemptions"] >= 1  # f1 was recomputed
    again = run(eng_exact, [p2], salt="f-again", n=4)[0]
    assert again["ids"] == clean2["ids"]
    eng_exact.pool.check()
