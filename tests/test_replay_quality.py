"""bench/replay_quality.py: its metrics against hand-computed values, its summary statistics, and a CPU smoke run on
the default model's 2 check documents (H = 448, next 129 tokens), whose programs the notebook test compiled
already (shared persistent compilation cache)."""

import json
import math

import jax
import numpy as np
import pytest

from bench import replay_quality as rq
from serving.engine.config import shared_cache_dir


def test_compare_hand_computed():
    ref = np.zeros((1, 2, 2), np.float32)  # p = (1/2, 1/2) at both rows
    var = np.log(np.array([[[3.0, 1.0], [1.0, 3.0]]], np.float32))  # (3/4, 1/4) then (1/4, 3/4)
    tgt = np.array([[0, 0]])
    m = rq.compare(ref, var, tgt)
    # NLL: ref ln 2 at both rows; var -ln(3/4), -ln(1/4)
    want = ((-math.log(0.75) - math.log(2)) + (-math.log(0.25) - math.log(2))) / 2
    np.testing.assert_allclose(m["dnll"], [want], rtol=1e-5)
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # the same at both rows
    np.testing.assert_allclose(m["kl"], [kl], rtol=1e-5)
    np.testing.assert_allclose(m["agree"], [0.5])  # ref argmax 0 (first of a tie) at both rows; var 0 then 1
    np.testing.assert_allclose(m["nll_exact"], [math.log(2)], rtol=1e-6)
    np.testing.assert_allclose(m["max_abs_dlogit"], [math.log(3)], rtol=1e-6)


def test_compare_identity_and_shift_invariance():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(3, 5, 11)).astype(np.float32)
    tgt = rng.integers(0, 11, (3, 5))
    same = rq.compare(ref, ref, tgt)
    assert np.all(same["dnll"] == 0) and np.all(same["agree"] == 1) and np.all(np.abs(same["kl"]) < 1e-6)
    shifted = rq.compare(ref, ref + 7.0, tgt)  # a constant logit shift is the same distribution
    assert np.all(np.abs(shifted["dnll"]) < 1e-5) and np.all(np.abs(shifted["kl"]) < 1e-5)
    other = rq.compare(ref, ref + rng.normal(size=ref.shape).astype(np.float32), tgt)
    assert np.all(other["kl"] > 0)


def test_summarize_standard_errors():
    d = np.array([0.1, 0.3, -0.1, 0.5])
    per = {"ced": {1024: {"dnll": d, "agree": np.ones(4), "kl": np.full(4, 0.01), "nll_exact": np.full(4, 1.5),
                          "max_abs_dlogit": np.arange(4.0)}}}
    s = rq.summarize(per)["ced"]["1024"]
    se = np.std(d, ddof=1) / 2
    assert s["docs"] == 4 and math.isclose(s["dnll_mean"], 0.2) and math.isclose(s["dnll_se"], se)
    assert s["within_1p5_se"] == (0.2 <= 1.5 * se) and s["max_abs_dlogit"] == 3.0


def test_summarize_pairs_variants_with_the_control():
    """Per document, variant - control: the float noise both share cancels; the doc renders the paired table."""
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.05, 50)  # shared by every path of a document
    extra = rng.normal(0.002, 0.001, 50)  # what the approximation adds
    def row(d):
        return {1024: {"dnll": d, "agree": np.ones(50), "kl": np.full(50, 0.01), "nll_exact": np.full(50, 1.5),
                       "max_abs_dlogit": np.ones(50)}}
    s = rq.summarize({"exact": row(noise), "ced": row(noise + extra)})
    m = s["ced"]["1024"]
    assert math.isclose(m["vs_control_mean"], extra.mean(), rel_tol=1e-9)
    assert math.isclose(m["vs_control_se"], np.std(extra, ddof=1) / math.sqrt(50), rel_tol=1e-9)
    assert not m["vs_control_within_1p5_se"]  # 0.002 is ~14 SE: the pairing finds it
    assert m["within_1p5_se"]  # unpaired, the shared noise hides it
    assert "vs_control_mean" not in s["exact"]["1024"] and len(m["dnll_per_doc"]) == 50
    doc = rq.render_doc({"result": {"docs": 50, "doc_len": 6400, "H": [1024], "next_tokens": 256, "chunk": 1024,
                                    "new_tokens": 64, "summary": s, "device": "cpu"}}, None, "x.png")
    assert "Paired against the control" in doc and "paired against the control it is **not** within" in doc


@pytest.mark.timeout(300)
def test_smoke_run(tmp_path):
    jax.config.update("jax_compilation_cache_dir", shared_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    out = tmp_path / "rq.json"
    rec = rq.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["result"]["summary"] == json.loads(json.dumps(rec["result"]["summary"]))
    r = rec["result"]
    assert r["docs"] == 2 and r["H"] == [448] and r["next_tokens"] == 129
    assert set(r["summary"]) == {"ced", "replay", "served"}
    for v, byH in r["summary"].items():
        m = byH["448"]
        assert m["docs"] == 2
        for k in ("dnll_mean", "dnll_se", "kl_mean", "agree_mean", "nll_exact_mean"):
            assert math.isfinite(m[k]), (v, k)
        assert 0 <= m["agree_mean"] <= 1 and m["kl_mean"] >= -1e-6
        assert m["max_abs_dlogit"] > 0  # each approximation really changed the computation (window 128 < H)
    # the plot and the document render from the results file
    pytest.importorskip("matplotlib")
    doc, img = tmp_path / "Q.md", tmp_path / "q.png"
    rq.main(["--render", str(out), "--doc", str(doc), "--plot", str(img)])
    text = doc.read_text()
    assert img.stat().st_size > 1000 and "within 1.5 SE" in text and "(b) bounded replay" in text
