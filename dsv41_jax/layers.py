"""Per-token building blocks with the reference's rounding points: RMSNorm, FP8 linears (with activation
quantization), single-pass mHC (hc_mixes / hc_pre / hc_post), the sqrtsoftplus MoE, and Engram.

All functions take the ModelConfig first; activations are in cfg.compute_dtype (bf16 as the reference)
and every reduction that the reference does in f32 is done in f32 here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import engram_rows, quant
from dsv41_jax.params import expert_weight, is_quantized, lin_weight
from dsv41_jax.weights import materialize

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def cdtype(cfg):
    return jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else F32


def mm(a, b, spec: str):
    """einsum with f32 accumulation; f32 operands get full precision (no TF32 on GPU)."""
    prec = HIGHEST if (a.dtype == F32 or b.dtype == F32) else None
    return jnp.einsum(spec, a, b, preferred_element_type=F32, precision=prec)


def rms_norm(cfg, x, w):
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.norm_eps)
    return (w.astype(F32) * y).astype(x.dtype)


def act_qdq(cfg, x, p):
    """The reference quantizes a linear's input to FP8 (UE8M0 per 32) iff the weight is FP8/FP4."""
    return quant.fp8_qdq(x, 32) if (cfg.qdq and is_quantized(p)) else x


def linear(cfg, p, x):
    """y = x W^T for a (possibly FP8 block-32) linear; output rounded to the compute dtype."""
    p = materialize(p)
    dt = cdtype(cfg)
    x = act_qdq(cfg, x.astype(dt), p)
    return mm(x, lin_weight(p, dt), "...i,oi->...o").astype(dt)


def dense(cfg, w, x, f32: bool = False):
    """A plain (never quantized) linear: bf16 weights, or f32 math when the reference promotes to f32."""
    if f32:
        return mm(x.astype(F32), w.astype(F32), "...i,oi->...o")
    dt = cdtype(cfg)
    return mm(x.astype(dt), w.astype(dt), "...i,oi->...o").astype(dt)


# ----------------------------------------------------------------------------- mHC
def hc_logits(cfg, x, fn):
    """x [..., hc, D] -> the (2+hc)*hc mixing logits m = (flatten(x) @ fn^T) * rsqrt(mean(x^2) + eps), f32."""
    xf = x.astype(F32).reshape(*x.shape[:-2], -1)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + cfg.norm_eps)
    return mm(xf, fn.astype(F32), "...i,oi->...o") * r


