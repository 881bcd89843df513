"""The Flax NNX module is honest: nnx.jit of its forward equals the pure path, its Params carry the logical
axes the checkpoint code places weights by, and it round-trips through nnx.split / merge."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from checkpoints.sharding import module_shardings, param_shardings
from dsv41_jax import paths
from dsv41_jax.nnx_model import DSV41
from dsv41_jax.params import param_axes


@pytest.fixture(scope="module")
def model(tiny, tiny_params):
    return DSV41(tiny, params=tiny_params)


def test_nnx_jit_forward_equals_the_pure_path(model, tiny, tiny_params, tokens):
    toks = tokens[:, :24]
    ids = model.engram_ids(toks)
    fwd = nnx.jit(lambda m, t, i: m(t, engram_ids=i))
    got = np.asarray(fwd(model, toks, ids))
    want = np.asarray(paths.forward(tiny, tiny_params, toks))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="engram_ids"):  # under a trace the host hashing cannot run
        nnx.jit(lambda m, t: m(t))(model, toks)
    graphdef, state = nnx.split(model)
    again = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(fwd(again, toks, ids)), want)


def test_params_carry_logical_axes_used_for_placement(model, tiny):
    axes = model.logical_axes()
    want = param_axes(tiny)
    assert jax.tree.structure(axes, is_leaf=lambda v: isinstance(v, tuple)) == \
        jax.tree.structure(want, is_leaf=lambda v: isinstance(v, tuple))
    for a, b, x in zip(jax.tree.leaves(axes, is_leaf=lambda v: isinstance(v, tuple)),
                       jax.tree.leaves(want, is_leaf=lambda v: isinstance(v, tuple)),
                       jax.tree.leaves(model.pure_params())):
        assert tuple(a) == tuple(b) and len(a) == x.ndim
    assert model.params["layers"]["ffn"]["experts"]["w1"]["weight"].get_metadata()["logical_axes"][:2] == \
        ("layers", "experts")
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    from_module = module_shardings(model, mesh)
    from_specs = param_shardings(tiny, mesh)
    for a, b in zip(jax.tree.leaves(from_module), jax.tree.leaves(from_specs)):
        assert a.spec == b.spec
    assert from_module["layers"]["ffn"]["experts"]["w2"]["weight"].spec == PartitionSpec(None, "expert")
    assert from_module["embed"]["weight"].spec == PartitionSpec()
