"""Flax NNX front end: `DSV41` owns the parameters as nnx.Param leaves and runs the pure paths.

The compute lives in pure functions over the parameter pytree (dsv41_jax.model / paths), so the same
parameters serve jit, AOT lowering, shard_map and the serving engine; this module is the object users
hold in notebooks and what Orbax saves (`nnx.state(model)`).
"""

from __future__ import annotations

import jax
from flax import nnx

from dsv41_jax import paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params


def _is_param(x):
    return isinstance(x, nnx.Param)


class DSV41(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, seed: int = 0, params: dict | None = None):
        self.cfg = cfg
        p = params if params is not None else init_params(cfg, seed)
        self.params = nnx.data(jax.tree.map(nnx.Param, p))

    def pure_params(self) -> dict:
        """The parameters as a plain pytree of arrays (what the pure paths take)."""
        return jax.tree.map(lambda v: v[...], self.params, is_leaf=_is_param)

    def __call__(self, tokens, **kw):
        """(a) logits at every position, [B, T, V] f32."""
        return paths.forward(self.cfg, self.pure_params(), tokens, **kw)

    def ced_prefill(self, tokens, **kw):
        return paths.ced_prefill(self.cfg, self.pure_params(), tokens, **kw)

    def decode_step(self, state, token, **kw):
        return paths.decode_step(self.cfg, self.pure_params(), state, token, **kw)


def create(cfg: ModelConfig, seed: int = 0) -> DSV41:
    """Random model built on the default device (parameters never materialised on the host)."""
    return nnx.jit(lambda: DSV41(cfg, seed=seed))()
