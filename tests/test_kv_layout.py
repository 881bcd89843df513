"""The kernels hold no KV layout of their own: the page size and every entry size reach them as static arguments
from dsv41_jax.kv_format / kv_cache.PageLayout (through the ops seam), and they refuse a layout whose byte
format they cannot decode. Fails if the kernels and the layout disagree."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import kv_format, ops
from dsv41_jax.kv_cache import KVState, PagedGlobal, PagedKV, PageLayout, SwaPool
from pallas_kernels import indexer as index_kernel
from pallas_kernels.indexer import kernel as index_src
from pallas_kernels.sparse_attention import kernel as attn_src

sds = jax.ShapeDtypeStruct


def test_kernels_define_no_page_size():
    for mod in (index_src, attn_src):
        src = inspect.getsource(mod)
        assert "PAGE_TOKENS" not in src and "page_tokens" in src, mod.__name__


def _attention_shapes(cfg, layout, B=2, T=1, k=64, P=8, max_pages=4):
    d, H = cfg.head_dim, cfg.n_heads
    a = ops.AttentionOperands(q=sds((B, T, H, d), jnp.bfloat16), chunk_kv=sds((B, T, d), jnp.bfloat16),
                              pos0=sds((B,), jnp.int32), clip=sds((B,), jnp.int32), sel=sds((B, T, k), jnp.int32),
                              sink=sds((H,), jnp.float32), layer=sds((), jnp.int32), src=sds((), jnp.int32),
                              ratio=1)
    swa = SwaPool(sds((cfg.n_layers, B + 1, cfg.window_size, kv_format.swa_entry_bytes(cfg)), jnp.uint8),
                  sds((B,), jnp.int32))
    state = KVState(swa, PagedGlobal(sds((P, layout.page_bytes), jnp.uint8), sds((B, max_pages), jnp.int32)), None)
    return a, state


def test_attention_kernel_reads_the_layout(tiny):
    cfg = tiny.replace(window_size=64)
    layout = PageLayout.for_config(cfg)
    assert layout.entry_bytes("lat") == kv_format.latent_entry_bytes(cfg) == cfg.head_dim // 2 + cfg.head_dim // 16
    a, state = _attention_shapes(cfg, layout)
    ex = ops.ExecContext(kv=PagedKV(layout), kernels="pallas")
    out = jax.eval_shape(lambda a, s: ops.csa_attention(ex, cfg, a, s), a, state)  # the kernel accepts the layout
    assert out.shape == a.q.shape
    # a layout with another latent size is refused by the kernel, not misread
    bad = PageLayout(tuple((key, (off, n, eb + 16 if key[0] == "lat" else eb)) for key, (off, n, eb) in layout.regions),
                     layout.page_bytes, layout.fmt, layout.head_dim, layout.index_head_dim)
    ex_bad = ops.ExecContext(kv=PagedKV(bad), kernels="pallas")
    with pytest.raises(ValueError, match="latent entries"):
        jax.eval_shape(lambda a, s: ops.csa_attention(ex_bad, cfg, a, s), a, state)


def test_ring_pool_entries_are_the_kernels(tiny):
    """The engine's ring entry (kv_format.swa_pack) has the size the attention kernel reads; another is refused."""
    cfg = tiny.replace(window_size=64)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, cfg.head_dim)), jnp.float32)
    assert kv_format.swa_pack(cfg, x).shape[-1] == kv_format.swa_entry_bytes(cfg)
    layout = PageLayout.for_config(cfg)
    a, state = _attention_shapes(cfg, layout)
    pool = state.swa.pool
    wide = KVState(SwaPool(sds((*pool.shape[:-1], pool.shape[-1] + 16), jnp.uint8), state.swa.slots), state.glob,
                   None)
    ex = ops.ExecContext(kv=PagedKV(layout), kernels="pallas")
    with pytest.raises(ValueError, match="ring entries"):
        jax.eval_shape(lambda a, s: ops.csa_attention(ex, cfg, a, s), a, wide)


@pytest.mark.parametrize("fmt_ok", [True, False])
def test_indexer_kernel_reads_the_layout(tiny, fmt_ok):
    cfg = tiny
    layout = PageLayout.for_config(cfg)
    di, Hi = cfg.index_head_dim, cfg.index_n_heads
    assert layout.entry_bytes("idx") == kv_format.index_entry_bytes(cfg) == index_src.decoded_entry_bytes(di)
    B, T, nb = 1, 1, 4
    a = index_kernel.IndexerOperands(q=sds((B, T, Hi, di), jnp.bfloat16), w=sds((B, T, Hi), jnp.bfloat16),
                                     blocks=sds((B, T, nb), jnp.int32), visible=sds((B, T), jnp.int32), ratio=1,
                                     block_size=8)
    eb = layout.entry_bytes("idx") + (0 if fmt_ok else 4)
    kv = index_kernel.PagedIndexKV(pages=sds((4, layout.page_bytes), jnp.uint8), page_table=sds((B, 2), jnp.int32),
                                   region=sds((), jnp.int32), page_tokens=layout.page_tokens, entry_bytes=eb)
    if fmt_ok:
        assert jax.eval_shape(lambda a, kv: index_kernel.index_scores_paged(a, kv), a, kv).shape == (B, T, nb * 8)
    else:
        with pytest.raises(ValueError, match="index-key entries"):
            jax.eval_shape(lambda a, kv: index_kernel.index_scores_paged(a, kv), a, kv)
