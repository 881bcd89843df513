"""The FP8 SWA ring write (quantise, pack, store in place) in one kernel (its jnp reference:
dsv41_jax.kv_cache.SwaPool.write)."""

from pallas_kernels.ring_write.kernel import ring_write

__all__ = ["ring_write"]
