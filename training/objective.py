"""Quantization-aware training of a V4.1 model with optax: f32 master weights, served numerics in the forward.

The parameters that the model runs on are a *view* of f32 master weights (`qat_params`) with exactly the
values that the exported checkpoint serves (`export_params`): FP8 E4M3 32x32-block linears, MXFP4 routed
experts, an FP8 Engram table, wo_a kept FP8-representable, bf16 dense weights, the head rounded to bf16. Each
quantization is straight-through (identity gradient), and the model's own activation / KV qdq points run as in
serving (`cfg.qdq`), so training sees the served formats. Invariant (tested): the full forward of
``qat_params(cfg, m)`` and of ``export_params(cfg, m)`` agree bit for bit.

The training-only behaviour is the model's own, explicit hooks (`dsv41_jax.ops.TrainHooks`, a static field of
the step's ExecContext, part of the jit key):
- routed experts read float (already fake-quantized) weights of the QAT view (dsv41_jax.params.expert_weight);
- load balancing without an auxiliary loss (DeepSeek-V3's rule; `TrainHooks.balance`): each layer's gate bias
  gets, through its gradient slot, the expert load fraction minus 1/E of the batch (dsv41_jax.layers.
  balanced_gate), and the trainer moves the bias by -gamma * sign(that) after each step;
- the lightning indexer gets no gradient through its top-k, so each index-source layer adds a KL term
  (`TrainHooks.indexer_stride`, dsv41_jax.model._indexer_terms): KL(p || softmax(index scores)) over the visible
  compressed entries, p the layer's own dense attention (a fixed target); only the indexer's query side (wq_b,
  weights_proj) learns from it, so the key projection (wk, k_norm) keeps its random initialisation (an
  invertible random projection of the latent, which the trained query side absorbs). Query rows are subsampled
  with a static stride. The same hook measures the indexer's recall. The sums come back in the step's typed
  auxiliary output (`model.StepAux`), never in the KV state;
- the attention core's training form (`TrainHooks.attention`, `Hyper.attention`; dsv41_jax.train_attention):
  the same attention as served up to rounding, with less memory for the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import model, quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.ops import ExecContext, TrainHooks
from dsv41_jax.params import BF16_STORED, expert_weight, init_params, lin_weight, tensor_specs

F32, BF16 = jnp.float32, jnp.bfloat16


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
    if path[0] == "head" or path[:2] in BF16_STORED:  # f32 in the model, bf16 in the checkpoint
        return w.astype(BF16).astype(F32)
    return w


def _specs(cfg: ModelConfig, root: str | None):
    """tensor_specs, or only those under the top-level key `root` (e.g. "mtp": the DSpark draft alone)."""
    return [(p, t) for p, t in tensor_specs(cfg).items() if root is None or p[0] == root]


def qat_params(cfg: ModelConfig, masters: dict, root: str | None = None) -> dict:
    """The parameter tree the model runs on during training (traceable): served values, straight-through
    gradients. FP8/FP4 tensors keep the fp8-format structure ({'weight', 'scale'}) so the model applies its
    activation quantization, with float weights and unit scales (which dsv41_jax.params.expert_weight reads as
    they are). root: only the tensors under that top-level key (masters may then hold just that subtree)."""
    if cfg.weight_format != "fp8":
        raise ValueError("qat_params models the fp8 checkpoint format (cfg.weight_format must be 'fp8')")
    out = _copy(masters)
    for path, t in _specs(cfg, root):
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


def export_params(cfg: ModelConfig, masters: dict, root: str | None = None) -> dict:
    """The served parameter tree in cfg.weight_format (fp8: FP8 / MXFP4 / FP8-table leaves), as
    `checkpoints.write_hf` writes it (root: as in qat_params)."""
    fp8 = cfg.weight_format == "fp8"
    out = _copy(masters)
    for path, t in _specs(cfg, root):
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


# ----------------------------------------------------------------------------- forward / loss
def train_hooks(h: Hyper | None = None, *, balance: bool = True, indexer_stride: int | None = None) -> TrainHooks:
    """The model's training hooks for a step: gate-bias balancing, the indexer KL on every stride-th row and
    the training form of the attention core (h.attention; dsv41_jax.train_attention)."""
    stride = (h.aux_stride if h is not None else 0) if indexer_stride is None else indexer_stride
    return TrainHooks(balance=balance, indexer_stride=stride, attention=h.attention if h is not None else "served",
                      head_bf16=h.head_bf16 if h is not None else False)


def full_forward(cfg: ModelConfig, params, tokens, engram_ids, hooks: TrainHooks | None = None):
    """(a) the full causal forward over a fresh sequence, traceable: (logits [B,T,V] f32, model.StepAux: the
    hooks' indexer KL / recall sums, zeros without hooks)."""
    B, T = tokens.shape
    state = model.init_state(cfg, B, T)
    inp = model.ChunkInputs.make(tokens, engram_ids)
    out = model.step_impl(cfg, params, state, inp, fresh=True, n_dec=T, n_logits=T, ex=ExecContext(hooks=hooks))
    return out.logits, out.aux


def token_nll(logits, targets):
    """Per-token negative log-likelihood [B,T] (f32) of targets under logits [B,T,V]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def _metrics(aux: model.StepAux) -> dict:
    n = jnp.maximum(aux.indexer_layers, 1.0)
    rows = jnp.maximum(aux.recall_rows, 1.0)
    return {"indexer_kl": aux.indexer_kl / n, "recall": aux.recall_mass / rows,
            "recall_random": aux.recall_random / rows, "recall_rows": aux.recall_rows}


def loss_and_metrics(cfg, masters, tokens, engram_ids, targets, mask, *, aux_weight: float,
                     hooks: TrainHooks | None = None):
    """Mean next-token NLL over `mask` plus aux_weight x the indexer KL (summed over index layers; it is zero
    unless `hooks` collect it)."""
    with jax.named_scope("qat_view"):
        params = qat_params(cfg, masters)
    logits, aux = full_forward(cfg, params, tokens, engram_ids, hooks)
    with jax.named_scope("loss"):
        nll = token_nll(logits, targets)
    m = mask.astype(F32)
    ce = jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
    return ce + aux_weight * aux.indexer_kl, dict(_metrics(aux), ce=ce)


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
    attention: str = "served"  # the attention core's training form (ops.TrainHooks.attention)
    head_bf16: bool = False  # the LM head's GEMM in bf16 operands, f32 accumulation (ops.TrainHooks.head_bf16)

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
    """A pure step (masters, opt_state, batch, lr) -> (masters, opt_state, metrics), with the model's training
    hooks (gate-bias balancing, the indexer KL on every h.aux_stride-th row)."""
    import optax

    def step(masters, opt_state, tokens, engram_ids, targets, mask, lr):
        def f(m):
            return loss_and_metrics(cfg, m, tokens, engram_ids, targets, mask, aux_weight=h.aux_weight,
                                    hooks=train_hooks(h))

        (loss, met), grads = jax.value_and_grad(f, has_aux=True)(masters)
        gb = grads["layers"]["ffn"]["gate"]["bias"]  # the balance signal, not a gradient
        grads["layers"]["ffn"]["gate"]["bias"] = jnp.zeros_like(gb)
        with jax.named_scope("optimizer"):
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
    (fp8 checkpoint format, no QAT view); with stride > 0 the metrics hold the indexer's KL and recall on every
    stride-th row (the routing is not touched: no balancing hook)."""
    hooks = train_hooks(balance=False, indexer_stride=stride) if stride else None

    def f(params, tokens, engram_ids, targets):
        logits, aux = full_forward(cfg, params, tokens, engram_ids, hooks)
        return token_nll(logits, targets), _metrics(aux)

    return f


def host_engram_ids(cfg: ModelConfig, hasher, tokens: np.ndarray):
    """Engram rows for windows that start a sequence (no history), or None without Engram layers."""
    if hasher is None:
        return None
    return hasher.hash_ids(tokens)
