"""Train the default model's DSpark draft by self-distillation from its frozen backbone, measure it, ship it.

    python -m training.train_dspark --smoke --out /tmp/dspark_smoke                  # CPU: the whole pipeline, tiny
    python -m training.train_dspark --corpus /tmp/corpus --out /tmp/dspark --install  # one H200: <= 3 minutes
    python -m training.train_dspark --install-from /tmp/dspark/hf                    # install a finished run

The backbone is whatever dsv41_jax/default_model holds at run time (`--backbone`; a draft already there is
dropped and retrained). The draft (`draft_config`): 2 stages, 4 routed experts (top-2) + the shared one per stage,
the backbone's widths (dim 256), Markov rank 64, blocks of 5, reading the inputs of the backbone's last three
layers, <|pad|> as the noise token: about 2.5M parameters, a quarter of a backbone decode step per draft pass.

Objective. Each step runs the frozen backbone (the served fp8 tree, no gradient) over a batch of training
windows [B, T]: its logits at every position and the draft's features (model.step(features=True)). From every
window `--anchors` anchor positions a are drawn; block a holds [x_a, noise x 4] at positions a..a+4 and reads the
features of positions a-128..a-1 (dspark.attend_windowed: the serving ring, densely). Block position i is trained
towards the backbone's next-token distribution at position a+i: KL(p_backbone || q_draft), with the Markov bias of
position i taken from the data token x_{a+i} (teacher forcing; at serving it is the previous draft, which is the
backbone's own token whenever it gets accepted), weighted 0.8^i (position i only counts when 0..i-1 were
accepted). Why KL to the softmax rather than CE on the backbone's greedy continuation: the whole distribution
comes from the same forward at no extra cost (a greedy continuation would need k sequential backbone steps per
anchor), it carries more signal than one token per position, and minimising it is what lossless rejection
sampling at temperature > 0 needs (acceptance = 1 - TV(p, q)) while also moving the draft's mode to the
backbone's, which greedy verification needs. The confidence head gets a 0.1-weighted BCE towards "the draft's
argmax equals the backbone's" (teacher forced), its meaning at serving (an acceptance estimate).
QAT as training/objective.py: f32 masters, the draft runs on the served values (FP8 block-32 linears, MXFP4
experts, bf16 Markov / confidence weights) with straight-through gradients; aux-loss-free balancing of the draft's
experts (gate bias). AdamW, warm-up + cosine over the wall-clock budget. Stages start from the backbone's last
layers (attention, mHC, norms, shared expert, the first experts and their gate rows); the Markov head and the
confidence projection start at zero (the draft starts as "the backbone's head on the stage output").

Outputs in --out: hf/ (the backbone + draft checkpoint, packed: every file <= 4 MiB; `--install` copies its
config.json, index and shards into the backbone directory, keeping tokenizer and training.json), dspark.json
(config, curve, measured acceptance; with --install also copied there), dspark_curve.png, ckpt.pkl (resumable:
`--resume`). Evaluation (training/dspark_eval.py, `--eval`): real greedy speculative decoding of held-out code
prompts (document starts) with k = 5, 128 new tokens per prompt and, less exposed to the degenerate repetition of
a small model's long greedy generations (which inflates acceptance; reported as distinct_4grams), 16 new tokens
per prompt: per-position acceptance and mean accepted length, checked token for token against plain greedy
decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import dsv41_jax  # noqa: F401  (XLA flags before the backend starts)
from dsv41_jax import dspark
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.ops import ExecContext, TrainHooks
from dsv41_jax.params import init_params, num_draft_params
from training import corpus
from training import data as D
from training import objective as T
from training.dspark_eval import SpecEval, backbone_forward

F32 = jnp.float32
REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / "dsv41_jax" / "default_model"
POS_DECAY = 0.8
CONF_WEIGHT = 0.1


def draft_config(backbone: ModelConfig, *, stages=2, experts=4, topk=2, rank=64, block=5, targets=None) -> ModelConfig:
    L = backbone.n_layers
    return backbone.replace(n_mtp_layers=stages, dspark_block_size=block, dspark_noise_token_id=corpus.PAD,
                            dspark_target_layer_ids=tuple(targets or range(L - 3, L)), dspark_markov_rank=rank,
                            dspark_n_routed_experts=experts, dspark_n_activated_experts=topk)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default=str(DEFAULT_MODEL_DIR), help="HF directory of the frozen backbone")
    ap.add_argument("--out", default=str(REPO / "runs" / "dspark"))
    ap.add_argument("--corpus", default=str(REPO / "runs" / "corpus"), help="training.code_corpus output")
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL_DIR), help="for building the corpus when missing")
    ap.add_argument("--total-minutes", type=float, default=3.0, help="the whole run, compiles and export included")
    ap.add_argument("--reserve", type=float, default=70.0, help="seconds kept for evaluation and export")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--anchors", type=int, default=128, help="draft blocks per window per step")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--rank", type=int, default=64, help="Markov rank")
    ap.add_argument("--peak-lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: the time budget)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-every", type=float, default=60.0, help="seconds between resumable checkpoints")
    ap.add_argument("--resume", action="store_true", help="continue from --out/ckpt.pkl")
    ap.add_argument("--eval", default="4x128,8x16",
                    help="acceptance settings ROUNDSxNEW,...: ROUNDS batches of held-out prompts, NEW tokens each")
    ap.add_argument("--install", action="store_true", help="write the trained draft into --backbone")
    ap.add_argument("--install-from", default="", metavar="HF_DIR",
                    help="only install: copy a finished run's hf/ (and its ../dspark.json) into --backbone, then exit")
    ap.add_argument("--results", default="", help="also write the measured acceptance to this results JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(REPO / "runs" / "jax_cache"), help="compilation cache ('none': off)")
    ap.add_argument("--smoke", action="store_true", help="CPU pipeline check: tiny batches, 3 steps, short eval")
    a = ap.parse_args(argv)
    if a.smoke:
        a.batch, a.seq, a.anchors, a.steps, a.log_every = 2, 128, 16, a.steps or 3, 1
        a.eval, a.total_minutes, a.reserve = "1x8", 1e9, 0.0
    return a


# ----------------------------------------------------------------------------- masters
def init_draft_masters(cfg: ModelConfig, backbone_masters: dict, seed: int) -> dict:
    """f32 masters of the draft: random, then every stage s from backbone layer L - S + s (everything but the
    routed experts beyond the draft's count), the Markov head and the confidence projection zero."""
    m = jax.tree.map(lambda x: x.astype(F32), init_params(cfg.replace(weight_format="bf16"), seed)["mtp"])
    S, L, E = cfg.n_mtp_layers, cfg.n_layers, cfg.draft_experts[0]
    src = jax.tree.map(lambda x: x[L - S:], backbone_masters["layers"])

    def take(dst, s):
        if dst.shape == s.shape:
            return s.astype(F32)
        return s[:, :E].astype(F32) if s.shape[2:] == dst.shape[2:] else dst  # routed experts / gate rows

    m["layers"] = jax.tree.map(take, m["layers"], src)
    m["markov_head"]["head"]["weight"] = jnp.zeros_like(m["markov_head"]["head"]["weight"])
    m["confidence_head"]["proj"]["weight"] = jnp.zeros_like(m["confidence_head"]["proj"]["weight"])
    return m


def draft_params(cfg, backbone, masters, qat: bool):
    """The model tree with the draft's QAT view (training) or its served export (evaluation, checkpoint)."""
    fn = T.qat_params if qat else T.export_params
    return dict(backbone, mtp=fn(cfg, {"mtp": masters}, root="mtp")["mtp"])


# ----------------------------------------------------------------------------- loss
def loss_fn(cfg, masters, backbone, tokens, feats, tlogits, anchors):
    """(loss, metrics) of the draft on anchors [B, N] of windows tokens [B, T] (see the module docstring)."""
    k = cfg.dspark_block_size
    params = draft_params(cfg, backbone, masters, qat=True)
    ex = ExecContext(hooks=TrainHooks(balance=True))
    B, Tn = tokens.shape
    N = anchors.shape[1]
    pos = jnp.broadcast_to(jnp.arange(Tn, dtype=jnp.int32), (B, Tn))
    ctx = dspark.context_kv(cfg, params, feats, pos, ex)
    attend = dspark.attend_windowed(cfg, ctx, pos, jnp.ones((B, Tn), bool), anchors)
    at = anchors[..., None] + jnp.arange(k)  # [B, N, k] block positions
    btok = dspark.block_tokens(cfg, jnp.take_along_axis(tokens, anchors, axis=1), k).reshape(B * N, k)
    x, logits = dspark.block_logits(cfg, params, btok, at.reshape(B * N, k), attend, ex)
    prev = jnp.take_along_axis(tokens, at.reshape(B, -1), axis=1).reshape(B * N, k)  # x_{a+i}
    bias, e = dspark.markov(cfg, params, prev)
    lq = jax.nn.log_softmax(logits + bias, axis=-1)
    tl = jnp.take_along_axis(tlogits, at.reshape(B, -1)[..., None], axis=1).reshape(B * N, k, -1)
    lp = jax.nn.log_softmax(jax.lax.stop_gradient(tl), axis=-1)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)  # [R, k]
    w = POS_DECAY ** jnp.arange(k, dtype=F32)
    w = w / jnp.sum(w)
    hit = (jnp.argmax(lq, -1) == jnp.argmax(lp, -1)).astype(F32)
    conf = dspark.confidence(cfg, params, x, e)
    bce = jnp.mean(jnp.maximum(conf, 0) - conf * hit + jnp.log1p(jnp.exp(-jnp.abs(conf))))
    loss = jnp.mean(kl @ w) + CONF_WEIGHT * bce
    return loss, {"kl": jnp.mean(kl, 0), "top1": jnp.mean(hit, 0), "bce": bce}


