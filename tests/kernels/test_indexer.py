"""Paged lightning-indexer kernel (pallas_kernels/indexer): the jnp reference against the model's index_scores
on keys written by the model's PagedKV (bit-exact), the kernel (interpret mode) against the reference (full
scan and candidate subsets, ratio 1 and 2, T = 1 and 2, visible cutting a block, -1 blocks, unused pages and
unwritten bytes poisoned with 0xFF), the selection helpers against the model's mask-based functions, and
lowerings of the full-shape kernel for the H200.

Interpret mode fills every output element the kernel does not write with NaN, so "no NaN anywhere" checks
that every column is written; masked columns must be exactly -inf and all others finite.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import attention as A
from dsv41_jax import quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.kv_cache import PAGE_TOKENS, PagedGlobal, PagedKV, PageLayout
from dsv41_jax.kv_format import index_entry_bytes
from dsv41_jax.layers import F32, dense, linear
from dsv41_jax.rope import apply_rope, layer_freqs
from pallas_kernels import common
from pallas_kernels.indexer import kernel as K

INTERPRET = jax.default_backend() == "cpu"  # on a GPU (JAX_PLATFORMS=cuda) the kernels run compiled

HI, DI = 32, 128
CFG = ModelConfig.preset("tiny", index_n_heads=HI, index_head_dim=DI)
MAX_PAGES = 4
# XLA:CPU's YNN fusions compute `bf16 multiply -> f32 -> reduce` without the bf16 rounding of the product (even
# with excess precision off); the model's index_scores has exactly that pattern. Compile the model side without
# them so that it keeps its stated rounding points (the reference uses reduce_precision and needs no option).
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""} if jax.default_backend() == "cpu" else None
# everything below runs jitted: op-by-op dispatch of the quantizers and references costs seconds on 2 cores
_qdq_idx = jax.jit(lambda x: quant.fp4_qdq(x, 32, "ue8m0"))
_qdq_lat = jax.jit(lambda x: quant.fp4_qdq(x, 16, "e4m3"))
def _bundles(q, w, pages, table, blocks, visible, region, ratio, block_size=8):
    """The kernel's operand bundles, with the page layout of the model's kv_format."""
    return (K.IndexerOperands(q=q, w=w, blocks=blocks, visible=visible, ratio=ratio, block_size=block_size),
            K.PagedIndexKV(pages=pages, page_table=table, region=region, page_tokens=PAGE_TOKENS,
                           entry_bytes=index_entry_bytes(CFG)))


def _scores(*args, ratio, block_size=8, **kw):
    return K.index_scores_paged(*_bundles(*args, ratio, block_size), **kw)


_ref_jit = jax.jit(K.ref_index_scores_paged)


def _ref(*args, ratio, block_size=8):
    return _ref_jit(*_bundles(*args, ratio, block_size))


def _paged(ratio, lens, seed):
    """A 0xFF-poisoned page pool holding lens[b] random (FP4-exact) index keys of sequence b, written by the
    model's PagedKV. Table slots past a sequence's pages point at the (poisoned) null page 0; two pages are
    never used."""
    rng = np.random.default_rng(seed)
    layout = PageLayout.for_config(CFG)
    n = PAGE_TOKENS // ratio
    B = len(lens)
    need = [-(-L // n) for L in lens]
    P = 1 + sum(need) + 2
    perm = rng.permutation(np.arange(1, P))
    table = np.zeros((B, MAX_PAGES), np.int32)
    i = 0
    for b, m in enumerate(need):
        table[b, :m] = perm[i:i + m]
        i += m
    state = PagedGlobal(jnp.full((P, layout.page_bytes), 0xFF, jnp.uint8), jnp.asarray(table))
    G = max(lens)
    mag = rng.uniform(0.05, 20.0, (B, G, 1))
    k = _qdq_idx(jnp.asarray(rng.standard_normal((B, G, DI)) * mag, jnp.bfloat16))
    lat = _qdq_lat(jnp.asarray(rng.standard_normal((B, G, CFG.head_dim)), jnp.bfloat16))
    j = np.broadcast_to(np.arange(G, dtype=np.int32), (B, G))
    ok = j < np.asarray(lens)[:, None]
    write = jax.jit(lambda st, lat, k, j, ok: PagedKV(layout).write(st, ratio, 0, lat, k, j, ok))
    state = write(state, lat, k, jnp.asarray(j), jnp.asarray(ok))
    return layout, state, jnp.int32(layout.region("idx", ratio, 0)[0])


def _qw(B, T, seed):
    rng = np.random.default_rng(seed)
    q = _qdq_idx(jnp.asarray(rng.standard_normal((B, T, HI, DI)), jnp.bfloat16))
    w = jnp.asarray(rng.standard_normal((B, T, HI)) * 0.05, jnp.bfloat16)
    return q, w


def _check(got, want):
    """Kernel vs reference under the numerics contract: exact masking, values to a bf16 ulp in rare columns."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and not np.isnan(got).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    assert fin.any() and np.isfinite(got[fin]).all()
    rowmax = np.max(np.where(fin, np.abs(want), 0), axis=-1, keepdims=True)
    diff = np.abs(np.where(fin, got, 0) - np.where(fin, want, 0))
    assert (diff <= 2 ** -6 * np.maximum(np.abs(want), rowmax)).all()
    assert (got[fin] != want[fin]).mean() <= 0.01, "more than 1% of the columns differ"


