"""The shipped default model generates Python, not loops: greedy continuations of the 20 held-out prefixes stored in
its training.json (stdlib files the model never trained on, cut at 192 tokens) through the engine, as served.

Issue 24's bar: no more than 8 identical lines in a row in any continuation (the first model answered with runs of
60 newlines), and the continuations are code-like (most lines are not blank).
"""

import json

import numpy as np
import pytest

from bench.greedy_loops import MAX_RUN, longest_run, runs_of
from dsv41_jax.default_model import DIR
from serving.engine.config import EngineArgs, shared_cache_dir
from serving.engine.engine import Engine
from serving.engine.types import SamplingParams
from tests.harness import DEFAULT_MODEL_ENGINE_ARGS

NEW_TOKENS = 128


def test_longest_run_counts_identical_neighbours():
    assert longest_run(["a", "a", "b", "a", "a", "a"]) == 3 and longest_run([]) == 0
    assert longest_run([""] * 60) == 60


@pytest.fixture(scope="module")
def continuations():
    facts = json.loads((DIR / "training.json").read_text())
    prefixes = facts["prefixes"]
    assert len(prefixes) == 20
    # 10 lanes: the 20 continuations in two rounds of 128 decode steps (greedy rows do not depend on each other)
    args = EngineArgs(**DEFAULT_MODEL_ENGINE_ARGS, compilation_cache_dir=shared_cache_dir())
    eng = Engine(str(DIR), args, progress=False)
    tok = eng.tokenizer
    for i, p in enumerate(prefixes):
        eng.add_request(f"p{i}", tok.encode(p, add_bos=True), SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    out = {f"p{i}": "" for i in range(len(prefixes))}
    n_tokens = dict.fromkeys(out, 0)
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_text
            n_tokens[o.request_id] += len(o.new_token_ids)
    return prefixes, [out[f"p{i}"] for i in range(len(prefixes))], [n_tokens[f"p{i}"] for i in range(len(prefixes))]


@pytest.mark.xfail(strict=True, reason="known gap (issue 24): greedy continuations loop past 8 identical lines on "
                   "2-5 of the 20 held-out prefixes, depending on the machine's float order (5 on one development "
                   "machine, 2 on another: 42 lines on prefix 4, 21 on prefix 10); the exact full-sequence forward "
                   "loops on prefix 4 too, 42 lines (bench/greedy_loops.py)")
def test_greedy_continuations_do_not_loop(continuations):
    prefixes, texts, n = continuations
    assert all(k > 0 for k in n)
    runs = runs_of(prefixes, texts)
    assert max(runs) <= MAX_RUN, (runs, texts[int(np.argmax(runs))])


def test_greedy_continuations_are_mostly_code(continuations):
    _, texts, _ = continuations
    lines = [x for t in texts for x in t.split("\n")]
    assert np.mean([bool(x.strip()) for x in lines]) >= 0.6
    # Python's vocabulary: keywords, imports and calls appear in most continuations (the rest continue comments)
    words = ("def ", "class ", "import ", "return", "self.", "if ", "(", "=")
    assert sum(any(k in t for k in words) for t in texts) >= 16