def make_step(cfg, h: T.Hyper, tx):
    import optax

    def step(masters, opt_state, backbone, tokens, feats, tlogits, anchors, lr):
        (loss, met), grads = jax.value_and_grad(partial(loss_fn, cfg), has_aux=True)(
            masters, backbone, tokens, feats, tlogits, anchors)
        gb = grads["layers"]["ffn"]["gate"]["bias"]  # the balance signal (layers.balanced_gate), not a gradient
        grads["layers"]["ffn"]["gate"]["bias"] = jnp.zeros_like(gb)
        upd, opt_state = tx.update(grads, opt_state, masters)
        masters = optax.apply_updates(masters, jax.tree.map(lambda u: -lr * u, upd))
        gate = masters["layers"]["ffn"]["gate"]
        gate["bias"] = gate["bias"] - h.bias_gamma * jnp.sign(gb)
        return masters, opt_state, dict(met, loss=loss, grad_norm=optax.global_norm(grads))

    return step


# ----------------------------------------------------------------------------- evaluation
def measure(ev: SpecEval, params, held: D.TokenFile, rounds: int, n_new: int, prompt_len: int) -> dict:
    """Greedy speculative decoding of `rounds` x B held-out prompts (prompt_len tokens from document starts),
    n_new tokens each: measured acceptance, checked token for token against plain greedy decoding. distinct_4grams
    (distinct / all 4-grams of each generation, averaged) flags degenerate, repetitive generations, which inflate
    acceptance."""
    rng = np.random.default_rng([1234, n_new])
    res, mismatched, gen, distinct = [], 0, 0, []
    for _ in range(rounds):
        prompts = held.sample(rng, ev.B, prompt_len - 1, True)
        r = ev.run(params, prompts, n_new)
        ref = ev.greedy(params, prompts, n_new)
        mismatched += int(np.sum(r["tokens"] != ref))
        gen += ref.size
        for row in ref:
            grams = [tuple(row[i:i + 4]) for i in range(len(row) - 3)]
            distinct.append(len(set(grams)) / max(len(grams), 1))
        res.append(r)
    steps = sum(r["steps"] for r in res)
    per_pos = np.sum([np.asarray(r["per_position"]) * r["steps"] for r in res], 0) / max(steps, 1)
    mad = sum(r["accepted_drafts"] for r in res) / max(steps, 1)
    return {"k": ev.k, "prompts": rounds * ev.B, "prompt_tokens": prompt_len, "new_tokens": n_new,
            "verify_steps": steps, "per_position": [round(float(v), 4) for v in per_pos],
            "mean_accepted_drafts": round(mad, 4), "mean_accepted_length": round(1 + mad, 4),
            "mismatched_tokens_vs_greedy": mismatched, "generated_tokens": gen,
            "distinct_4grams": round(float(np.mean(distinct)), 4)}


