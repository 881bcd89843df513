"""The sharded branches of the ops seam: every `jax.shard_map` of the project lives here, and only
`dsv41_jax.ops` calls these functions (layouts and rules: dsv41_jax.sharding).

Tensor parallelism (axis "tensor", N ranks; each op wraps its own shard_map, activations outside are
replicated or head-sharded and XLA's partitioner carries them between ops):
- column-parallel linear (wq_b): the rank's rows of the weight, output split on its last dim;
- row-parallel linear (WO-B): the rank's columns, f32 partial products summed with one psum, then rounded;
- attention: the rank's query heads (and sinks) over the replicated latent KV / rings / pages;
- WO-A: the rank's output groups (N divides o_groups, so a rank's heads are whole groups);
- indexer: the rank's index heads; per-rank partial head sums (f32) are psum'd before the final bf16
  rounding, then the top-k runs replicated (the XLA scores, or the paged Pallas kernel's head partials);
- the replicated ops' Pallas kernels (mHC boundary, router, ring write, unsplit linears): every rank runs the
  kernel on whole operands inside a shard_map (`replicated`);
- MoE: gate replicated; routed and shared experts on the rank's slice of the intermediate dim, their f32
  partial outputs summed, one psum of [n, D], rounded once.
Each local computation is the single-device implementation on the rank's shard, so with N = 1 every op is
the single-device op bit for bit (psum of one term is the identity; the MoE keeps the reference's per-expert
rounding when N = 1). With N > 1 the psums' summation order differs, and the MoE rounds the sum of its
experts once instead of each expert's output (the reference's per-expert bf16 rounding cannot be applied to a
partial sum): measured on CPU, f32 compute agrees to ~5e-6; bf16 is within the model's own bf16 noise.

Data parallelism (axis "data"): `data_parallel` wraps a whole per-rank program (the engine's step) in one
shard_map; inside it every op is local except the DEP MoE (`ep_moe`): tokens are dispatched to the ranks that
own their experts and combined back, with
- "padded": all_to_all of [N, C, D] blocks (C rows per destination; lossless C = n*k by default);
- "ragged": lax.ragged_all_to_all into a receive buffer of R rows (GPU; XLA:CPU does not implement it);
- "emulated": the ragged bookkeeping with the transport built from all_gather (CPU tests of the offsets).
Routing weights travel with the rows and the owner runs the single-device expert implementation (k = 1 per
row), so every expert output is rounded exactly as on one device and the sender adds them in the reference's
order: DEP equals the single-device MoE up to XLA's GEMM blocking. Rows past the capacity are dropped and
counted; padding rows (beyond n_valid) are never sent.
"""

from __future__ import annotations

from dataclasses import fields, replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dsv41_jax import attention as attn
from dsv41_jax import layers, quant
from dsv41_jax.params import expert_weight, lin_weight
from dsv41_jax.sharding import DATA, TENSOR
from dsv41_jax.weights import LayerRef, materialize

F32 = jnp.float32


# ----------------------------------------------------------------------------- helpers
def _spec_at(ndim: int, dim: int | None, axis: str) -> P:
    """PartitionSpec splitting `dim` (negative: from the end) over `axis`; None: replicated."""
    if dim is None:
        return P()
    spec = [None] * ndim
    spec[dim % ndim] = axis
    return P(*spec)


def _split_tree(tree, dim: int, axis: str = TENSOR):
    return jax.tree.map(lambda a: _spec_at(a.ndim, dim, axis), tree)


def _rep(tree):
    return jax.tree.map(lambda _: P(), tree)


def _unref(p):
    """(stack tree, layer index or None) of a LayerRef or a plain tree."""
    return (p.stack, p.index) if isinstance(p, LayerRef) else (p, None)


def _ref(stack, index):
    return stack if index is None else LayerRef(stack, index)


def _smap(ex, body, args: dict, specs: dict, out_specs):
    """shard_map `body(**args)` over ex.mesh; None-valued args are passed through as None."""
    live = {k: v for k, v in args.items() if v is not None}
    dead = {k: None for k, v in args.items() if v is None}

    def f(live_args):
        return body(**live_args, **dead)

    return jax.shard_map(f, mesh=ex.mesh, in_specs=({k: specs[k] for k in live},), out_specs=out_specs,
                         check_vma=False)(live)


