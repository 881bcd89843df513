"""mHC coefficients (single-pass manifold-constrained hyper-connections): the Sinkhorn part in one kernel."""

from pallas_kernels.mhc.kernel import hc_coefficients, ref_hc_coefficients

__all__ = ["hc_coefficients", "ref_hc_coefficients"]