# ----------------------------------------------------------------------------- outputs
def plot(curve, acceptance, path: Path, k: int) -> bool:
    try:
        import matplotlib
    except ImportError:  # the `bench` extra (pyproject.toml); the GPU image has it
        print("matplotlib is not installed: no curve PNG", flush=True)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    st = [c["step"] for c in curve]
    a1.plot(st, [c["loss"] for c in curve], lw=1)
    a1.set_xlabel("step")
    a1.set_ylabel("loss (weighted KL + 0.1 BCE)")
    a1.set_title("DSpark self-distillation")
    a1.grid(alpha=0.3)
    for i in range(k):
        line, = a2.plot(st, [c["top1"][i] for c in curve], lw=1, label=f"position {i + 1}: top-1 (teacher forced)")
        if acceptance:
            a2.axhline(acceptance["per_position"][i], color=line.get_color(), ls="--", lw=1)
    if acceptance:
        a2.set_title(f"dashed: measured greedy acceptance, held-out, {acceptance['new_tokens']} new tokens")
    a2.set_xlabel("step")
    a2.set_ylabel("agreement / acceptance")
    a2.set_ylim(0, 1)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def install(hf: Path, target: Path):
    """Replace the checkpoint files of `target` (config, index, shards) by those of `hf`; other files stay."""
    for p in target.iterdir():
        if p.name in ("config.json", "model.safetensors.index.json") or p.name.startswith("model-"):
            p.unlink()
    for p in hf.iterdir():
        if p.name in ("config.json", "model.safetensors.index.json") or p.name.startswith("model-"):
            shutil.copy2(p, target / p.name)