# ----------------------------------------------------------------------------- reference vs the model
@pytest.mark.parametrize("ratio", [1, 2])
def test_ref_matches_model_index_scores(ratio):
    B, T = 2, 2
    lens = [45, 100] if ratio == 1 else [29, 61]
    layout, state, region = _paged(ratio, lens, seed=ratio)
    rng = np.random.default_rng(10 + ratio)
    p = {"wq_b": {"weight": jnp.asarray(rng.standard_normal((HI * DI, CFG.q_lora_rank)) * 0.2, jnp.bfloat16)},
         "weights_proj": jnp.asarray(rng.standard_normal((HI, CFG.dim)) * 0.2, jnp.bfloat16)}
    x = jnp.asarray(rng.standard_normal((B, T, CFG.dim)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((B, T, CFG.q_lora_rank)), jnp.bfloat16)
    vis_want = np.array([[lens[0] - 3, lens[0]], [lens[1] - 1, lens[1]]], np.int32)  # cuts blocks
    qpos = jnp.asarray(vis_want * ratio + ratio - 2, jnp.int32)  # (qpos + 1) // ratio == vis_want
    visible = (qpos + 1) // ratio
    np.testing.assert_array_equal(np.asarray(visible), vis_want)
    freqs = jnp.asarray(layer_freqs(CFG, ratio))

    def model(p, x, qr, qpos, pages, table):
        index_k = PagedKV(layout).index_keys(PagedGlobal(pages, table), ratio, 0)
        return A.index_scores(CFG, p, x, qr, qpos, index_k, ratio, freqs)

    def q_and_w(p, x, qr, qpos):  # the index query and head weights exactly as index_scores builds them
        q = linear(CFG, p["wq_b"], qr).reshape(*qr.shape[:-1], HI, DI)
        q = quant.fp4_qdq(apply_rope(q, qpos, freqs), 32, "ue8m0")
        w = (dense(CFG, p["weights_proj"], x).astype(F32) * jnp.float32(DI ** -0.5 * HI ** -0.5)).astype(jnp.bfloat16)
        return q, w

    want = jax.jit(model, compiler_options=NO_YNN)(p, x, qr, qpos, state.pages, state.page_table)
    q, w = jax.jit(q_and_w, compiler_options=NO_YNN)(p, x, qr, qpos)
    nb = MAX_PAGES * (PAGE_TOKENS // ratio) // 8
    blocks = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, T, nb))
    got = _scores(q, w, state.pages, state.page_table, blocks, visible, region, ratio=ratio,
                               implementation="xla")  # the public entry's XLA branch is the reference
    want = np.asarray(want)
    assert np.isfinite(want).sum() == vis_want.sum() and np.isneginf(want).sum() == want.size - vis_want.sum()
    np.testing.assert_array_equal(np.asarray(got), want)


