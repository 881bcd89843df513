"""Mega-Gate: the MoE router (gate GEMM, sqrtsoftplus, bias, top-k, normalisation, route scale) in one kernel (its
jnp reference: dsv41_jax.layers.gate)."""

from pallas_kernels.mega_gate.kernel import GateBlocks, pick_blocks, route

__all__ = ["GateBlocks", "pick_blocks", "route"]