# ----------------------------------------------------------------------------- tensor parallelism
def tp_linear(ex, cfg, p, x, split: str, local, local_f32):
    """Column- ("column": output rows split) or row-parallel ("row": input columns split, psum) linear.
    `local(cfg, p, x)` / `local_f32(cfg, p, x)` are the single-device implementations (compute dtype / f32)."""
    stack, index = _unref(p)
    nd = x.ndim
    if split == "column":
        def body(stack, index, x):
            return local(cfg, _ref(stack, index), x)

        return _smap(ex, body, dict(stack=stack, index=index, x=x),
                     dict(stack=_split_tree(stack, -2), index=P(), x=P()), _spec_at(nd, -1, TENSOR))
    if split != "row":
        raise ValueError(f"split must be 'column' or 'row', got {split!r}")

    def body(stack, index, x):
        return lax.psum(local_f32(cfg, _ref(stack, index), x), TENSOR).astype(layers.cdtype(cfg))

    return _smap(ex, body, dict(stack=stack, index=index, x=x),
                 dict(stack=_split_tree(stack, -1), index=P(), x=_spec_at(nd, -1, TENSOR)), P())


def _bundle_specs(bundle, axis: str = TENSOR):
    """shard_map specs of an operand bundle (pallas_kernels.common.operands), derived from its fields' metadata:
    `heads` fields split over `axis` at their heads dim, every other array field replicated."""
    dims = {f.name: f.metadata.get("heads") for f in fields(bundle) if not f.metadata.get("static")}
    return replace(bundle, **{name: None if getattr(bundle, name) is None
                              else _spec_at(getattr(bundle, name).ndim, dim, axis) if dim is not None
                              else _rep(getattr(bundle, name)) for name, dim in dims.items()})


def tp_attention(ex, local, cfg, a, state):
    """The rank's heads of `ops.csa_attention` (the operands' heads fields split; the KV state replicated)."""
    out = _spec_at(4, 2, TENSOR)
    return jax.shard_map(lambda a, state: local(cfg, a, state), mesh=ex.mesh,
                         in_specs=(_bundle_specs(a), _rep(state)), out_specs=out, check_vma=False)(a, state)


def tp_grouped_out_proj(ex, local, cfg, w, o):
    """WO-A on the rank's output groups: o [B,T,G,din] and the weight's G*oL rows split."""
    stack, index = _unref(w)

    def body(stack, index, o):
        return local(cfg, _ref(stack, index), o)

    return _smap(ex, body, dict(stack=stack, index=index, o=o),
                 dict(stack=_spec_at(stack.ndim, -2, TENSOR), index=P(), o=_spec_at(4, 2, TENSOR)),
                 _spec_at(4, 2, TENSOR))


def tp_index_scores(ex, cfg, p, a, index_k, local):
    """`attention.index_scores` with the index heads split: each rank sums its heads' rounded terms in f32,
    one psum adds the ranks, then the reference's final rounding and visibility mask (replicated). The
    operands `a` (ops.IndexerInputs) and the keys are replicated; the rank's rows of wq_b / weights_proj give
    its heads."""
    stack, index = _unref(p)
    sub = {"wq_b": stack["wq_b"], "weights_proj": stack["weights_proj"]}
    dt = layers.cdtype(cfg)

    def body(sub, index, a, index_k):
        q, w = attn.index_query(cfg, _ref(sub, index), a.x, a.qr, a.qpos, a.freqs, lin=local)
        return lax.psum(jnp.sum(attn.index_head_terms(q, w, index_k, dt), axis=2), TENSOR)

    s = jax.shard_map(body, mesh=ex.mesh, in_specs=(_split_tree(sub, -2), P(), _rep(a), P()), out_specs=P(),
                      check_vma=False)(sub, index, a, index_k)
    return attn.visible_scores(attn.round_to(dt)(s), a.qpos, a.ratio)


