"""Fused training attention of a fresh CSA2 chunk (SWA band + selected compressed latents + sink, one softmax):
Pallas Triton forward and backward kernels behind a custom_vjp (its jnp reference is
dsv41_jax.train_attention.blocked_attention); see kernel.py."""

from pallas_kernels.train_attention.kernel import flash_train_attention

__all__ = ["flash_train_attention"]
