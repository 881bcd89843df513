"""Quantization-aware training of a V4.1 model with optax: f32 master weights, served numerics in the forward.

The parameters that the model runs on are a *view* of f32 master weights (`qat_params`) with exactly the
values that the exported checkpoint serves (`export_params`): FP8 E4M3 32x32-block linears, MXFP4 routed
experts, an FP8 Engram table, wo_a kept FP8-representable, bf16 dense weights, the head rounded to bf16. Each
quantization is straight-through (identity gradient), and the model's own activation / KV qdq points run as in
serving (`cfg.qdq`), so training sees the served formats. Invariant (tested): the full forward of
``qat_params(cfg, m)`` and of ``export_params(cfg, m)`` agree bit for bit.

Three training-only hooks (`training_hooks`, active only while a training program is traced):
- routed experts read float (already fake-quantized) weights instead of packed MXFP4 bytes;
- load balancing without an auxiliary loss (DeepSeek-V3's rule): each layer's gate bias gets, through its
  gradient slot, the expert load fraction minus 1/E of the batch, and the trainer moves the bias by
  -gamma * sign(that) after each step (the bias only picks experts, so it has no gradient of its own);
- the lightning indexer gets no gradient through its top-k, so each index-source layer adds a KL term:
  KL(p || softmax(index scores)) over the visible compressed entries, where p is the layer's own dense
  attention over those entries (softmax of q . latent per head, averaged over heads; a fixed target with no
  gradient). Only the indexer's query side (wq_b, weights_proj) learns from it: x, q, the latents and the index
  keys are stop-gradient, so the key projection (wk, k_norm) keeps its random initialisation (an invertible
  random projection of the latent, which the trained query side absorbs). Query rows are subsampled with a static
  stride. The same hook measures the indexer's recall: the attention mass its top-k captures, on rows with more
  visible entries than k, against k / visible entries for a random pick.
The hooks wrap `dsv41_jax.layers.{expert_weight, gate}`, `dsv41_jax.model._attention` (its arguments are
bound by name) and, with `fast_attention`, `dsv41_jax.attention.sparse_attention`; `hooks_available()` says
whether the model code still offers them.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import attention, layers, model, quant
from dsv41_jax.config import KIND_IDX, KIND_SRC, ModelConfig
from dsv41_jax.params import init_params, tensor_specs
from dsv41_jax.rope import apply_rope, layer_freqs

F32, BF16 = jnp.float32, jnp.bfloat16
AUX_KL = "_train_indexer_kl"  # state keys the hooks accumulate into (absent in serving states)
AUX_N = "_train_indexer_layers"
REC_MASS = "_train_recall_mass"
REC_BASE = "_train_recall_random"
REC_ROWS = "_train_recall_rows"


# ----------------------------------------------------------------------------- tree helpers
def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _copy(tree):
    return jax.tree.map(lambda x: x, tree)


def _ste(w, q):
    """q in the forward, identity gradient to w."""
    return w + jax.lax.stop_gradient(q - w)


def _fp8_block_qdq(w):
    return quant.dequantize_weight_fp8(*quant.quantize_weight_fp8(w), F32)


def _e8m0_ones(shape):
    return jax.lax.bitcast_convert_type(jnp.full(shape, 127, jnp.uint8), jnp.float8_e8m0fnu)


# ----------------------------------------------------------------------------- masters / view / export
def init_masters(cfg: ModelConfig, seed: int = 0) -> dict:
    """Seeded f32 master weights: the bf16-format parameter tree (every weight unquantized) in f32."""
    return jax.tree.map(lambda x: x.astype(F32), init_params(cfg.replace(weight_format="bf16"), seed))


def masters_from_params(cfg: ModelConfig, params: dict) -> dict:
    """f32 masters from a served tree (fp8 or bf16 format), e.g. a loaded checkpoint, for fine-tuning:
    every weight dequantized (traceable)."""
    from dsv41_jax.params import expert_weight, lin_weight

    out = _copy(params)
    for path, t in tensor_specs(cfg).items():
        node = _get(params, path)
        if t.fmt == "lin":
            v = {"weight": lin_weight(node, F32)}
        elif t.fmt == "exp":
            v = {"weight": expert_weight(node, F32)}
        elif t.fmt == "table" and "scale" in node:
            codes = jax.lax.bitcast_convert_type(node["scale"], jnp.uint8)
            v = {"weight": quant.fp8_decode(node["weight"], codes, 32, F32)}
        elif t.fmt == "table":
            v = {"weight": node["weight"].astype(F32)}
        else:
            v = node.astype(F32)
        _set(out, path, v)
    return out


def _quantized_values(cfg, path, t, w):
    """The served value of one master tensor (f32), before any packing."""
    if t.fmt == "lin" or path[-1] == "wo_a":
        return _fp8_block_qdq(w)
    if t.fmt == "exp":
        return quant.fp4_qdq(w, 32, "ue8m0")
    if t.fmt == "table":
        return quant.fp8_qdq(w, 32)
    if path[0] == "head":  # f32 in the model, bf16 in the checkpoint
        return w.astype(BF16).astype(F32)
    return w


def qat_params(cfg: ModelConfig, masters: dict) -> dict:
    """The parameter tree the model runs on during training (traceable): served values, straight-through
    gradients. FP8/FP4 tensors keep the fp8-format structure ({'weight', 'scale'}) so the model applies its
    activation quantization, with float weights and unit scales (routed experts need `training_hooks`)."""
    if cfg.weight_format != "fp8":
        raise ValueError("qat_params models the fp8 checkpoint format (cfg.weight_format must be 'fp8')")
    out = _copy(masters)
    for path, t in tensor_specs(cfg).items():
        node = _get(masters, path)
        w = node["weight"] if t.fmt in ("lin", "exp", "table") else node
        q = _ste(w, _quantized_values(cfg, path, t, w))
        if t.fmt == "lin":
            *lead, o, i = t.shape
            v = {"weight": q, "scale": _e8m0_ones((*lead, -(-o // 32), -(-i // 32)))}
        elif t.fmt in ("exp", "table"):
            *lead, o, i = t.shape
            v = {"weight": q, "scale": _e8m0_ones((*lead, o, i // 32))}
        else:
            v = q.astype(t.dtype)
        _set(out, path, v)
    return out


def export_params(cfg: ModelConfig, masters: dict) -> dict:
    """The served parameter tree in cfg.weight_format (fp8: FP8 / MXFP4 / FP8-table leaves), as
    `checkpoints.write_hf` writes it."""
    fp8 = cfg.weight_format == "fp8"
    out = _copy(masters)
    for path, t in tensor_specs(cfg).items():
        node = _get(masters, path)
        w = node["weight"] if t.fmt in ("lin", "exp", "table") else node
        if t.fmt == "lin" and fp8:
            qw, s = quant.quantize_weight_fp8(w)
            v = {"weight": qw, "scale": s}
        elif t.fmt == "exp" and fp8:
            qw, s = quant.quantize_weight_fp4(w)
            v = {"weight": qw, "scale": s}
        elif t.fmt == "table" and fp8:
            q, codes = quant.fp8_encode(w, 32)
            v = {"weight": q, "scale": jax.lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu)}
        elif t.fmt in ("lin", "exp", "table"):
            v = {"weight": _quantized_values(cfg, path, t, w).astype(BF16)}
        else:
            v = _quantized_values(cfg, path, t, w).astype(t.dtype)
        _set(out, path, v)
    return out


# ----------------------------------------------------------------------------- training hooks
def _float_expert_weight(orig):
    def expert_weight(p, dtype=BF16):
        if jnp.issubdtype(p["weight"].dtype, jnp.floating):  # a QAT view: already fake-quantized
            return p["weight"].astype(dtype)
        return orig(p, dtype)
    return expert_weight


@jax.custom_vjp
def _bias_signal(w, bias, signal):
    """Identity on w; sends `signal` to the gate bias's gradient slot (whatever the loss)."""
    return w