def tp_paged_index_scores(ex, cfg, p, a, keys, score, lin_local):
    """The paged (Pallas) indexer with the index heads split: each rank computes its heads' queries (its rows of
    wq_b / weights_proj) and `score(q, w, keys)`: the f32 sum of its heads' rounded terms over the replicated
    paged keys (-inf where masked, no final rounding); one psum adds the ranks, then the reference's bf16
    rounding (exact: the ranks' partial sums of bf16 terms are exact in f32 at the model's scales, see
    pallas_kernels/indexer). `keys`: the replicated pytree `score` reads (pages, page table, blocks, ...)."""
    stack, index = _unref(p)
    sub = {"wq_b": stack["wq_b"], "weights_proj": stack["weights_proj"]}

    def body(sub, index, a, keys):
        q, w = attn.index_query(cfg, _ref(sub, index), a.x, a.qr, a.qpos, a.freqs, lin=lin_local)
        return lax.psum(score(q, w, keys), TENSOR)

    s = jax.shard_map(body, mesh=ex.mesh, in_specs=(_split_tree(sub, -2), P(), _rep(a), _rep(keys)), out_specs=P(),
                      check_vma=False)(sub, index, a, keys)
    return attn.round_to(layers.cdtype(cfg))(s)


def replicated(ex, fn, *args):
    """fn(*args) on every tensor-parallel rank with every operand whole (all-gathered if it was split): how the
    Pallas kernels of the replicated ops run under TP, inside a shard_map rather than through the SPMD
    partitioner. LayerRef arguments travel as (stack, index); the result is replicated."""
    flat = [(a.stack, a.index) if isinstance(a, LayerRef) else a for a in args]
    is_ref = [isinstance(a, LayerRef) for a in args]

    def body(*xs):
        return fn(*(LayerRef(*x) if r else x for x, r in zip(xs, is_ref)))

    return jax.shard_map(body, mesh=ex.mesh, in_specs=tuple(_rep(a) for a in flat), out_specs=P(),
                         check_vma=False)(*flat)


def tp_moe(ex, cfg, p, x2, w, idx, lin_local):
    """Routed + shared experts on the rank's slice of the intermediate dim; their f32 outputs summed, one
    psum, rounded once by the caller. x2 [n, D], routing (w, idx) [n, k] replicated. Returns f32 [n, D].
    With one rank the reference's roundings (each expert's output, the shared expert's output) are kept, so a
    mesh of size 1 is the single-device MoE bit for bit."""
    ex_stack, index = _unref(p["experts"])
    sh_stack, _ = _unref(p["shared"])
    ex_specs = {"w1": _split_tree(ex_stack["w1"], -2), "w3": _split_tree(ex_stack["w3"], -2),
                "w2": _split_tree(ex_stack["w2"], -1)}
    sh_specs = {"w1": _split_tree(sh_stack["w1"], -2), "w3": _split_tree(sh_stack["w3"], -2),
                "w2": _split_tree(sh_stack["w2"], -1)}
    exact = ex.parallel.size == 1
    dt = layers.cdtype(cfg)

    def body(ex_stack, sh_stack, index, x2, w, idx):
        y = _routed_experts_f32(cfg, _ref(ex_stack, index), x2, w, idx, round_each=exact)
        sp = _ref(sh_stack, index)
        h = layers.swiglu(cfg, lin_local(cfg, sp["w1"], x2), lin_local(cfg, sp["w3"], x2)).astype(x2.dtype)
        sh = layers.mm(layers.act_qdq(cfg, h, materialize(sp["w2"])), lin_weight(materialize(sp["w2"]), dt),
                       "...i,oi->...o")
        return lax.psum(y + (sh.astype(dt).astype(F32) if exact else sh), TENSOR)

    return _smap(ex, body, dict(ex_stack=ex_stack, sh_stack=sh_stack, index=index, x2=x2, w=w, idx=idx),
                 dict(ex_stack=ex_specs, sh_stack=sh_specs, index=P(), x2=P(), w=P(), idx=P()), P())


def rows_by_expert(cfg, p, x, idx):
    """The reference's routing prelude: (order, tok, sizes, xs, quantized): the (token, slot) pairs sorted by
    expert (stable), each pair's token, rows per expert, the sorted input rows in the compute dtype (FP8
    round-tripped when the experts are quantized), and whether they are."""
    dt = layers.cdtype(cfg)
    k = idx.shape[-1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=cfg.n_routed_experts).astype(jnp.int32)
    quantized = cfg.qdq and layers.is_quantized(p["w1"])
    xs = (quant.fp8_qdq(x.astype(dt), 32) if quantized else x.astype(dt))[tok]
    return order, tok, sizes, xs, quantized


