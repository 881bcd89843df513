"""dsv41_jax: DeepSeek-V4.1-Flash (the CED model) in JAX / Flax NNX.

Importing the package turns off XLA's "excess precision" rewrites (which may drop a bf16 rounding between
two f32 ops) so the model keeps the reference's rounding points under jit. Set
DSV41_ALLOW_EXCESS_PRECISION=1 to keep XLA's default. This must happen before JAX creates its backend.
"""

import os

if os.environ.get("DSV41_ALLOW_EXCESS_PRECISION") != "1":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_allow_excess_precision=false").strip()

from dsv41_jax.config import ModelConfig  # noqa: E402

__all__ = ["ModelConfig"]
