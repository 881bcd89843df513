"""The program cache (serving/engine/program_cache.py): a second engine with the same code, model, flags and
devices loads every program without tracing and generates what the first generated; anything that shapes a
program (flags, source) misses; a damaged entry is compiled again; library callers get it off."""
import logging

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cc

from serving.engine import Engine, EngineArgs, SamplingParams
from serving.engine import program_cache as pc
from serving.engine.config import SMALL_ENGINE_ARGS, shared_cache_dir


def _engine(cache_dir, tiny_params, **over):
    kw = {**SMALL_ENGINE_ARGS, "compilation_cache_dir": str(cache_dir), "program_cache": True, **over}
    return Engine("tiny", EngineArgs(**kw), params=tiny_params, progress=False)


def _greedy(engine, prompts):
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    toks = {f"r{i}": [] for i in range(len(prompts))}
    lps = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [sorted(d.items()) for d in o.new_logprobs or []]
    assert all(len(t) == 12 for t in toks.values())
    return [(toks[k], lps[k]) for k in sorted(toks)]


@pytest.fixture
def own_jax_cache(tmp_path):
    """JAX's persistent cache in this test's directory (JAX keeps one per process: reset it around the test), so
    the first engine compiles its programs instead of finding them from an earlier run."""
    jax_cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path
    jax_cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", shared_cache_dir())


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 250, n).tolist() for n in (5, 70, 140)]  # one chunk, two chunks, three


def test_a_restart_loads_every_program_and_generates_the_same_tokens(own_jax_cache, tiny_params, prompts):
    tmp_path = own_jax_cache
    first = _engine(tmp_path, tiny_params)
    n = first.runner.compile_count
    assert n >= 3 and first.runner.program_cache_hits == 0
    assert len(list((tmp_path / pc.SUBDIR).glob("*.pkl"))) == n  # one entry per program
    want = _greedy(first, prompts)
    del first
    second = _engine(tmp_path, tiny_params, compile_threads=2)  # not keyed: the same programs
    assert second.runner.program_cache_hits == second.runner.compile_count == n
    assert _greedy(second, prompts) == want  # tokens and logprobs, bit for bit
    # a flag that shapes programs (here a new decode bucket) changes every key: the flags are keyed whole
    third = _engine(tmp_path, tiny_params, decode_buckets=(4, 8))
    assert third.runner.program_cache_hits == 0 and third.runner.compile_count == n + 1


def test_changed_source_or_a_damaged_entry_compiles_again(own_jax_cache, tiny_params, prompts, monkeypatch, caplog):
    tmp_path = own_jax_cache
    first = _engine(tmp_path, tiny_params)
    want = _greedy(first, prompts)
    n = first.runner.compile_count
    del first
    entries = sorted((tmp_path / pc.SUBDIR).glob("*.pkl"))
    assert len(entries) == n
    entries[0].write_bytes(b"not a pickle")  # damaged: a miss (and removed)
    with caplog.at_level(logging.WARNING, logger=pc.__name__):
        second = _engine(tmp_path, tiny_params)
    assert second.runner.program_cache_hits == n - 1 and "unusable" in caplog.text
    assert _greedy(second, prompts) == want
    # the damaged program is compiled again: stored, unless JAX's own cache served it (it keeps programs that took
    # over 0.5 s to compile), which is not stored (XLA:CPU cannot serialize it again)
    skipped = second.runner.program_cache_not_stored
    assert skipped in (0, 1) and len(list((tmp_path / pc.SUBDIR).glob("*.pkl"))) == n - skipped
    del second
    monkeypatch.setattr(pc, "source_digest", lambda: "another tree")  # an edited module: every program misses
    third = _engine(tmp_path, tiny_params)
    assert third.runner.program_cache_hits == 0
    assert _greedy(third, prompts) == want


def test_library_engines_and_unkeyed_fields(tmp_path, tiny_params):
    assert EngineArgs().program_cache is False  # Engine() callers: off (code that patches traced functions)
    plain = Engine("tiny", EngineArgs(**SMALL_ENGINE_ARGS, compilation_cache_dir=str(tmp_path)), params=tiny_params,
                   progress=False)
    assert plain.runner.program_cache_hits == 0 and not (tmp_path / pc.SUBDIR).exists()
    a = EngineArgs(**SMALL_ENGINE_ARGS).resolved(plain.cfg)
    c1 = pc.ProgramCache(str(tmp_path), plain.cfg, a, None, tiny_params, plain.runner.pools)
    for field in pc.UNKEYED_ARGS:  # fields that change no program leave every key as it was
        b = EngineArgs(**{**a.__dict__, field: {"compilation_cache_dir": "/elsewhere", "compile_threads": 3,
                                                 "program_cache": True, "session_ttl_s": 1.0,
                                                 "max_queued_requests": 5, "dp_load_cap": 2}[field]})
        c2 = pc.ProgramCache(str(tmp_path), plain.cfg, b, None, tiny_params, plain.runner.pools)
        assert c2.digest("k", ()) == c1.digest("k", ())
    c3 = pc.ProgramCache(str(tmp_path), plain.cfg, EngineArgs(**{**a.__dict__, "kernels": "pallas"}), None,
                         tiny_params, plain.runner.pools)
    assert c3.digest("k", ()) != c1.digest("k", ())
    other = jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == jax.numpy.bfloat16 else x, tiny_params)
    c4 = pc.ProgramCache(str(tmp_path), plain.cfg, a, None, other, plain.runner.pools)
    assert c4.digest("k", ()) != c1.digest("k", ())  # parameter dtypes are part of the key


def test_trim_keeps_the_most_recently_used_entries_within_the_byte_budget(tmp_path):
    import os

    for i in range(5):  # entry i is 100 bytes, used at time 1000 + i
        f = tmp_path / f"{i}.pkl"
        f.write_bytes(bytes(100))
        os.utime(f, (1000 + i, 1000 + i))
    os.utime(tmp_path / "1.pkl", (2000, 2000))  # loaded recently: the most recent
    pc.trim(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.glob("*.pkl")) == ["1.pkl", "4.pkl"]
    pc.trim(tmp_path, 10)  # the newest entry stays even when alone over the budget
    assert [p.name for p in tmp_path.glob("*.pkl")] == ["1.pkl"]