def _routed_experts_f32(cfg, p, x, weights, idx, round_each: bool):
    """`layers.routed_experts` on a slice of the intermediate dim, returning the f32 partial sums: each
    expert's w2 output is rounded to the compute dtype only when `round_each` (one rank: the reference)."""
    p = materialize(p)
    dt = layers.cdtype(cfg)
    N, D = x.shape
    order, tok, sizes, xs, quantized = rows_by_expert(cfg, p, x, idx)
    prec = lax.Precision.HIGHEST if dt == F32 else None
    dn = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[0])

    def gdot(a, wt):
        return lax.ragged_dot_general(a, expert_weight(wt, dt), sizes, dn, precision=prec, preferred_element_type=F32)

    h = layers.swiglu(cfg, gdot(xs, p["w1"]).astype(dt), gdot(xs, p["w3"]).astype(dt))
    h = (h * weights.reshape(-1)[order][:, None]).astype(dt)
    if quantized:
        h = quant.fp8_qdq(h, 32)
    out = gdot(h, p["w2"])
    if round_each:
        out = out.astype(dt).astype(F32)
    return jnp.zeros((N, D), F32).at[tok].add(out)


# ----------------------------------------------------------------------------- data parallelism
def data_parallel(ex, fn, in_specs, out_specs):
    """`fn` run once per data-parallel rank on its block of every argument (the specs say which dims are
    split over "data"); the region inside which `ep_moe` exchanges tokens."""
    return jax.shard_map(fn, mesh=ex.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def gather_rows(x, axis_name: str = DATA):
    """Inside `data_parallel`: every rank's rows [n, ...] as one replicated [N*n, ...] array (a one-hot
    placement plus psum, so the result is invariant across ranks)."""
    N = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    full = jnp.zeros((N * x.shape[0], *x.shape[1:]), x.dtype)
    full = lax.dynamic_update_slice_in_dim(full, x, me * x.shape[0], 0)
    if jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.int32:
        return lax.psum(full.astype(jnp.int32), axis_name).astype(x.dtype)
    return lax.psum(full, axis_name)


def _capacity(par, rows: int, N: int) -> int:
    """Rows one rank may receive per call (lossless: every rank's rows)."""
    if not par.capacity_factor:
        return rows * N if par.a2a != "padded" else rows
    c = int(-(-par.capacity_factor * rows // (1 if par.a2a != "padded" else N)))
    c = -(-c // 8) * 8
    return max(8, min(c, rows * N if par.a2a != "padded" else rows))


def ep_moe(ex, cfg, p, x2, w, idx, valid, experts_local, lin_local):
    """DEP MoE inside `data_parallel`: routed experts split over "data" (p["experts"] holds this rank's E/N),
    tokens exchanged with all-to-all; the shared expert (replicated) runs locally.
    x2 [n, D], (w, idx) [n, k] with global expert ids, valid [n]. Returns (f32 [n, D], rows dropped)."""
    N = lax.axis_size(DATA)
    E = cfg.n_routed_experts
    El = E // N
    n, k = idx.shape
    me = lax.axis_index(DATA)
    live = jnp.repeat(valid, k)
    key = jnp.where(live, idx.reshape(-1), E)  # padding rows sort last and are never sent
    order = jnp.argsort(key, stable=True)
    tok = order // k
    e_sorted = key[order]
    dest = e_sorted // El  # N for padding
    counts = jnp.bincount(dest, length=N).astype(jnp.int32)  # rows per destination (valid only)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.arange(n * k, dtype=jnp.int32) - starts[jnp.minimum(dest, N - 1)]
    xs = x2[tok]
    ws = w.reshape(-1)[order].astype(F32)
    les = jnp.where(dest < N, e_sorted - dest * El, El)  # local expert id at the owner (El: none)
    cfg_l = cfg.replace(n_routed_experts=El)
    p_exp = p["experts"]
    dt = layers.cdtype(cfg)

    def compute(rx, rle, rw):
        """The owner's experts on received rows (one expert per row, weight applied before w2, k = 1)."""
        out = experts_local(cfg_l, p_exp, rx, rw[:, None], rle[:, None])
        return out.astype(dt)  # exact: each row is one expert output already rounded to the compute dtype

    if ex.parallel.a2a == "padded":
        C = _capacity(ex.parallel, n * k, N)
        ok = (dest < N) & (pos < C)
        d_i = jnp.where(ok, dest, N)  # out of bounds: dropped by the scatter
        sx = jnp.zeros((N, C, x2.shape[-1]), x2.dtype).at[d_i, pos].set(xs, mode="drop")
        sle = jnp.full((N, C), El, jnp.int32).at[d_i, pos].set(les, mode="drop")
        sw = jnp.zeros((N, C), F32).at[d_i, pos].set(ws, mode="drop")
        a2a = lambda a: lax.all_to_all(a.reshape(N * C, *a.shape[2:]), DATA, 0, 0, tiled=True)  # noqa: E731
        out = compute(a2a(sx), a2a(sle), a2a(sw))
        back = lax.all_to_all(out, DATA, 0, 0, tiled=True).reshape(N, C, -1)
        contrib = back[jnp.minimum(dest, N - 1), jnp.minimum(pos, C - 1)]
        dropped = jnp.sum(jnp.maximum(counts - C, 0))
    else:
        R = _capacity(ex.parallel, n * k, N)
        M = gather_rows(counts[None])  # [N src, N dst] rows every rank sends to every rank
        before = jnp.cumsum(M, axis=0) - M  # [i, j]: rows from ranks < i that land at j
        send = jnp.clip(R - before[me], 0, counts)  # truncated at the receivers' capacity
        recv = jnp.clip(R - before[:, me], 0, M[:, me])  # what each source really sends me
        out_off = before[me]  # where my rows start in each receiver's buffer
        in_off_back = jnp.cumsum(M, axis=1) - M  # [i, j]: where rank i's rows for j start in its send order
        ok = (dest < N) & (pos < send[jnp.minimum(dest, N - 1)])
        rows = jnp.where(live[order][:, None], xs, 0)
        transport = _ragged if ex.parallel.a2a == "ragged" else _ragged_emulated
        rx = transport(rows, jnp.zeros((R, x2.shape[-1]), x2.dtype), starts, send, out_off, recv)
        rle = transport(les[:, None], jnp.full((R, 1), El, jnp.int32), starts, send, out_off, recv)[:, 0]
        rw = transport(ws[:, None], jnp.zeros((R, 1), F32), starts, send, out_off, recv)[:, 0]
        out = compute(rx, rle, rw)
        back = transport(out, jnp.zeros((n * k, out.shape[-1]), out.dtype), before[:, me], recv,
                         in_off_back[:, me], send)
        contrib = back
        dropped = jnp.sum(counts - send)
    contrib = jnp.where(ok[:, None], contrib.astype(F32), 0.0)
    y = jnp.zeros((n, x2.shape[-1]), F32).at[tok].add(contrib)
    y = y + layers.shared_expert(cfg, p["shared"], x2, lin_local).astype(F32)
    return y, dropped.astype(jnp.int32)


def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                 axis_name=DATA)


def _ragged_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`lax.ragged_all_to_all`'s semantics from all_gather (for CPU, where XLA lacks the op): rank i's rows
    operand[input_offsets[j] : + send_sizes[j]] land in rank j's output at output_offsets[j]."""
    del recv_sizes  # implied by the senders' sizes
    N = lax.axis_size(DATA)
    me = lax.axis_index(DATA)
    ops_all = gather_rows(operand[None])  # [N, n, ...]
    in_off, sizes, out_off = (gather_rows(a[None]) for a in (input_offsets, send_sizes, output_offsets))
    r = jnp.arange(output.shape[0])
    res = output
    for i in range(N):
        lo, sz = out_off[i, me], sizes[i, me]
        hit = (r >= lo) & (r < lo + sz)
        src = jnp.clip(in_off[i, me] + r - lo, 0, operand.shape[0] - 1)
        res = jnp.where(hit.reshape(-1, *[1] * (output.ndim - 1)), ops_all[i][src], res)
    return res
