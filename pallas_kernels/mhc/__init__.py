"""mHC coefficients (single-pass manifold-constrained hyper-connections): the Sinkhorn part in one kernel (its
jnp reference is the model's dsv41_jax.layers.hc_coefficients)."""

from pallas_kernels.mhc.kernel import hc_coefficients

__all__ = ["hc_coefficients"]
