"""Scheduler properties on a simulated model (no device work): budget, threshold, decode-first, preemption."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax.config import ModelConfig
from serving.engine.config import EngineArgs
from serving.engine.page_pool import PagePool
from serving.engine.scheduler import FINISHED, Request, Scheduler
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
        for sc in out:
            sc.was_prefill = sc.req.in_prefill
        log.append((out, decoding, len(s.running) + len(s.waiting)))
        for sc in out:
            r = sc.req
            r.num_computed += sc.n
            if sc.final:
                r.tokens.append(1)
                r.out_ids.append(1)
                r.refresh_hashes()
                if len(r.out_ids) >= r.sampling.max_tokens:
                    s.finish(r, "length")
        pool.check()
    assert not (s.running or s.waiting), "did not finish"
    assert all(r.status == FINISHED for r in reqs)
    assert pool.num_free() == pool.num_pages - 1
    return args, log


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
    args, log = simulate(args, make(lens, outs))
    for out, decoding, n_live in log:
        assert sum(sc.n for sc in out) <= budget
        sched = {id(sc.req) for sc in out}
        for sc in out:
            if sc.was_prefill and thr and n_live > 1:
                assert sc.n <= thr  # long prefills are capped while others are around
        for r in decoding:  # a running decode is never starved (unless it was preempted)
            assert id(r) in sched or r.status != "running"


def test_final_chunk_carries_the_window():
    args, log = simulate(EngineArgs(max_model_len=320, max_num_seqs=2, max_num_batched_tokens=32),
                         make([70], [2]))
    chunks = [sc.n for out, _, _ in log for sc in out]
    assert chunks[:3] == [32, 30, 8]  # 70 = 32 + 30 + 8: the last chunk is not shorter than W = 8


def test_preemption_by_recompute_when_pages_run_out():
    args = EngineArgs(max_model_len=320, max_num_seqs=3, max_num_batched_tokens=64, num_pages=8)
    reqs = make([120, 120, 100], [40, 40, 40])
    args, log = simulate(args, reqs)
    # the pool (7 pages) cannot hold three growing requests: someone was preempted and recomputed
    assert any(len(r.out_ids) == 40 for r in reqs)


def test_prefill_schedule_interval_defers_prefills():
    args = EngineArgs(max_model_len=320, max_num_seqs=4, max_num_batched_tokens=16, prefill_schedule_interval=3)
    reqs = make([8, 100, 100], [30, 5, 5])
    args, log = simulate(args, reqs)
    prefill_steps = [i for i, (out, dec, _) in enumerate(log) if dec and any(sc.was_prefill for sc in out)]
    assert len(prefill_steps) >= 3  # the long prompts needed several chunks while r0 was decoding
    assert all(b - a >= 3 for a, b in zip(prefill_steps, prefill_steps[1:]))


def test_rejects_bad_engine_args():
    with pytest.raises(ValueError):
        EngineArgs(max_num_batched_tokens=4).resolved(TINY)  # smaller than the window
    with pytest.raises(ValueError):
        EngineArgs(tensor_parallel_size=2).resolved(TINY)
