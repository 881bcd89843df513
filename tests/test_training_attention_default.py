"""The blocked training attention equals the served one at the default model's training config (window 128,
top-128 of more compressed entries than k, 4 heads of 64): the attention core alone, forward and gradients, in
f32 and in the served bf16. The whole training step (loss and every gradient leaf, blocked vs served) is checked
on the tiny preset, which runs the same code through the same events (window wrap-around, a partial last block,
compressed entries beyond the top-k): tests/test_training_attention.py. A whole-model step of the default config
here cost three more whole-model compiles (about 240 s of CI's CPU, docs/BENCHMARKS.md "CI time") and checked
nothing the core and the tiny step do not: the attention core is the only code the training form changes."""

import dataclasses

from tests.test_training_attention import check_blocked_core


def test_blocked_core_equals_served_core_at_the_default_training_config():
    """T = 320 (the 128-row blocks: two whole and a partial one; the window wraps), C = 320 latents with 128
    selected per row (some -1), a replay clip on one sequence; f32 to 1e-5, bf16 to bf16 rounding."""
    from training.train_default import model_config

    base = model_config()
    assert (base.window_size, base.index_topk, base.n_heads, base.head_dim) == (128, 128, 4, 64)
    for cfg, tol in ((dataclasses.replace(base, compute_dtype="float32"), 1e-5), (base, 2e-2)):
        check_blocked_core(cfg, tol, B=2, T=320, C=320, seed=4, clip=[0, 37])
