"""Flax NNX front end: `DSV41` is the model as an NNX module, for notebooks, fine-tuning and Orbax.

What it is: an `nnx.Module` that owns the parameters as `nnx.Param` leaves (the same pytree the pure paths
take; `pure_params()` returns it) and whose methods run the pure paths of `dsv41_jax.paths`:
`model(tokens)` is the full causal forward (a), `ced_prefill` (b) and `decode_step` (c); with a DSpark draft
(`cfg.has_draft`, its parameters under `params["mtp"]`) `write_context` / `propose` run `dsv41_jax.dspark`.
Every Param carries its logical axes as metadata (`param.get_metadata()["logical_axes"]`, e.g. ("layers", "experts",
"expert_inter", "embed")): `dsv41_jax.sharding` maps them onto a mesh and `checkpoints.sharding` places
restored weights by them.

`model(tokens, engram_ids=...)` is traceable: wrap it in `nnx.jit` (or `jax.jit` over `nnx.split`). Engram rows
depend on token ids only and are hashed on the host in int64, so under a trace pass them in:
`ids = model.engram_ids(tokens)` outside, then `nnx.jit(lambda m, t, i: m(t, engram_ids=i))(model, tokens, ids)`.
With concrete tokens and no ids, `model(tokens)` computes them itself. The serving engine does not use this
module: it runs the same pure functions on the parameter pytree.
"""

from __future__ import annotations

import jax
from flax import nnx

from dsv41_jax import dspark, paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params, param_axes


def _is_param(x):
    return isinstance(x, nnx.Param)


class DSV41(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, seed: int = 0, params: dict | None = None):
        self.cfg = cfg
        p = params if params is not None else init_params(cfg, seed)
        axes = param_axes(cfg)
        self.params = nnx.data(jax.tree.map(lambda v, a: nnx.Param(v, logical_axes=tuple(a)), p, axes))

    def pure_params(self) -> dict:
        """The parameters as a plain pytree of arrays (what the pure paths take)."""
        return jax.tree.map(lambda v: v[...], self.params, is_leaf=_is_param)

    def logical_axes(self) -> dict:
        """The logical axes of every parameter, read from the Params' metadata (a tree shaped like params)."""
        return jax.tree.map(lambda v: v.get_metadata()["logical_axes"], self.params, is_leaf=_is_param)

    def engram_ids(self, tokens, history=None):
        """Host-side Engram rows for concrete tokens [B, T] (None when the model has no Engram layer)."""
        return paths.engram_ids(self.cfg, tokens, history)

    def __call__(self, tokens, *, engram_ids=None, **kw):
        """(a) logits at every position, [B, T, V] f32. Traceable when `engram_ids` is given."""
        return paths.forward(self.cfg, self.pure_params(), tokens, engram_ids=engram_ids, **kw)

    def ced_prefill(self, tokens, **kw):
        return paths.ced_prefill(self.cfg, self.pure_params(), tokens, **kw)

    def decode_step(self, state, token, **kw):
        return paths.decode_step(self.cfg, self.pure_params(), state, token, **kw)

    def write_context(self, rings: dspark.DraftRings, x, pos, valid) -> dspark.DraftRings:
        """dspark.write_context: the DSpark rings with feature rows x at pos (where valid) appended."""
        return dspark.write_context(self.cfg, self.pure_params(), rings, x, pos, valid)

    def propose(self, rings: dspark.DraftRings, anchor, pos, key, temperature, **kw) -> dspark.Proposal:
        """dspark.propose: k draft tokens after `anchor` (at position pos) with their distributions."""
        return dspark.propose(self.cfg, self.pure_params(), rings, anchor, pos, key, temperature, **kw)


def create(cfg: ModelConfig, seed: int = 0) -> DSV41:
    """Random model built on the default device (parameters never materialised on the host)."""
    return nnx.jit(lambda: DSV41(cfg, seed=seed))()