def hc_coefficients(m, scale, base, *, hc: int, iters: int, eps: float):
    """The mixing logits m [..., (2+hc)*hc] f32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]
    (Sinkhorn-normalised): the one jnp reference, also the oracle of the Pallas kernel (pallas_kernels/mhc)."""
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    # the max only stabilises exp (the normalisation below cancels it): no gradient through it, which also keeps
    # XLA:CPU at -O0 from producing NaN in the max's backward
    c = jnp.exp(c - jax.lax.stop_gradient(jnp.max(c, axis=-1, keepdims=True)))
    c = c / jnp.sum(c, axis=-1, keepdims=True) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def sinkhorn(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    c = jax.lax.fori_loop(0, iters - 1, sinkhorn, c)
    return pre, post, c


def hc_mixes(cfg, x, fn, scale, base, coefficients=None):
    """x [..., hc, D] -> pre [..., hc], post [..., hc], comb [..., hc, hc] (Sinkhorn-normalised).
    coefficients: (m, scale, base) -> (pre, post, comb) in place of `hc_coefficients` (the ops seam passes the
    Pallas Sinkhorn kernel there); None: the jnp reference."""
    m = hc_logits(cfg, x, fn)
    if coefficients is not None:
        return coefficients(m, scale, base)
    return hc_coefficients(m, scale, base, hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps)


def hc_pre(x, pre):
    """Collapse the hc copies: sum_c pre[c] x[c] (f32), cast back."""
    return jnp.sum(pre[..., None] * x.astype(F32), axis=-2).astype(x.dtype)


def hc_post(y, residual, post, comb):
    """out[j] = post[j] y + sum_i comb[i, j] residual[i]  (f32, cast back to y's dtype)."""
    mix = jnp.einsum("...ij,...id->...jd", comb, residual.astype(F32), precision=HIGHEST)
    return (post[..., None] * y.astype(F32)[..., None, :] + mix).astype(y.dtype)


def hc_split(cfg, mix):
    """Packed mixes [..., (2+hc)*hc] (pre | post | comb row-major, the logits' layout) -> (pre, post, comb)."""
    hc = cfg.hc_mult
    return mix[..., :hc], mix[..., hc:2 * hc], mix[..., 2 * hc:].reshape(*mix.shape[:-1], hc, hc)


def hc_pack(pre, post, comb):
    return jnp.concatenate([pre, post, comb.reshape(*comb.shape[:-2], -1)], axis=-1)


def hc_boundary(cfg, h, y, mix, fn, scale, base, norm_w, coefficients=None):
    """One sublayer boundary of single-pass mHC, the reference of the Mega-mHC kernel (pallas_kernels/mega_mhc):
    h [..., hc, D] still owes the previous sublayer's output y [..., D], mixed in with the post / comb of the
    previous boundary's packed mixes `mix`, whose pre is the next sublayer's pre-mix (the "delayed" pre of
    single-pass mHC: mixes computed before the previous sublayer ran). Returns (h' = hc_post(y, h, post, comb),
    x = RMSNorm(hc_pre(h', pre), norm_w), mix' = hc_mixes(h') packed); `coefficients` as hc_mixes."""
    pre, post, comb = hc_split(cfg, mix)
    h = hc_post(y, h, post, comb)
    x = rms_norm(cfg, hc_pre(h, pre), norm_w)
    return h, x, hc_pack(*hc_mixes(cfg, h, fn, scale, base, coefficients))


# ----------------------------------------------------------------------------- MoE
def gate(cfg, p, x):
    """sqrtsoftplus noaux routing: the bias picks experts, weights come from the unbiased scores."""
    s = jnp.sqrt(jax.nn.softplus(dense(cfg, p["weight"], x, f32=True)))
    _, idx = jax.lax.top_k(s + p["bias"].astype(F32), cfg.n_activated_experts)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.route_scale, idx


@jax.custom_vjp
def _bias_signal(w, bias, signal):
    """Identity on w; sends `signal` to the gate bias's gradient slot (whatever the loss)."""
    return w


def _bias_signal_fwd(w, bias, signal):
    return w, signal


def _bias_signal_bwd(signal, g):
    return g, signal, jnp.zeros_like(signal)


_bias_signal.defvjp(_bias_signal_fwd, _bias_signal_bwd)


def balanced_gate(cfg, p, x):
    """`gate` for training with auxiliary-loss-free balancing (DeepSeek-V3's rule; ops.TrainHooks.balance): the
    same routing, and the gate bias's gradient slot receives the batch's expert load fraction minus 1/E (the
    trainer moves the bias by -gamma * sign of it; the bias only picks experts, so it has no gradient of its own)."""
    w, idx = gate(cfg, p, x)
    E = cfg.n_routed_experts
    load = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32), axis=tuple(range(idx.ndim))) / idx.size
    return _bias_signal(w, p["bias"], jax.lax.stop_gradient(load - 1.0 / E).astype(p["bias"].dtype)), idx


def swiglu(cfg, g, u):
    g, u = g.astype(F32), u.astype(F32)
    if cfg.swiglu_limit > 0:
        u = jnp.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
        g = jnp.minimum(g, cfg.swiglu_limit)
    return jax.nn.silu(g) * u


