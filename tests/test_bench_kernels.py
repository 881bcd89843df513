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