def _commit() -> str:
    import subprocess

    if os.environ.get("DSV41_COMMIT"):
        return os.environ["DSV41_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ----------------------------------------------------------------------------- main
def main(argv=None):
    a = parse(argv)
    if a.install_from:  # e.g. the files of a GPU run brought back: no training
        hf = Path(a.install_from)
        install(hf, Path(a.backbone))
        if (hf.parent / "dspark.json").exists():
            shutil.copy2(hf.parent / "dspark.json", Path(a.backbone) / "dspark.json")
        print(f"installed {hf} into {a.backbone}")
        return None
    t_all = time.perf_counter()
    if a.cache_dir and a.cache_dir.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import optax  # noqa: F401  (fail early when missing)

    from checkpoints import load, write_hf
    from checkpoints.packed_shards import repack
    from training.train_default import ensure_corpus

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.smoke and a.corpus == parse([]).corpus:
        a.corpus = str(out / "corpus")
    ensure_corpus(a)
    train, held = D.TokenFile(a.corpus, "train"), D.TokenFile(a.corpus, "heldout")

    cfg_b, backbone = load(a.backbone, weight_format="fp8", progress=False)
    if cfg_b.has_draft:  # retrain from scratch: the backbone alone
        cfg_b = cfg_b.replace(n_mtp_layers=0, dspark_block_size=0)
        backbone = {k: v for k, v in backbone.items() if k != "mtp"}
    cfg = draft_config(cfg_b, stages=a.stages, experts=a.experts, topk=a.topk, rank=a.rank)
    hasher = EngramHasher(cfg) if cfg.engram_layer_ids else None
    h = T.Hyper(peak_lr=a.peak_lr, warmup_frac=0.05)
    masters = jax.jit(lambda b: init_draft_masters(cfg, T.masters_from_params(cfg_b, b), a.seed))(backbone)
    tx = T.make_optimizer(h, masters)
    opt_state = jax.jit(tx.init)(masters)
    curve, step_i, elapsed0 = [], 0, 0.0
    ckpt = out / "ckpt.pkl"
    if a.resume and ckpt.exists():
        with open(ckpt, "rb") as f:
            d = pickle.load(f)
        masters, opt_state = jax.device_put(d["masters"]), jax.device_put(d["opt_state"])
        curve, step_i, elapsed0 = d["curve"], d["step"], d["elapsed"]
        print(f"resumed at step {step_i} ({elapsed0:.0f} s trained)", flush=True)

    B, Tn, N, k = a.batch, a.seq, a.anchors, cfg.dspark_block_size
    forward = jax.jit(lambda p, t, i: backbone_forward(cfg, p, t, i))  # step ignores params["mtp"]
    train_step = jax.jit(make_step(cfg, h, tx), donate_argnums=(0, 1))
    rng = np.random.default_rng([a.seed, step_i])
    W = cfg.window_size

    def batch():
        tokens, ids, _, _ = D.host_batch(cfg_b, hasher, train.sample(rng, B, Tn, False))
        anchors = np.sort(rng.integers(1, Tn - k + 1, (B, N)), axis=1).astype(np.int32)
        return jnp.asarray(tokens), None if ids is None else jnp.asarray(ids), jnp.asarray(anchors)

    # compile both programs before the clock starts
    t0 = time.perf_counter()
    tokens, ids, anchors = batch()
    tlogits, feats = forward(backbone, tokens, ids)
    lowered = train_step.lower(masters, opt_state, backbone, tokens, feats.x, tlogits, anchors, jnp.float32(0))
    train_step = lowered.compile()
    compile_s = time.perf_counter() - t0
    budget = max(0.0, a.total_minutes * 60 - (time.perf_counter() - t_all) - a.reserve)
    plan = f"{a.steps} steps" if a.steps else f"budget {budget:.0f} s"
    print(f"draft: {cfg.n_mtp_layers} stages x {cfg.draft_experts[0]} experts (top-{cfg.draft_experts[1]}), rank "
          f"{cfg.dspark_markov_rank}, targets {cfg.dspark_target_layer_ids}: {num_draft_params(cfg) / 1e6:.2f}M "
          "params; "
          f"compile {compile_s:.0f} s; training {plan}; {B}x{Tn} windows, {N} anchors each, window "
          f"{W}", flush=True)

    t_start, last_ckpt, pending = time.perf_counter(), time.perf_counter(), []
    bar = tqdm(total=int(budget), unit="s", desc="train dspark", mininterval=2.0, disable=a.smoke)
    done = 0.0
    while True:
        el = time.perf_counter() - t_start
        if (a.steps and step_i >= a.steps) or (not a.steps and el >= budget):
            break
        frac = (elapsed0 + el) / max(elapsed0 + budget, 1e-9) if not a.steps else step_i / a.steps
        tokens, ids, anchors = batch()
        tlogits, feats = forward(backbone, tokens, ids)
        masters, opt_state, met = train_step(masters, opt_state, backbone, tokens, feats.x, tlogits, anchors,
                                             jnp.float32(h.lr(frac)))
        step_i += 1
        pending.append(met)
        if len(pending) >= a.log_every:
            m = jax.device_get(pending)
            pending = []
            rec = {"step": step_i, "seconds": round(elapsed0 + el, 1), "loss": float(np.mean([x["loss"] for x in m])),
                   "kl": np.mean([x["kl"] for x in m], 0).round(4).tolist(),
                   "top1": np.mean([x["top1"] for x in m], 0).round(4).tolist(),
                   "bce": float(np.mean([x["bce"] for x in m]))}
            curve.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", top1=",".join(f"{v:.2f}" for v in rec["top1"]))
        bar.update(int(el) - int(done))
        done = el
        if time.perf_counter() - last_ckpt > a.ckpt_every:
            _save(ckpt, masters, opt_state, curve, step_i, elapsed0 + time.perf_counter() - t_start)
            last_ckpt = time.perf_counter()
    bar.close()
    trained_s = elapsed0 + time.perf_counter() - t_start
    _save(ckpt, masters, opt_state, curve, step_i, trained_s)

    # ---- the served draft: export, measure acceptance, write the checkpoint
    t_eval = time.perf_counter()
    params = jax.jit(lambda m, b: draft_params(cfg, b, m, qat=False))(masters, backbone)
    ev = SpecEval(cfg, hasher, B, Tn, forward=forward)
    acceptance = {}
    for setting in a.eval.split(","):
        rounds, n_new = (int(v) for v in setting.lower().split("x"))
        acceptance[f"new_{n_new}"] = measure(ev, params, held, rounds, n_new, Tn - n_new - 2 * k - 2)
    eval_s = time.perf_counter() - t_eval

    hf = out / "hf"
    write_hf(cfg, jax.device_get(params), hf, shard_size_mb=8, overwrite=True, progress=False)
    repack(hf, hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(a.backbone) / name).exists():
            shutil.copy2(Path(a.backbone) / name, hf / name)
    cfg2, p2 = load(hf, progress=False)  # the shipped checkpoint reloads to the same draft
    same = cfg2 == cfg and all(x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
                               for x, y in zip(jax.tree.leaves(p2["mtp"]), jax.tree.leaves(params["mtp"])))
    sizes = {p.name: p.stat().st_size for p in hf.iterdir() if p.name.startswith("model")}
    report = {
        "command": "python -m training.train_dspark " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "smoke": a.smoke,
        "draft": {"stages": cfg.n_mtp_layers, "experts": list(cfg.draft_experts), "markov_rank": cfg.dspark_markov_rank,
                  "block": k, "targets": list(cfg.dspark_target_layer_ids), "noise_token": cfg.dspark_noise_token_id,
                  "params": num_draft_params(cfg)},
        "training": {"objective": f"KL(backbone || draft) per block position, weights {POS_DECAY}^i; "
                                  f"{CONF_WEIGHT} x confidence BCE; QAT (served formats)",
                     "steps": step_i, "seconds": round(trained_s, 1), "compile_s": round(compile_s, 1),
                     "batch": [B, Tn], "anchors_per_window": N, "peak_lr": a.peak_lr, "curve": curve},
        "acceptance_greedy_heldout": acceptance, "eval_seconds": round(eval_s, 1),
        "checkpoint": {"reload_identical": bool(same), "files": sizes, "total_bytes": sum(sizes.values())},
        "total_seconds": round(time.perf_counter() - t_all, 1),
    }
    (out / "dspark.json").write_text(json.dumps(report, indent=1) + "\n")
    first = next(iter(acceptance.values()))
    plot(curve, first, out / "dspark_curve.png", k)
    if a.install:
        install(hf, Path(a.backbone))
        shutil.copy2(out / "dspark.json", Path(a.backbone) / "dspark.json")
    if a.results:
        Path(a.results).parent.mkdir(parents=True, exist_ok=True)
        keep = {k2: report[k2] for k2 in ("device", "jax", "date", "commit", "command")}
        Path(a.results).write_text(json.dumps(dict(keep, result={kk: report[kk] for kk in (
            "draft", "acceptance_greedy_heldout", "checkpoint", "total_seconds")} | {"training": {
                kk: v for kk, v in report["training"].items() if kk != "curve"}}), indent=1) + "\n")
    rows = [("draft", f"{cfg.n_mtp_layers} stages, {cfg.draft_experts[0]} experts, rank {cfg.dspark_markov_rank}, "
                      f"{num_draft_params(cfg) / 1e6:.2f}M params"),
            ("training", f"{step_i} steps in {trained_s:.0f} s (compile {compile_s:.0f} s)"),
            ("final top-1 (teacher forced)", ", ".join(f"{v:.2f}" for v in (curve[-1]["top1"] if curve else []))),
            *[(f"acceptance, {v['new_tokens']} new tokens ({v['prompts']} prompts)",
               f"per position {', '.join(f'{x:.3f}' for x in v['per_position'])}; mean accepted length "
               f"{v['mean_accepted_length']:.2f}; distinct 4-grams {v['distinct_4grams']:.2f}; spec == greedy "
               f"{v['generated_tokens'] - v['mismatched_tokens_vs_greedy']}/{v['generated_tokens']}")
              for v in acceptance.values()],
            ("checkpoint", f"{sum(sizes.values()) / 2 ** 20:.1f} MiB in {len(sizes)} files, largest "
                           f"{max(sizes.values()) / 2 ** 20:.2f} MiB, reload identical: {same}"),
            ("total", f"{time.perf_counter() - t_all:.0f} s")]
    print("\n" + "\n".join(f"{n:<44} {v}" for n, v in rows), flush=True)
    return report


def _save(path: Path, masters, opt_state, curve, step, elapsed):
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"masters": jax.device_get(masters), "opt_state": jax.device_get(opt_state), "curve": curve,
                     "step": step, "elapsed": elapsed}, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