# ----------------------------------------------------------------------------- kernel (interpret) vs reference
@pytest.mark.parametrize("ratio,T", [(1, 1), (2, 2)])
def test_kernel_full_scan(ratio, T):
    lens = [45, 100] if ratio == 1 else [29, 61]
    _, state, region = _paged(ratio, lens, seed=20 + ratio)
    B = len(lens)
    q, w = _qw(B, T, seed=ratio)
    vis = np.array(lens, np.int32)[:, None] - np.arange(T - 1, -1, -1, dtype=np.int32)[None]  # last row = len
    nb = MAX_PAGES * (PAGE_TOKENS // ratio) // 8
    blocks = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, T, nb))
    args = (q, w, state.pages, state.page_table, blocks, jnp.asarray(vis), region)
    want = _ref(*args, ratio=ratio)
    got = _scores(*args, ratio=ratio, interpret=INTERPRET, entries=64)
    _check(got, want)
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)).sum(axis=-1), vis)


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_head_partials_sum_to_the_scores(n_ranks):
    """Tensor parallelism (dsv41_jax.parallel.tp_paged_index_scores): each rank's heads scored without the final
    rounding (`head_partial`; 8 heads per rank at 4 ranks are padded to the dot's 16 with zero weights), summed
    over the ranks in f32, then rounded once: equal to the one-device kernel."""
    ratio, T, lens = 2, 1, [29, 61]
    _, state, region = _paged(ratio, lens, seed=31)
    B = len(lens)
    q, w = _qw(B, T, seed=5)
    nb = MAX_PAGES * (PAGE_TOKENS // ratio) // 8
    blocks = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, T, nb))
    vis = jnp.asarray(np.array(lens, np.int32)[:, None])
    rest = (state.pages, state.page_table, blocks, vis, region)
    want = np.asarray(_scores(q, w, *rest, ratio=ratio, interpret=INTERPRET, entries=64))
    h = HI // n_ranks
    parts = [_scores(q[:, :, r * h:(r + 1) * h], w[:, :, r * h:(r + 1) * h], *rest, ratio=ratio,
                     interpret=INTERPRET, entries=64, head_partial=True) for r in range(n_ranks)]
    got = np.asarray(K.round_bf16(sum(parts[1:], parts[0])))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[fin], want[fin])


@pytest.mark.parametrize("ratio,T", [(1, 2), (2, 1)])
def test_kernel_candidate_subset(ratio, T):
    """Ascending block subsets with -1 padding, blocks past `visible`, a column count that is not a multiple of
    the tile, and the shared-blocks form [B, 1, nb] (T = 2)."""
    lens = [70, 180] if ratio == 1 else [40, 90]
    _, state, region = _paged(ratio, lens, seed=30 + ratio)
    B = len(lens)
    q, w = _qw(B, T, seed=5 + ratio)
    rng = np.random.default_rng(ratio)
    nb_all = MAX_PAGES * (PAGE_TOKENS // ratio) // 8
    nbc = 12  # 96 columns: padded to 2 tiles of 64
    rows = 1 if T > 1 else T
    blocks = np.full((B, rows, nbc), -1, np.int32)
    for b in range(B):
        for t in range(rows):
            avail = -(-lens[b] // 8) + 1  # every block holding a written entry, and one past the end
            m = min(9 - b, avail)  # then -1 padding
            pick = np.sort(rng.choice(avail, size=m, replace=False))
            blocks[b, t, :m] = pick
    vis = np.array(lens, np.int32)[:, None] - np.arange(T - 1, -1, -1, dtype=np.int32)[None] * 5
    args = (q, w, state.pages, state.page_table, jnp.asarray(blocks), jnp.asarray(vis), region)
    want = _ref(*args, ratio=ratio)
    got = _scores(*args, ratio=ratio, interpret=INTERPRET, entries=64)
    _check(got, want)
    # the scored entries are exactly blocks*8+u below visible
    bb = np.broadcast_to(blocks, (B, T, nbc))
    ent = (bb[..., None] * 8 + np.arange(8)).reshape(B, T, -1)
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), (bb[..., None] >= 0).repeat(8, -1).reshape(
        B, T, -1) & (ent < vis[..., None]))
    assert nb_all > int(blocks.max())


