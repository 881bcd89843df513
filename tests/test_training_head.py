"""ops.TrainHooks.head_bf16: the training step's LM head GEMM takes bf16 operands. In training they are bf16
values already (the bf16 compute's hidden rows, the QAT view's bf16 head), so the logits change only by the
f32 accumulation order (measured once on this test's case: 3e-8 relative)."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops import TrainHooks


def test_head_bf16_rounds_only_the_head_operands():
    """The traced training forward of the tiny preset, with and without the hook."""
    from dsv41_jax.engram_hash import EngramHasher
    from training import data as D
    from training import objective as O

    cfg = ModelConfig.preset("tiny")
    masters = jax.jit(lambda: O.init_masters(cfg, 0))()
    params = O.qat_params(cfg, masters)
    win = np.random.default_rng(1).integers(1, cfg.vocab_size, (1, 25)).astype(np.int32)
    tokens, ids, _, _ = D.host_batch(cfg, EngramHasher(cfg), win)

    def fwd(hooks):
        return lambda p: O.full_forward(cfg, p, tokens, ids, hooks)[0]

    served, hooked = TrainHooks(balance=False), TrainHooks(balance=False, head_bf16=True)
    V = cfg.vocab_size

    def head_dots(hooks):
        """The dots producing [..., V] logits: their operand dtypes and, per operand, the dtype it was converted
        from (None: not a conversion)."""
        jaxpr = jax.make_jaxpr(fwd(hooks))(params).jaxpr
        src = {id(e.outvars[0]): e for e in jaxpr.eqns}
        out = []
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == V:
                prev = [src.get(id(v)) for v in e.invars]
                out.append((tuple(str(v.aval.dtype) for v in e.invars),
                            tuple(str(p.invars[0].aval.dtype) if p is not None and p.primitive.name ==
                                  "convert_element_type" else None for p in prev)))
        return out

    # served: f32 operands holding bf16 values (the hidden rows converted from bf16; the QAT view's head rounded
    # to bf16), so the bf16 GEMM with f32 accumulation computes the same products; hooked: the bf16 GEMM
    assert head_dots(served) == [(("float32", "float32"), ("bfloat16", None))], head_dots(served)
    w = np.asarray(params["head"]["weight"])
    assert np.array_equal(np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)), w) and np.std(w) > 0
    assert [d for d, _ in head_dots(hooked)] == [("bfloat16", "bfloat16")], head_dots(hooked)
