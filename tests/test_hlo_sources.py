"""bench/hlo_sources.py: kernels traced back to the JAX source lines of their fusions, through a real XLA dump."""
import os
import subprocess
import sys
from pathlib import Path

from bench.hlo_sources import by_source, instruction_sources
from bench.profile_train_step import hlo_scopes

ROOT = Path(__file__).resolve().parents[1]
CODE = """
import jax, jax.numpy as jnp
from dsv41_jax import quant
x = jax.random.normal(jax.random.key(0), (4, 64), jnp.float32)
def f(x):
    with jax.named_scope("moe"):
        return quant.fp8_encode(jnp.sin(x) * 3.0, 32)
print(jax.jit(f)(x)[1].sum())
"""


def test_fusions_map_to_their_source_lines(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text")
    r = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    src = instruction_sources(str(tmp_path))
    quant_lines = {k: v for k, v in src.items() if v.startswith("dsv41_jax/quant.py:")}
    assert quant_lines, src  # the amax reduction and the code conversion come from quant.fp8_encode
    name = next(iter(quant_lines))
    rows = [{"kernel": name, "count_per_step": 2.0, "us_per_step": 3.0},
            {"kernel": "my_pallas_kernel", "count_per_step": 1.0, "us_per_step": 5.0}]
    grouped = by_source(rows, str(tmp_path))
    assert grouped[0] == {"source": "my_pallas_kernel", "count_per_step": 1.0, "us_per_step": 5.0, "kernels": 1}
    assert grouped[1]["source"] == quant_lines[name] and grouped[1]["count_per_step"] == 2.0
    # the same parser gives the training profile its scopes (bench/profile_train_step.py): the model's named scope
    scopes = {}
    for module in sorted(tmp_path.glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size):
        scopes.update(hlo_scopes(module.read_text()))
    assert set(scopes) >= set(quant_lines) and {scopes[k] for k in quant_lines} == {"moe"}