def _bias_signal_fwd(w, bias, signal):
    return w, signal


def _bias_signal_bwd(signal, g):
    return g, signal, jnp.zeros_like(signal)


_bias_signal.defvjp(_bias_signal_fwd, _bias_signal_bwd)


def _balanced_gate(orig):
    def gate(cfg, p, x):
        w, idx = orig(cfg, p, x)
        E = cfg.n_routed_experts
        load = jnp.sum(jax.nn.one_hot(idx, E, dtype=F32), axis=tuple(range(idx.ndim))) / idx.size
        return _bias_signal(w, p["bias"], jax.lax.stop_gradient(load - 1.0 / E).astype(p["bias"].dtype)), idx
    return gate


def _take(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _indexer_terms(cfg, seg, params, lp, slot, x, state, shared, qpos, topk, stride: int):
    """(KL per row [B,Ts], rows ok [B,Ts], recall mass / random baseline / rows counted) for one layer."""
    sg = jax.lax.stop_gradient
    B, T, _ = x.shape
    H, d, r = cfg.n_heads, cfg.head_dim, seg.ratio
    s = max(1, min(stride, T))
    x, qpos = sg(x[:, s - 1::s]), qpos[:, s - 1::s]
    Ts = x.shape[1]
    freqs = jnp.asarray(layer_freqs(cfg, r))
    ap = sg(lp["attn"])
    qr = sg(layers.rms_norm(cfg, layers.linear(cfg, ap["wq_a"], x), ap["q_norm"]))
    q = apply_rope(layers.linear(cfg, ap["wq_b"], qr).reshape(B, Ts, H, d), qpos, freqs)
    src = shared["src"]
    lat = sg(jax.lax.dynamic_index_in_dim(state[f"lat_r{r}"], src, keepdims=False))  # [B,C,d]
    keys = sg(jax.lax.dynamic_index_in_dim(state[f"idx_r{r}"], src, keepdims=False))
    C = lat.shape[1]
    vis = jnp.arange(C)[None, None] < ((qpos + 1) // r)[..., None]  # [B,Ts,C]
    nvis = jnp.sum(vis, axis=-1)
    ok = nvis > 0
    att = jnp.einsum("bthd,bcd->bthc", sg(q).astype(F32), lat.astype(F32),
                     precision=jax.lax.Precision.HIGHEST) * d ** -0.5
    att = jnp.where(vis[:, :, None] & ok[..., None, None], att, -1e30)
    p = sg(jnp.where(vis, jnp.mean(jax.nn.softmax(att, axis=-1), axis=2), 0.0))  # [B,Ts,C]
    ip = _take(params[seg.stack]["indexer"], slot)
    scores = attention.index_scores(cfg, ip, x, qr, qpos, keys, r, freqs)
    logq = jax.nn.log_softmax(jnp.where(vis & ok[..., None], scores, -1e30), axis=-1)
    kl = jnp.sum(jnp.where(vis & (p > 0), p * (jnp.log(jnp.maximum(p, 1e-30)) - logq), 0.0), axis=-1)
    rec = (jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
    if topk is not None:
        sel = topk[:, s - 1::s]  # [B,Ts,k]
        mass = jnp.sum(jnp.where(sel >= 0, jnp.take_along_axis(p, jnp.maximum(sel, 0), axis=-1), 0.0), axis=-1)
        k = sel.shape[-1]
        bind = nvis > k  # rows where the top-k really selects
        rec = (jnp.sum(jnp.where(bind, mass, 0.0)), jnp.sum(jnp.where(bind, k / jnp.maximum(nvis, 1), 0.0)),
               jnp.sum(bind).astype(F32))
    return kl, ok, rec


def _attention_with_indexer_terms(orig, stride: int):
    sig = inspect.signature(orig)

    def _attention(*args, **kw):
        out = orig(*args, **kw)
        b = sig.bind(*args, **kw).arguments
        seg, kind, state = b["seg"], b["kind"], out[1]
        if not seg.ratio or kind not in (KIND_SRC, KIND_IDX) or AUX_KL not in state:
            return out
        rows = b.get("rows", b.get("ctx"))
        qpos = rows["qpos"] if isinstance(rows, dict) else rows.qpos
        kl, ok, (mass, base, n) = _indexer_terms(b["cfg"], seg, b["params"], b["lp"], b["slot"], b["x"], state,
                                                  out[2], qpos, out[3], stride)
        okf = ok.astype(F32)
        state = dict(state)
        state[AUX_KL] = state[AUX_KL] + jnp.sum(kl * okf) / jnp.maximum(jnp.sum(okf), 1.0)
        state[AUX_N] = state[AUX_N] + 1.0
        state[REC_MASS], state[REC_BASE], state[REC_ROWS] = (state[REC_MASS] + mass, state[REC_BASE] + base,
                                                             state[REC_ROWS] + n)
        return (out[0], state, *out[2:])

    return _attention


_ATTENTION_ARGS = {"cfg", "seg", "kind", "params", "lp", "slot", "x", "state", "shared", "forced"}


def hooks_available() -> dict:
    """Which training hooks the model code supports (names and arguments they wrap)."""
    att = getattr(model, "_attention", None)
    names = set(inspect.signature(att).parameters) if att is not None else set()
    return {"expert_weight": hasattr(layers, "expert_weight"), "gate": hasattr(layers, "gate"),
            "indexer": _ATTENTION_ARGS <= names and bool({"rows", "ctx"} & names)}


@contextlib.contextmanager
def training_hooks(*, indexer_stride: int = 0, balance: bool = True, fast_attention: bool = False):
    """Install the training-only hooks (module docstring) while a program is traced; `fast_attention` also swaps
    the sparse attention core for `training.fast_attention` (same quantity, one-pass bf16 numerics)."""
    have = hooks_available()
    if not have["expert_weight"]:
        raise RuntimeError("dsv41_jax.layers.expert_weight is gone: the QAT expert hook needs updating")
    saved = []

    def patch(mod, name, new):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, new)

    patch(layers, "expert_weight", _float_expert_weight(layers.expert_weight))
    if balance and have["gate"]:
        patch(layers, "gate", _balanced_gate(layers.gate))
    if indexer_stride and have["indexer"]:
        patch(model, "_attention", _attention_with_indexer_terms(model._attention, indexer_stride))
    if fast_attention:
        from training import fast_attention as fa

        patch(attention, "sparse_attention", fa.sparse_attention)
    try:
        yield have
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


# ----------------------------------------------------------------------------- forward / loss
def full_forward(cfg: ModelConfig, params, tokens, engram_ids, extra_state: dict | None = None):
    """(a) the full causal forward over a fresh sequence, traceable: (logits [B,T,V] f32, final state).
    `extra_state` entries ride along in the state (the hooks accumulate into them)."""
    B, T = tokens.shape
    state = model.init_state(cfg, B, T)
    if extra_state:
        state = dict(state, **extra_state)
    if hasattr(model, "ChunkInputs"):
        inp = model.ChunkInputs.make(tokens, engram_ids)
        out = model.step_impl(cfg, params, state, inp, fresh=True, n_dec=T, n_logits=T)
    else:  # the pre-ChunkInputs signature
        out = model.step_impl(cfg, params, state, tokens, engram_ids, **model.step_args(B), fresh=True, n_dec=T,
                              n_logits=T)
    return out[0], out[1]


def token_nll(logits, targets):
    """Per-token negative log-likelihood [B,T] (f32) of targets under logits [B,T,V]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _aux_state():
    z = jnp.zeros((), F32)
    return {AUX_KL: z, AUX_N: z, REC_MASS: z, REC_BASE: z, REC_ROWS: z}


def _metrics_from_state(state):
    n = jnp.maximum(state[AUX_N], 1.0)
    rows = jnp.maximum(state[REC_ROWS], 1.0)
    return {"indexer_kl": state[AUX_KL] / n, "recall": state[REC_MASS] / rows,
            "recall_random": state[REC_BASE] / rows, "recall_rows": state[REC_ROWS]}


def loss_and_metrics(cfg, masters, tokens, engram_ids, targets, mask, *, aux_weight: float):
    """Mean next-token NLL over `mask` plus aux_weight x the indexer KL (summed over index layers)."""
    params = qat_params(cfg, masters)
    logits, state = full_forward(cfg, params, tokens, engram_ids, _aux_state())
    nll = token_nll(logits, targets)
    m = mask.astype(F32)
    ce = jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
    met = _metrics_from_state(state)
    return ce + aux_weight * state[AUX_KL], dict(met, ce=ce)


# ----------------------------------------------------------------------------- optimizer
@dataclass(frozen=True)
class Hyper:
    peak_lr: float = 2e-3
    final_lr_frac: float = 0.1
    warmup_frac: float = 0.04
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_gamma: float = 3e-3  # gate-bias balancing step (DeepSeek-V3 uses 1e-3 over far more steps)
    aux_weight: float = 0.1  # indexer KL weight
    aux_stride: int = 8  # indexer KL on every stride-th query row

    def lr(self, frac: float) -> float:
        """Linear warm-up then cosine decay to final_lr_frac x peak, as a function of the budget fraction."""
        f = min(max(frac, 0.0), 1.0)
        if f < self.warmup_frac:
            return self.peak_lr * max(f / self.warmup_frac, 0.01)
        c = (f - self.warmup_frac) / max(1.0 - self.warmup_frac, 1e-9)
        lo = self.final_lr_frac
        return self.peak_lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * c)))


def _is_gate_bias(path) -> bool:
    return len(path) >= 3 and path[-3:] == ("ffn", "gate", "bias")


def _paths(tree):
    from checkpoints.tree import map_with_path

    return map_with_path(lambda p, _: p, tree)


def make_optimizer(h: Hyper, masters):
    """AdamW without its learning rate: clip by global norm, Adam, decoupled weight decay on every tensor of rank
    >= 2 (not norms, biases, sinks, mHC bases / scales). The trainer scales the update by -lr itself (a host-side
    schedule over wall-clock time, passed in each step)."""
    import optax

    paths = _paths(masters)
    decay = jax.tree.map(lambda p, x: x.ndim >= 2 and not _is_gate_bias(p), paths, masters,
                         is_leaf=lambda x: isinstance(x, tuple))
    return optax.chain(optax.clip_by_global_norm(h.clip), optax.scale_by_adam(b1=h.b1, b2=h.b2),
                       optax.add_decayed_weights(h.weight_decay, mask=decay))


def make_train_step(cfg: ModelConfig, h: Hyper, tx):
    """A pure step (masters, opt_state, batch, lr) -> (masters, opt_state, metrics); trace it inside
    `training_hooks(indexer_stride=h.aux_stride)`."""
    import optax

    def step(masters, opt_state, tokens, engram_ids, targets, mask, lr):
        def f(m):
            return loss_and_metrics(cfg, m, tokens, engram_ids, targets, mask, aux_weight=h.aux_weight)

        (loss, met), grads = jax.value_and_grad(f, has_aux=True)(masters)
        gb = grads["layers"]["ffn"]["gate"]["bias"]  # the balance signal, not a gradient
        grads["layers"]["ffn"]["gate"]["bias"] = jnp.zeros_like(gb)
        upd, opt_state = tx.update(grads, opt_state, masters)
        upd = jax.tree.map(lambda u: -lr * u, upd)
        masters = optax.apply_updates(masters, upd)
        bias = masters["layers"]["ffn"]["gate"]["bias"]
        masters["layers"]["ffn"]["gate"]["bias"] = bias - h.bias_gamma * jnp.sign(gb)
        met = dict(met, loss=loss, grad_norm=optax.global_norm(grads),
                   expert_imbalance=jnp.max(jnp.abs(gb)) * cfg.n_routed_experts)
        return masters, opt_state, met

    return step


def eval_step(cfg: ModelConfig, stride: int = 0):
    """(params, tokens, engram_ids, targets) -> (per-token NLL [B,T], metrics) with the served tree `params`
    (fp8 checkpoint format, no QAT view); with stride > 0 trace it inside `training_hooks(indexer_stride=
    stride)` to also get the indexer's KL and recall."""

    def f(params, tokens, engram_ids, targets):
        logits, state = full_forward(cfg, params, tokens, engram_ids, _aux_state())
        return token_nll(logits, targets), _metrics_from_state(state)

    return f


def host_engram_ids(cfg: ModelConfig, hasher, tokens: np.ndarray):
    """Engram rows for windows that start a sequence (no history), or None without Engram layers."""
    if hasher is None:
        return None
    return hasher.hash_ids(tokens)
