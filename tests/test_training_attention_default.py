"""The training step with blocked attention equals the served one at the default model's training config
(tests/training_steps.py; the tiny preset and the attention core alone: tests/test_training_attention.py)."""

import pytest

from tests.training_steps import run_clean


@pytest.mark.timeout(1800)
def test_blocked_training_step_equals_served_default_model():
    """The default model's training config (training.train_default.model_config: window 128, top-128), T = 320:
    the window wraps, a partial last block, 160 / 320 compressed entries > top-k; bf16 + qdq, the served config's
    numerics, against the served core's own rounding noise (check_model, tests/training_steps.py). The f32
    exactness check (loss 1e-6, every leaf 1e-4) is the tiny preset's, which exercises the same code with the
    same events (window wrap-around, compressed entries beyond the top-k; tests/test_training_attention.py);
    running it here too cost two more whole-model compiles (CI time, docs/BENCHMARKS.md)."""
    run_clean("check_model(model_config(), 1, 320, 1e-2, None)")
