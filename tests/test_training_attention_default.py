"""The training step with blocked attention equals the served one at the default model's training config
(tests/training_steps.py; the tiny preset and the attention core alone: tests/test_training_attention.py)."""

import pytest

from tests.training_steps import run_clean


@pytest.mark.timeout(1800)
def test_blocked_training_step_equals_served_default_model():
    """The default model's training config (training.train_default.model_config: window 128, top-128), T = 320:
    the window wraps, a partial last block, 160 / 320 compressed entries > top-k. f32 without qdq: loss 1e-6,
    each leaf 2e-3 and all leaves 1e-4 relative L2 (seen with the retrained model's config: the first Engram
    layer's q_weight 1.08e-3, a leaf whose gradient is small, max |g| 2e-3, and reaches it through every later
    layer's rounding; all leaves 2.4e-5); bf16 + qdq as check_model."""
    run_clean("check_model(model_config(compute_dtype='float32', qdq=False), 1, 320, 1e-6, 2e-3)\n"
              "check_model(model_config(), 1, 320, 1e-2, None)")
