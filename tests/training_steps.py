"""Whole-model training steps, a training attention form vs the served one (tests/test_training_attention.py):
loss and gradients of the training objective computed with each attention form, compared, in a fresh interpreter.

Why a subprocess: the suite compiles at --xla_backend_optimization_level=0 (tests/conftest.py), and there the
model's backward is NaN for the served attention and the blocked one alike (a scan of the step; not an attention
property). Level 1 is the cheapest that computes it (finite, and the same losses as the default level 2), and
compiles these steps ~15% faster than level 2 (tiny preset, per step: 57 / 75 / 72 s vs 82 / 73 / 87 s of CPU
for served f32 / blocked f32 / served bf16, measured on the 2-core CI machine, docs/BENCHMARKS.md "CI time").
"""

from __future__ import annotations

import numpy as np

XLA_LEVEL = "--xla_backend_optimization_level=1"


def loss_and_grads(cfg, attention, B, T, seed=0):
    import jax

    from dsv41_jax.engram_hash import EngramHasher
    from dsv41_jax.ops import TrainHooks
    from training import data as D
    from training import objective as O

    m = jax.jit(lambda: O.init_masters(cfg, seed))()
    win = np.random.default_rng(seed).integers(1, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    batch = D.host_batch(cfg, EngramHasher(cfg), win)
    hooks = TrainHooks(balance=True, indexer_stride=4, attention=attention)

    def f(m):
        return O.loss_and_metrics(cfg, m, *batch, aux_weight=0.1, hooks=hooks)

    (loss, met), g = jax.jit(jax.value_and_grad(f, has_aux=True))(m)
    return float(loss), float(met["ce"]), jax.tree.leaves(g)


def grad_error(gx, gy):
    """Relative L2 distance of two gradient trees (all leaves together), and whether any leaf is non-finite."""
    num = sum(float(np.sum((np.asarray(x, np.float32) - np.asarray(y, np.float32)) ** 2)) for x, y in zip(gx, gy))
    den = sum(float(np.sum(np.asarray(y, np.float32) ** 2)) for y in gy)
    assert den > 0 and all(np.all(np.isfinite(np.asarray(x))) for x in gx)
    return (num / den) ** 0.5


def check_model(cfg, B, T, tol_loss, tol_grad, form="flash"):
    """Loss and gradients of the training step's objective, the training attention `form` vs the served one, in
    f32: the losses to tol_loss relative, every gradient leaf to tol_grad relative L2."""
    lw, cw, gw = loss_and_grads(cfg, "served", B, T)
    lg, cg, gg = loss_and_grads(cfg, form, B, T)
    assert abs(lg - lw) <= tol_loss * abs(lw) and abs(cg - cw) <= tol_loss * abs(cw), (lg, lw, cg, cw)
    errs = [grad_error([x], [y]) if np.any(np.asarray(y)) else float(np.any(np.asarray(x))) for x, y in zip(gg, gw)]
    assert max(errs) <= tol_grad, errs
    assert grad_error(gg, gw) <= 1e-4, grad_error(gg, gw)


def run_clean(call: str, timeout: float = 1500):
    """Run `call` (check_model calls; `ModelConfig`, `dataclasses` and `model_config` in scope) in a fresh
    interpreter at XLA_LEVEL (module docstring)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    env["XLA_FLAGS"] = " ".join(flags + [XLA_LEVEL])
    code = ("import dataclasses\nfrom dsv41_jax.config import ModelConfig\n"
            "from training.train_default import model_config\nfrom tests.training_steps import check_model\n"
            f"{call}\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