def shared_expert(cfg, p, x, lin=linear):
    h = swiglu(cfg, lin(cfg, p["w1"], x), lin(cfg, p["w3"], x))
    return lin(cfg, p["w2"], h.astype(x.dtype))


def routed_experts(cfg, p, x, weights, idx):
    """sum_k weights[k] * Expert_{idx[k]}(x) in f32, via a grouped (ragged) matmul over sorted assignments."""
    p = materialize(p)
    dt = cdtype(cfg)
    N, D = x.shape
    k = idx.shape[-1]
    E = cfg.n_routed_experts
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    quantized = cfg.qdq and is_quantized(p["w1"])
    xq = quant.fp8_qdq(x.astype(dt), 32) if quantized else x.astype(dt)
    xs = xq[tok]
    prec = jax.lax.Precision.HIGHEST if dt == F32 else None
    # expert weights stay [E, out, in]: contract `in` directly (no transposed copy of every expert)
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                           rhs_group_dimensions=[0])

    def gdot(a, w):
        return jax.lax.ragged_dot_general(a, expert_weight(w, dt), sizes, dn, precision=prec,
                                          preferred_element_type=F32).astype(dt)

    g, u = gdot(xs, p["w1"]), gdot(xs, p["w3"])
    h = swiglu(cfg, g, u) * weights.reshape(-1)[order][:, None]
    h = h.astype(dt)
    if quantized:
        h = quant.fp8_qdq(h, 32)
    out = gdot(h, p["w2"])
    return jnp.zeros((N, D), F32).at[tok].add(out.astype(F32))


def moe(cfg, p, x, lin=linear, experts=routed_experts, gate=gate):
    """`lin` / `experts` are the GEMM implementations (the ops seam passes its own; these are the references);
    `gate` the router (`balanced_gate` under the training hooks)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    w, idx = gate(cfg, materialize(p["gate"]), x2)
    y = experts(cfg, p["experts"], x2, w, idx)
    y = y + shared_expert(cfg, p["shared"], x2, lin).astype(F32)
    return y.astype(x.dtype).reshape(shape)


# ----------------------------------------------------------------------------- Engram
def engram_lookup(cfg, p, ids):
    """Rows of the (FP8, per-32 scaled) table -> [..., n_cols * head_dim] in the compute dtype."""
    t = p["embed"]
    rows = jnp.take(t["weight"], ids, axis=0)
    if "scale" in t:
        sc = quant.e8m0_to_f32(jnp.take(t["scale"], ids, axis=0))
        rows = rows.astype(F32).reshape(*rows.shape[:-1], -1, 32) * sc[..., None]
        rows = rows.reshape(*ids.shape, -1)
    return rows.astype(cdtype(cfg)).reshape(*ids.shape[:-1], -1)


def engram(cfg, p, h, ids, lin=linear, rows=None):
    """h [..., hc, D]; ids [..., n_cols] -> h + gate_c * value per hc copy (gate normalised per copy).
    `rows`: the table rows already gathered on the host (uint8 [..., n_cols, row_bytes], dsv41_jax.engram_rows)
    instead of `ids` (then `p` needs no table)."""
    hc, D = cfg.hc_mult, cfg.dim
    emb = engram_lookup(cfg, p, ids) if rows is None else engram_rows.decode_rows(cfg, rows, cdtype(cfg))
    kv = lin(cfg, p["wkv"], emb)
    key = kv[..., :hc * D].astype(F32).reshape(*kv.shape[:-1], hc, D)
    value = kv[..., hc * D:].astype(F32)
    w = p["q_weight"].astype(F32) * p["k_weight"].astype(F32)
    hf = h.astype(F32)
    rstd = (jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1) + cfg.norm_eps)
            * jax.lax.rsqrt(jnp.mean(key * key, axis=-1) + cfg.norm_eps))
    dot = jnp.sum(hf * w * key, axis=-1) * rstd * (D ** -0.5)
    g = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    return (hf + g[..., None] * value[..., None, :]).astype(h.dtype)
