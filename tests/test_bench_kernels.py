"""The kernel benchmarks still build and run: every bench/kernels module's --smoke cases (tiny shapes, the Pallas
kernels in interpret mode on the CPU) give the same result as their XLA side, so a change of a kernel's or the
model's API cannot silently break the GPU benchmarks. The bench/weight_gemms.py smoke (its new kernels against
their references at small shapes) runs too, marked slow."""

import importlib

import jax
import numpy as np
import pytest

from bench.kernels import all as kernels_all


@pytest.mark.parametrize("pkg", kernels_all.PACKAGES)
def test_smoke_cases_match_their_xla_side(pkg):
    cases = importlib.import_module(f"bench.kernels.{pkg}").cases(smoke=True)
    assert cases
    for c in cases:
        args = c["make_args"]()
        got, want = c["fn_pallas"](*args), c["fn_xla"](*args)
        gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
        assert len(gl) == len(wl) and gl, c["name"]
        for g, w in zip(gl, wl):
            assert g.shape == w.shape, c["name"]
            wf = np.asarray(w, np.float64)
            assert np.isfinite(wf).any() and np.std(wf[np.isfinite(wf)]) > 0, f"{c['name']}: degenerate inputs"
            err, masks_equal = kernels_all.compare(g, w)
            assert masks_equal, c["name"]
            assert err < 2 ** -7, f"{c['name']}: rel_err {err:.2e}"
        assert c["bytes"] > 0


def test_the_cli_runs_the_smoke_table(capsys):
    rows = kernels_all.main(["--smoke", "--only", "mhc/hc_", "--iters", "1"])
    assert [r["name"] for r in rows] == ["mhc/hc_coefficients_N5"]
    assert all("error" not in r and r["rel_err"] < 2 ** -7 for r in rows)
    assert "hc_coefficients_N5" in capsys.readouterr().out


@pytest.mark.slow
def test_weight_gemms_smoke():
    from bench import weight_gemms

    assert weight_gemms.main(["--smoke"]) == 0


def test_weight_gemm_counters_parses_ncu_details():
    """bench/weight_gemm_counters.py: ncu's --csv --page details rows (one per metric, launches interleaved, a
    preamble before the header) become one dict per launch in ID order, matched to the cases in launch order."""
    from bench import weight_gemm_counters as wgc

    cols = '"ID","Kernel Name","Grid Size","Block Size","Section Name","Metric Name","Metric Unit","Metric Value"'

    def row(i, k, name, v):
        return f'"{i}","{k}","(6, 36, 1)","(128, 1, 1)","S","{name}","u","{v}"'

    text = "\n".join(["==PROF== Connected to process 1", cols,
                      row(1, "moe_swiglu_fp8", "gpu__time_duration.sum", "40,000"),
                      row(0, "moe_swiglu_mxfp4", "gpu__time_duration.sum", "50000"),
                      row(0, "moe_swiglu_mxfp4", "DRAM Throughput", "48.5"),
                      row(1, "moe_swiglu_fp8", "DRAM Throughput", "55"),
                      row(1, "moe_swiglu_fp8", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active"
                          ".ratio", "3.2"),
                      row(0, "moe_swiglu_mxfp4", "Registers Per Thread", "148")])
    rows = wgc.parse(text)
    assert [r["kernel"] for r in rows] == ["moe_swiglu_mxfp4", "moe_swiglu_fp8"]
    assert rows[0]["gpu__time_duration.sum"] == 50000.0 and rows[1]["gpu__time_duration.sum"] == 40000.0
    order = [dict(label="v1", nbytes=1e8, rel_err=None, ok=None), dict(label="fp8", nbytes=1e8, rel_err=1e-3, ok=True)]
    out = wgc.summarise(rows, order)
    assert [o["label"] for o in out] == ["v1", "fp8"]
    assert out[0]["us"] == 50.0 and out[0]["weight_gbps"] == 2000.0 and out[0]["registers"] == 148.0
    assert out[1]["top_stalls"][0] == ("long_scoreboard", 3.2) and out[1]["dram_pct"] == 55.0
    assert "| fp8 | 40.0 | 2500 |" in wgc.table(out)


def test_weight_gemm_counters_variants_change_only_what_they_name():
    from bench.weight_gemm_counters import _variants
    from pallas_kernels.moe import MoeBlock

    base = MoeBlock(1, 64, 512, splits=2, decode="fp8", nb=16, swap=True, fast_accum=True)
    v = dict(_variants(base, [dict(prefetch=True), dict(splits=2), dict(num_warps=8, prefetch=True)]))
    assert list(v) == ["base", "prefetch=True", "num_warps=8,prefetch=True"]  # splits=2 is the base itself
    assert v["prefetch=True"].prefetch and v["prefetch=True"].splits == 2 and not v["base"].prefetch
