"""Scheduler properties on a simulated model (no device work): budget, threshold, decode-first, preemption."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax.config import ModelConfig
from serving.engine.config import EngineArgs
from serving.engine.page_pool import PagePool
from serving.engine.request import FINISHED, Request
from serving.engine.scheduler import Scheduler
from serving.engine.types import SamplingParams

TINY = ModelConfig.preset("tiny", max_seq_len=1024)


def simulate(args, reqs, max_steps=2000):
    args = args.resolved(TINY)
    pool = PagePool(args.num_pages)
    s = Scheduler(args, pool, TINY.window_size)
    for r in reqs:
        s.waiting.append(r)
    log = []
    for _ in range(max_steps):
        if not (s.running or s.waiting):
            break
        decoding = [r for r in s.running if not r.in_prefill]
        out = s.schedule()
        log.append((out, decoding, len(s.running) + len(s.waiting)))
        for plan in out:
            r = plan.req
            assert plan.pos0 == r.sched.num_computed
            r.sched.num_computed = plan.end
            if plan.sample:
                r.tokens.append(1)
                r.out.out_ids.append(1)
                r.refresh_hashes()
                if len(r.out.out_ids) >= r.sampling.max_tokens:
                    s.finish(r, "length")
        pool.check()
    assert not (s.running or s.waiting), "did not finish"
    assert all(r.status == FINISHED for r in reqs)
    assert pool.num_free() == pool.num_pages - 1
    return s, log


def make(lens, outs, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(f"r{i}", rng.integers(0, 512, n).tolist(), n, SamplingParams(max_tokens=o))
            for i, (n, o) in enumerate(zip(lens, outs))]


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=8), outs=st.lists(st.integers(1, 12), min_size=8,
       max_size=8), thr=st.sampled_from([0, 16, 40]), budget=st.sampled_from([16, 64]))
def test_budget_threshold_and_decode_first(lens, outs, thr, budget):
    args = EngineArgs(max_model_len=320, max_num_seqs=4, max_num_batched_tokens=budget,
                      long_prefill_token_threshold=thr)
    _, log = simulate(args, make(lens, outs))
    for out, decoding, n_live in log:
        assert sum(p.n for p in out) <= budget
        sched = {id(p.req) for p in out}
        for p in out:
            if not p.is_decode and thr and n_live > 1:
                assert p.n <= thr  # long prefills are capped while others are around
        for r in decoding:  # a running decode is never starved (unless it was preempted)
            assert id(r) in sched or r.status != "running"


def test_final_chunk_carries_the_window():
    _, log = simulate(EngineArgs(max_model_len=320, max_num_seqs=2, max_num_batched_tokens=32),
                      make([70], [2]))
    plans = [p for out, _, _ in log for p in out]
    assert [p.n for p in plans[:3]] == [32, 30, 8]  # 70 = 32 + 30 + 8: the last chunk is not shorter than W = 8
    # the chunk plan carries the CED rule: no decoder on non-final chunks, the last window on the final one
    assert [p.decoder for p in plans[:3]] == ["none", "none", "window"]
    assert [p.sample for p in plans[:3]] == [False, False, True]
    assert plans[2].dec_clip == 70 - 8 and plans[3].is_decode


def test_preemption_by_recompute_when_pages_run_out():
    args = EngineArgs(max_model_len=320, max_num_seqs=3, max_num_batched_tokens=64, num_pages=8)
    reqs = make([120, 120, 100], [40, 40, 40])
    s, log = simulate(args, reqs)
    # the pool (7 pages) cannot hold three growing requests: someone was preempted and recomputed
    assert s.preemptions >= 1
    assert all(len(r.out.out_ids) == 40 for r in reqs)
    # a preempted request restarted from position 0 (recompute) after it had generated tokens
    restarts = [p for out, _, _ in log for p in out if p.pos0 == 0 and len(p.req.out.out_ids) > 0]
    assert restarts


def test_ample_pages_never_preempt():
    s, _ = simulate(EngineArgs(max_model_len=320, max_num_seqs=3, max_num_batched_tokens=64),
                    make([120, 120, 100], [40, 40, 40]))
    assert s.preemptions == 0


def test_prefill_schedule_interval_defers_prefills():
    args = EngineArgs(max_model_len=320, max_num_seqs=4, max_num_batched_tokens=16, prefill_schedule_interval=3)
    reqs = make([8, 100, 100], [30, 5, 5])
    _, log = simulate(args, reqs)
    prefill_steps = [i for i, (out, dec, _) in enumerate(log) if dec and any(not p.is_decode for p in out)]
    assert len(prefill_steps) >= 3  # the long prompts needed several chunks while r0 was decoding
    assert all(b - a >= 3 for a, b in zip(prefill_steps, prefill_steps[1:]))


def test_rejects_bad_engine_args():
    with pytest.raises(ValueError):
        EngineArgs(max_num_batched_tokens=4).resolved(TINY)  # smaller than the window
    with pytest.raises(ValueError):
        EngineArgs(tensor_parallel_size=2).resolved(TINY)
