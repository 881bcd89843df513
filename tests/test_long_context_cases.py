"""bench/long_context_cases.py and the window building of bench/long_context_probe.py on synthetic files with a
character-level tokenizer (one token per character, so token distances are character distances)."""

import numpy as np

from bench import long_context_cases as lc
from bench import long_context_probe as probe
from bench import long_context_report as report
from training import corpus


class CharTok:
    """ids = code points; decode drops the stream's <|bos|> / <|end|> ids (0, 1) as the real tokenizer does."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 1)


def filler(n_lines: int, tag: str = "x") -> str:
    return "".join(f"{tag}{i:05d} = {i} * 2  # padding line\n" for i in range(n_lines))


def offsets(text: str):
    return [(i, i + 1) for i in range(len(text))]


def cases_of(text: str, base: int = 1, **kw):
    kw = {"min_dist": 200, "max_dist": 700, "max_target": 64, **kw}
    return lc.file_cases("f.py", text, offsets(text), base, **kw)


HEAD = "import os\n\n\ndef helper_fn(a, b):\n    return a + b\n\n\n"


def test_a_far_call_is_a_case_with_exact_positions():
    text = HEAD + filler(12) + "result = helper_fn(1, 2)\n"
    (c,) = cases_of(text, base=10)
    call = text.index("helper_fn(1")
    assert c.name == "helper_fn" and c.kind == "function" and c.target_text == "helper_fn"
    assert c.cut == 10 + call and c.n_target == len("helper_fn")
    assert c.distance == call - text.index("helper_fn") == c.nearest
    a, b = c.block
    assert text[a - 10:b - 10] == "def helper_fn(a, b):\n    return a + b\n"


def test_rejections():
    far = filler(12)
    assert cases_of(HEAD + "x = 1\n" + "result = helper_fn(1, 2)\n") == []  # call too near
    assert cases_of(HEAD + filler(30) + "result = helper_fn(1, 2)\n") == []  # too far
    assert cases_of(HEAD + far + "# see helper_fn\n" + filler(12) + "helper_fn(1, 2)\n") == []  # mentioned between
    assert cases_of("__all__ = ['helper_fn']\n" + HEAD + far + "helper_fn(1, 2)\n") == []  # mentioned before
    assert cases_of(HEAD + far + "f = helper_fn\n" + "helper_fn(1, 2)\n") == []  # first later use is not a call
    assert cases_of(HEAD + far + "my_helper_fn(1)\nresult = helper_fn(1, 2)\n")  # whole words only
    assert cases_of("def broken(:\n" + far + "broken()\n") == []  # a syntax error: no definitions


def test_methods_classes_decorators_and_token_spans():
    text = ("class Widget:\n    @staticmethod\n    def _render(x):\n        return x\n\n"
            + "    def go(self):\n" + "".join(f"        v{i:05d} = {i}  # padding line with words\n"
                                           for i in range(12))
            + "        return self._render(2) + Widget(1)\n")
    got = {c.name: c for c in cases_of(text, min_dist=150)}
    assert set(got) == {"_render"}  # `Widget` is only called inside its own block: no case
    c = got["_render"]
    a, b = c.block
    assert text[a - 1:b - 1].startswith("    @staticmethod\n    def _render")  # decorators included
    # a tokenizer whose tokens carry the `.` before the name: the target is those tokens
    toks, i = [], 0
    while i < len(text):
        j = i + 2 if text[i] == "." else i + 1
        toks.append((i, j))
        i = j
    (c2,) = lc.file_cases("f.py", text, toks, 1, min_dist=150, max_dist=700)
    assert c2.target_text == "._render" and c2.n_target == len("._render") - 1


def test_spread_caps_cases_per_file():
    cs = [lc.Case(f, "n", "function", cut, 1, (0, 1), 1, 1, "n") for f in ("a", "b") for cut in range(0, 100, 10)]
    got = lc.spread(cs, 3)
    assert sorted(c.cut for c in got if c.file == "a") == [0, 30, 60] and len(got) == 6


def test_windows_full_and_definition_removed():
    text = HEAD + filler(12) + "result = helper_fn(1, 2)\n"
    other = filler(40, "y")
    tok = CharTok()
    docs = [np.asarray([corpus.BOS, *map(ord, t), corpus.END], np.int32) for t in (other, text)]
    stream = np.concatenate(docs)
    (c,) = cases_of(text, base=len(docs[0]) + 1)
    ctx, m = 800, 9
    full, rem, kept = probe.windows(tok, stream, [c], ctx, m)
    assert kept == [c] and full.shape == rem.shape == (1, ctx + m)
    assert np.array_equal(full[0], stream[c.cut - ctx:c.cut + m]) and tok.decode(full[0, ctx:]) == "helper_fn"
    prompt = tok.decode(rem[0, :ctx])
    assert "helper_fn" not in prompt and prompt.endswith("result = ") and "import os" in prompt
    assert tok.decode(rem[0, ctx:]) == "helper_fn"
    # a window that does not reach the definition is dropped
    assert probe.windows(tok, stream, [c], 300, m)[2] == []
    # so is one that reaches into an earlier file mentioning the name (the same window is kept without it)
    ctx2 = c.cut - len(docs[0]) + 100
    assert probe.windows(tok, stream, [c], ctx2, m)[2] == [c]
    docs[0] = np.asarray([corpus.BOS, *map(ord, other + "helper_fn = 3\n"), corpus.END], np.int32)
    (c3,) = cases_of(text, base=len(docs[0]) + 1)
    assert probe.windows(tok, np.concatenate(docs), [c3], ctx2, m)[2] == []


def test_mean_se_clustered():
    x = np.array([1.0, 1.0, 0.0, 0.0])
    s = probe.mean_se(x, ["a", "a", "b", "b"])
    assert s["mean"] == 0.5 and np.isclose(s["se"], np.std(x, ddof=1) / 2)
    # two perfectly correlated clusters: the clustered SE is larger than the naive one
    assert np.isclose(s["se_file"], np.sqrt((1.0 ** 2 + 1.0 ** 2) * 2) / 4) and s["se_file"] > s["se"]


def test_summarize_and_render_read_context_use():
    rng = np.random.default_rng(0)
    n = 40
    cases = [lc.Case(f"f{i % 10}.py", f"name{i}", "function", i, 1 + i % 3, (0, 1), 5000, 5000, "x")
             for i in range(n)]
    exact = (rng.random(n) < 0.6).astype(float)
    removed = exact * (rng.random(n) < 0.2)  # only some survive without the definition
    ced = exact.copy()
    ced[0] = 1 - ced[0]  # one flip
    per = {}
    for v, c in (("exact", exact), ("ced", ced), ("replay", exact), ("served", exact), ("removed", removed)):
        per[v] = {"correct": c, "first": c, "rest": np.ones(n), "nll": 3 - c}
    s = probe.summarize(per, cases)
    assert s["ced"]["flips"] == {"lost": int(exact[0]), "gained": int(1 - exact[0])}
    assert np.isclose(s["removed"]["vs_exact_accuracy"]["mean"], removed.mean() - exact.mean())
    assert s["exact"]["rest_given_first"]["cases"] == sum(c.n_target > 1 for c in cases)
    rec = {"command": "x", "result": {"summary": s, "file": "f.json", "cases": n, "files": 10, "sources": "s",
                                      "min_dist": 4000, "max_dist": 7000, "median_distance": 5000, "ctx": 7168,
                                      "per_file": 4, "device": "cpu", "seconds": 1.0,
                                      "per_case": [{"name": "a", "file": "f", "distance": 5000, "exact": True}]}}
    text = report.render_section(rec)
    assert "**uses** the long context" in text and text.count("\n| ") == 6  # header + 5 conditions
    per["removed"] = per["exact"]
    same = {**rec, "result": {**rec["result"], "summary": probe.summarize(per, cases)}}
    assert "does **not** measurably use" in report.render_section(same)