def test_kernel_ignores_poisoned_bytes_and_entry_tiles():
    """Only the scored entries' own bytes matter: re-poisoning every byte outside the written index keys (other
    regions, unused pages, the null page) changes nothing, and tiles of 32 and 128 columns agree."""
    ratio = 1
    layout, state, region = _paged(ratio, [37, 130], seed=7)
    q, w = _qw(2, 1, seed=9)
    nb = MAX_PAGES * PAGE_TOKENS // 8
    blocks = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (2, 1, nb))
    vis = jnp.asarray([[37], [130]], jnp.int32)
    got = _scores(q, w, state.pages, state.page_table, blocks, vis, region, ratio=ratio,
                               interpret=INTERPRET, entries=32)
    # poison everything except the written index-key bytes
    pages = np.asarray(state.pages).copy()
    keep = np.zeros_like(pages, bool)
    table = np.asarray(state.page_table)
    off, n, eb = layout.region("idx", ratio, 0)
    for b, L in enumerate([37, 130]):
        for e in range(L):
            keep[table[b, e // n], off + (e % n) * eb: off + (e % n + 1) * eb] = True
    pages[~keep] = 0xFF
    got2 = _scores(q, w, jnp.asarray(pages), state.page_table, blocks, vis, region, ratio=ratio,
                                interpret=INTERPRET, entries=128)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(got2))
    _check(got, _ref(q, w, state.pages, state.page_table, blocks, vis, region,
                                         ratio=ratio))


def test_implementation_switch():
    with pytest.raises(ValueError):
        _scores(*(jnp.zeros((1, 1, HI, DI), jnp.bfloat16), jnp.zeros((1, 1, HI), jnp.bfloat16),
                               jnp.zeros((2, 64), jnp.uint8), jnp.zeros((1, 1), jnp.int32),
                               jnp.zeros((1, 1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32), jnp.int32(0)),
                             ratio=1, implementation="triton")


# ----------------------------------------------------------------------------- selection helpers vs the model
def _scores_with_ties(B, T, C, visible, seed):
    rng = np.random.default_rng(seed)
    s = rng.integers(-6, 7, (B, T, C)).astype(np.float32) * 0.5  # few distinct values: many ties
    return jnp.asarray(np.where(np.arange(C) < np.asarray(visible)[..., None], s, -np.inf), jnp.float32)


@pytest.mark.parametrize("ratio", [1, 2])
def test_selection_helpers_match_model(ratio):
    n_keep, bs, k = 5, 8, 24  # (n_keep - 1) * bs + 1 >= k
    cfg = CFG.replace(candidate_topk_blocks=n_keep, candidate_block_size=bs, index_topk=k)
    B, T, C = 2, 4, 96
    qpos = jnp.asarray([[0, 9, 30, 50], [60, 70, 80, 95 * ratio]], jnp.int32)  # from no visible entry to all
    visible = (qpos + 1) // ratio
    s20 = _scores_with_ties(B, T, C, visible, seed=ratio)  # candidate-source (layer 20) full scan
    mask = jax.jit(lambda s, p: A.candidate_blocks(cfg, s, p, ratio))(s20, qpos)
    ids = jax.jit(lambda s, v: A.candidate_block_ids(s, v, n_keep=n_keep, block_size=bs))(s20, visible)
    ids_np = np.asarray(ids)
    assert ids.shape == (B, T, n_keep)
    got_mask = np.zeros(mask.shape, bool)
    for b in range(B):
        for t in range(T):
            row = ids_np[b, t]
            v = row[row >= 0]
            assert (np.diff(v) > 0).all() and (row[len(v):] == -1).all()  # ascending, -1 padded at the end
            got_mask[b, t, v] = True
    np.testing.assert_array_equal(got_mask, np.asarray(mask))

    s24 = _scores_with_ties(B, T, C, visible, seed=10 + ratio)  # a Reindex layer's scores
    want = jax.jit(lambda s, m, p: A.select_topk(cfg, A.mask_to_candidates(s, m, bs), p, ratio))(s24, mask, qpos)
    # the kernel's output for these blocks: column c*8+u = entry ids[c]*8+u (-inf for -1 / not visible)
    ent = (ids_np[..., None] * bs + np.arange(bs)).reshape(B, T, -1)
    ok = (np.repeat(ids_np, bs, -1) >= 0) & (ent < np.asarray(visible)[..., None])
    cand = np.where(ok, np.take_along_axis(np.asarray(s24), np.clip(ent, 0, C - 1), -1), -np.inf)
    got = jax.jit(lambda c, i, v: A.select_topk_entries(c, i, v, k=min(k, C)))(jnp.asarray(cand, jnp.float32), ids,
                                                                               visible)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- lowering for the H200
@pytest.mark.parametrize("nb,T,shared", [(2048, 1, False), (4096, 1, False), (1024, 2, True)])
def test_full_shape_lowers_for_h200(nb, T, shared):
    """Candidates (2048 blocks, 32K context), a full scan of 4096 blocks, and a prefill full scan with shared
    blocks; the page size of the full model (56960 B, index region at 52608)."""
    sds = jax.ShapeDtypeStruct
    B, P, page_bytes, max_pages = 2, 1024, 56960, 512
    args = (sds((B, T, HI, DI), jnp.bfloat16), sds((B, T, HI), jnp.bfloat16), sds((P, page_bytes), jnp.uint8),
            sds((B, max_pages), jnp.int32), sds((B, 1 if shared else T, nb), jnp.int32), sds((B, T), jnp.int32),
            sds((), jnp.int32))
    text = common.lower_for_h200(lambda *a: _scores(*a, ratio=1, interpret=False), *args)
    assert "triton" in text and "index_scores_paged" in text
