"""Train the embedded default model (dsv41_jax/default_model) on the Python standard library, export it, evaluate it.

    python -m bench.train_default --tokenizer-only                 # CPU, seconds: BPE tokenizer -> default_model/
    python -m bench.train_default --minutes 6 --out runs/default    # one H200, < 9 min in all
    python -m bench.train_default --smoke --out /tmp/smoke          # CPU, < 1 min: the whole pipeline, 3 steps

The model (`model_config`): the V4.1 structure at ~11M backbone parameters with an 8K context. 8 layers: 0 SWA
only; 1-3 ratio 2 (1: KV + index source, Engram; 2-3 reuse); decoder 4-7 ratio 1 (4: KV source and candidate
source, 5 reuse, 6 Reindex, 7 reuse); window 128, index top-128 of up to 8192 entries inside 64 candidate
blocks of 8; 8 routed experts (top-2) + a shared one; mHC x4; vocabulary 8192 (bench.stdlib_corpus).

Training (training.objective): f32 masters, quantization-aware forward with the served FP8 / MXFP4 formats (straight-
through), bf16 compute, AdamW with a cosine schedule over the wall-clock budget, aux-loss-free expert balancing,
an indexer KL term. Batches are random windows of the training stream: 1024-token windows (32 per step) and,
every `--long-every` steps, 8192-token windows (4 per step) starting at a document start (long files favoured).
Training stops at the budget or after `--max-epochs` passes over the training tokens, whichever comes first;
the checkpoint exported is the one with the best validation loss (evaluated every `--eval-every` seconds).

Outputs in --out: the HF-layout checkpoint (config.json, safetensors, index), tokenizer.json,
tokenizer_config.json, training.json (training facts, split, held-out losses of the exported checkpoint as
reloaded by `checkpoints.load`, check snippets with their loss for tests/test_default_model.py, a sample
completion). A summary table is printed last. Copy the directory's files into dsv41_jax/default_model/.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import dsv41_jax  # noqa: F401  (XLA flags before the backend starts)
from bench import stdlib_corpus as corpus
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.params import num_params
from training import objective as T

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / "dsv41_jax" / "default_model"


def model_config(**overrides) -> ModelConfig:
    kw = dict(
        name="dsv41-stdlib-8k", vocab_size=corpus.VOCAB_SIZE, dim=256, n_layers=8, n_heads=4, head_dim=64,
        rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=64, window_size=128, norm_eps=1e-20,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layers=(1, 4), index_source_layers=(1, 4, 6),
        index_n_heads=4, index_head_dim=64, index_topk=128, candidate_source_layer=4, candidate_topk_blocks=64,
        candidate_block_size=8, rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=0,
        n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=96, route_scale=1.5,
        swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=(1,),
        engram_max_ngram_size=3, engram_vocab_size=6007, engram_n_heads=2, engram_head_dim=32,
        engram_pad_id=corpus.PAD, engram_compressed_vocab_size=corpus.VOCAB_SIZE, max_seq_len=8192,
        weight_format="fp8", compute_dtype="bfloat16", qdq=True)
    kw.update(overrides)
    return ModelConfig(**kw)


# ----------------------------------------------------------------------------- data
class Data:
    """Token streams of the three splits and a background batch maker (windows + Engram rows on the host)."""

    def __init__(self, tok, files: dict, *, chat_fraction: float, seed: int):
        t0 = time.perf_counter()
        self.files = files
        docs = {k: corpus.encode_docs(tok, [f.text() for f in v]) for k, v in files.items()}
        chats = corpus.encode_docs(tok, corpus.chat_documents(files["train"], chat_fraction, seed))
        rng = np.random.default_rng(seed)
        train = docs["train"] + chats
        order = rng.permutation(len(train))
        train = [train[i] for i in order]
        self.train = corpus.stream(train)
        lens = np.asarray([len(d) for d in train])
        self.doc_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        self.doc_weights = lens / lens.sum()
        self.valid = corpus.stream(docs["valid"])
        self.heldout = corpus.stream(docs["heldout"])
        self.heldout_docs = docs["heldout"]
        self.n_chat = len(chats)
        self.encode_s = time.perf_counter() - t0

    def sample(self, rng, batch: int, length: int, long: bool) -> np.ndarray:
        """[batch, length + 1] windows of the training stream (wrapping around its end)."""
        n = len(self.train)
        if long:
            starts = self.doc_starts[rng.choice(len(self.doc_starts), batch, p=self.doc_weights)]
        else:
            starts = rng.integers(0, n, batch)
        idx = (starts[:, None] + np.arange(length + 1)[None]) % n
        return self.train[idx]


def make_batch(cfg, hasher, win: np.ndarray, mask=None):
    tokens = np.ascontiguousarray(win[:, :-1])
    targets = np.ascontiguousarray(win[:, 1:])
    mask = np.ones(targets.shape, np.float32) if mask is None else mask
    return tokens, T.host_engram_ids(cfg, hasher, tokens), targets, mask


class Prefetch:
    """A thread that keeps a few batches of each kind ready."""

    def __init__(self, data: Data, cfg, hasher, shapes: dict, seed: int, depth: int = 3):
        self.q = {k: queue.Queue(depth) for k in shapes}
        self.stop = False
        self.threads = []
        for i, (kind, (b, t)) in enumerate(shapes.items()):
            rng = np.random.default_rng(seed + 1000 * (i + 1))

            def run(kind=kind, b=b, t=t, rng=rng):
                while not self.stop:
                    item = make_batch(cfg, hasher, data.sample(rng, b, t, kind == "long"))
                    while not self.stop:
                        try:
                            self.q[kind].put(item, timeout=0.2)
                            break
                        except queue.Full:
                            continue

            th = threading.Thread(target=run, daemon=True)
            th.start()
            self.threads.append(th)

    def get(self, kind):
        return self.q[kind].get()

    def close(self):
        self.stop = True


# ----------------------------------------------------------------------------- evaluation
class Evaluator:
    """Mean next-token NLL of fixed windows with a served (fp8-format) parameter tree, one compiled program per
    window shape; optionally the indexer's recall (attention mass in its top-k) through the training hooks."""

    def __init__(self, cfg, hasher, batch: int, length: int, recall_stride: int = 0):
        self.cfg, self.hasher, self.batch, self.length = cfg, hasher, batch, length
        self.stride = recall_stride
        self.fn = None

    def _compile(self, params, args):
        self.fn = jax.jit(T.eval_step(self.cfg, self.stride)).lower(params, *args).compile()

    def nll(self, params, win: np.ndarray, mask=None):
        """win [n, length+1] -> (per-token NLL [n, length] as numpy, summed recall metrics)."""
        n = len(win)
        out, rec = [], {"mass": 0.0, "random": 0.0, "rows": 0.0}
        for i in range(0, n, self.batch):
            w = win[i:i + self.batch]
            pad = self.batch - len(w)
            if pad:
                w = np.concatenate([w, np.full((pad, w.shape[1]), corpus.PAD, np.int32)])
            tokens, ids, targets, _ = make_batch(self.cfg, self.hasher, w)
            args = (tokens, ids, targets)
            if self.fn is None:
                self._compile(params, args)
            nll, met = self.fn(params, *args)
            out.append(np.asarray(nll)[: self.batch - pad])
            r = float(met["recall_rows"])
            rec["rows"] += r
            rec["mass"] += float(met["recall"]) * r
            rec["random"] += float(met["recall_random"]) * r
        nll = np.concatenate(out) if out else np.zeros((0, self.length))
        return nll, rec


def mean_nll(nll, mask=None) -> float:
    if mask is None:
        return float(np.mean(nll)) if nll.size else float("nan")
    return float(np.sum(nll * mask) / max(np.sum(mask), 1))


# ----------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "runs" / "default_model"))
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the training loop")
    ap.add_argument("--total-minutes", type=float, default=8.5,
                    help="cut the training budget so that the whole run (compiles, export, eval) ends by then")
    ap.add_argument("--reserve", type=float, default=60.0, help="seconds kept for export and evaluation")
    ap.add_argument("--max-epochs", type=float, default=10.0, help="stop after this many passes over the data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL_DIR), help="directory with tokenizer.json")
    ap.add_argument("--stdlib-root", default=None, help="corpus root (default: this interpreter's stdlib)")
    ap.add_argument("--short", default="32x1024", help="BxT of the short batches")
    ap.add_argument("--long", default="4x8192", help="BxT of the long batches")
    ap.add_argument("--long-every", type=int, default=5, help="every N-th step is a long batch (0: never)")
    ap.add_argument("--peak-lr", type=float, default=2e-3)
    ap.add_argument("--aux-stride", type=int, default=8, help="indexer KL on every N-th query row (0: off)")
    ap.add_argument("--chat-fraction", type=float, default=0.1, help="training files also shown as a chat")
    ap.add_argument("--eval-every", type=float, default=20.0, help="seconds between validation evaluations")
    ap.add_argument("--max-eval-tokens", type=int, default=1_000_000, help="held-out tokens for the 1K loss")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: budget)")
    ap.add_argument("--log-every", type=int, default=100, help="print the step metrics every N steps (0: never)")
    ap.add_argument("--tokenizer-only", action="store_true", help="train the tokenizer into --tokenizer and exit")
    ap.add_argument("--cache-dir", default=str(REPO / "runs" / "jax_cache"),
                    help="persistent compilation cache ('none': off); a second run on the same machine compiles less")
    ap.add_argument("--fast-compile", action="store_true", help="XLA GPU autotuning off (faster compiles)")
    ap.add_argument("--smoke", action="store_true", help="CPU pipeline check: few files, tiny batches, 3 steps")
    a = ap.parse_args(argv)
    if a.smoke:
        a.short, a.long_every, a.steps, a.eval_every, a.log_every = "2x128", 0, a.steps or 3, 1e9, 1
        a.max_eval_tokens = 2 * 1024
    return a


def _shape(s: str) -> tuple[int, int]:
    b, t = s.lower().split("x")
    return int(b), int(t)


def train_tokenizer(a) -> None:
    files = corpus.split(corpus.list_files(a.stdlib_root, tests=False))["train"]
    t0 = time.perf_counter()
    tok = corpus.train_tokenizer([f.text() for f in files])
    corpus.write_tokenizer(tok, Path(a.tokenizer))
    print(f"tokenizer: {tok.get_vocab_size()} ids from {len(files)} training files (no test suites) in "
          f"{time.perf_counter() - t0:.1f} s -> {a.tokenizer}")


def main(argv=None):
    a = parse(argv)
    if a.tokenizer_only:
        return train_tokenizer(a)
    import optax  # noqa: F401  (fail early when missing)

    if a.fast_compile:  # before the backend starts (it starts at the first computation)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    if a.cache_dir and a.cache_dir.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from checkpoints import load, write_hf
    from checkpoints.packed_shards import repack

    t_all = time.perf_counter()
    cfg = model_config()
    tok = corpus.load_tokenizer(a.tokenizer)
    assert tok.get_vocab_size() == cfg.vocab_size, "tokenizer and model vocabulary differ"
    hasher = EngramHasher(cfg)
    files = corpus.split(corpus.list_files(a.stdlib_root))
    all_heldout = files["heldout"]
    if a.smoke:
        files = {"train": files["train"][:40], "valid": files["valid"][:4], "heldout": files["heldout"][:6]}
    data = Data(tok, files, chat_fraction=a.chat_fraction, seed=a.seed)
    print(f"corpus: {sum(len(v) for v in files.values())} files; train {len(data.train):,} tokens "
          f"({len(files['train'])} files + {data.n_chat} chats), valid {len(data.valid):,}, held-out "
          f"{len(data.heldout):,}; tokenized in {data.encode_s:.1f} s", flush=True)

    h = T.Hyper(peak_lr=a.peak_lr, aux_stride=a.aux_stride)
    shapes = {"short": _shape(a.short)}
    if a.long_every:
        shapes["long"] = _shape(a.long)
    masters = jax.jit(lambda: T.init_masters(cfg, a.seed))()
    tx = T.make_optimizer(h, masters)
    opt_state = jax.jit(tx.init)(masters)

    # ---- compile (timed separately from the budget)
    t0 = time.perf_counter()
    step_fn = jax.jit(T.make_train_step(cfg, h, tx), donate_argnums=(0, 1))
    compiled = {}
    have = dataclasses.asdict(T.train_hooks(h))  # the model's training hooks the step runs with
    for kind, (b, t) in shapes.items():
        ex = make_batch(cfg, hasher, np.zeros((b, t + 1), np.int32))
        compiled[kind] = step_fn.lower(masters, opt_state, *ex, jnp.float32(0)).compile()
    export = jax.jit(lambda m: T.export_params(cfg, m))
    probe = export(masters)
    evals = Evaluator(cfg, hasher, batch=8 if not a.smoke else 2, length=1024)
    vwin = corpus.windows(data.valid, evals.length + 1, limit=64 if not a.smoke else 2)
    evals.nll(probe, vwin[: evals.batch])  # compiles the eval programs before the clock starts
    texts = corpus.check_texts(tok, all_heldout)
    cwin = corpus.check_windows(tok, texts)
    del probe
    compile_s = time.perf_counter() - t0
    print(f"compiled {len(compiled)} train programs + evals in {compile_s:.1f} s (hooks: {have})", flush=True)

    # ---- train (the budget also keeps the whole run within --total-minutes)
    left = a.total_minutes * 60.0 - (time.perf_counter() - t_all) - a.reserve
    budget = max(min(a.minutes * 60.0, left), 10.0)
    if budget < a.minutes * 60.0:
        print(f"training budget cut to {budget:.0f} s to finish within --total-minutes {a.total_minutes}")
    tok_per_step = {k: b * t for k, (b, t) in shapes.items()}
    pf = Prefetch(data, cfg, hasher, shapes, a.seed)
    curve, best = [], (math.inf, None, 0)
    step, seen, last_eval = 0, 0, -math.inf
    pending, pending_kind, pending_lr, last = None, None, 0.0, {}
    t_start = time.perf_counter()
    bar = tqdm(total=int(budget), unit="s", desc="train", mininterval=1.0, disable=a.smoke)
    metrics = {}
    while True:
        el = time.perf_counter() - t_start
        epochs = seen / max(len(data.train), 1)
        if (a.steps and step >= a.steps) or (not a.steps and (el >= budget or epochs >= a.max_epochs)):
            break
        frac = step / a.steps if a.steps else max(el / budget, epochs / a.max_epochs)
        kind = "long" if a.long_every and step % a.long_every == a.long_every - 1 else "short"
        batch = pf.get(kind)
        lr = h.lr(frac)
        masters, opt_state, met = compiled[kind](masters, opt_state, *batch, jnp.float32(lr))
        if pending is not None:
            metrics = {k: float(v) for k, v in jax.device_get(pending).items()}
            last[pending_kind] = metrics
            if a.log_every and (step - 1) % a.log_every == 0:
                tqdm.write(f"step {step - 1:>5} ce {metrics['ce']:.4f} indexer-kl {metrics['indexer_kl']:.4f} "
                           f"grad-norm {metrics['grad_norm']:.3f} expert-imbalance {metrics['expert_imbalance']:.3f} "
                           f"lr {pending_lr:.2e} t {el:.0f}s")
        pending, pending_kind, pending_lr = met, kind, lr
        step += 1
        seen += tok_per_step[kind]
        bar.update(int(time.perf_counter() - t_start) - bar.n)
        if metrics:
            bar.set_postfix(ce=f"{metrics['ce']:.3f}", kl=f"{metrics['indexer_kl']:.2f}", ep=f"{epochs:.2f}",
                            refresh=False)
        if el - last_eval >= a.eval_every or (a.steps and step == a.steps):
            last_eval = el
            vl = mean_nll(evals.nll(export(masters), vwin)[0])
            curve.append({"t": round(el, 1), "step": step, "epochs": round(epochs, 3),
                          "train_ce": round(metrics.get("ce", float("nan")), 4), "valid": round(vl, 4),
                          "indexer_kl": round(metrics.get("indexer_kl", float("nan")), 4)})
            if vl < best[0]:
                best = (vl, jax.tree.map(jnp.copy, masters), step)
    if pending is not None:
        metrics = {k: float(v) for k, v in jax.device_get(pending).items()}
        last[pending_kind] = metrics
    train_s = time.perf_counter() - t_start
    # the indexer's recall on the last training batch of each length: attention mass (over the compressed entries
    # of every index layer, averaged) in its top-k, on query rows with more visible entries than k
    recall = {f"{kind} ({'x'.join(map(str, shapes[kind]))})": {"recall": round(m["recall"], 4),
                                                              "random": round(m["recall_random"], 4)}
              for kind, m in last.items()}
    bar.close()
    pf.close()
    vl = mean_nll(evals.nll(export(masters), vwin)[0])
    curve.append({"t": round(train_s, 1), "step": step, "epochs": round(seen / len(data.train), 3),
                  "train_ce": round(metrics.get("ce", float("nan")), 4), "valid": round(vl, 4),
                  "indexer_kl": round(metrics.get("indexer_kl", float("nan")), 4)})
    if vl <= best[0] or best[1] is None:
        best = (vl, masters, step)

    # ---- export, reload through the loader, evaluate the served checkpoint
    out = Path(a.out)
    params = jax.device_get(export(best[1]))
    info = write_hf(cfg, params, out, shard_size_mb=8, overwrite=True, progress=False)
    repack(out, out)  # every file under 4 MiB (the repository's rule): small shards, the embedding / head xz'd
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(a.tokenizer) / name, out / name)
    cfg2, served = load(out, progress=False)
    assert cfg2 == cfg, "config.json does not round-trip"
    hwin = corpus.windows(data.heldout, evals.length + 1, limit=max(1, a.max_eval_tokens // evals.length))
    hn, _ = evals.nll(served, hwin)
    # the check documents through the same program, padded to its window (causal: padding after them is inert)
    pad = np.full((len(cwin), evals.length + 1 - cwin.shape[1]), corpus.PAD, np.int32)
    cn = evals.nll(served, np.concatenate([cwin, pad], axis=1))[0][:, :cwin.shape[1] - 1]
    check_loss = mean_nll(cn)

    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    facts = {
        "model": {"name": cfg.name, "backbone_params": num_params(cfg), "engram_table_params":
                  cfg.num_engram_table_params(), "max_seq_len": cfg.max_seq_len, "vocab_size": cfg.vocab_size},
        "corpus": {"root": str(corpus.stdlib_root() if a.stdlib_root is None else a.stdlib_root),
                   "python": sys.version.split()[0],
                   "split_rule": f"sha256(relative posix path)[:16 hex] % 100: < {corpus.HELD_OUT_PERCENT} held-out, "
                                 f"< {corpus.HELD_OUT_PERCENT + corpus.VALID_PERCENT} validation, else train",
                   "files": {k: len(v) for k, v in files.items()},
                   "tokens": {"train": int(len(data.train)), "valid": int(len(data.valid)),
                              "heldout": int(len(data.heldout))},
                   "chat_documents": data.n_chat, "smoke": a.smoke,
                   "heldout_files": [[f.rel, f.sha1()] for f in files["heldout"]]},
        "training": {"seed": a.seed, "steps": step, "best_step": best[2], "train_seconds": round(train_s, 1),
                     "compile_seconds": round(compile_s, 1), "tokens_seen": int(seen),
                     "tokens_per_second": round(seen / max(train_s, 1e-9)), "epochs": round(seen / len(data.train), 3),
                     "batches": {k: f"{b}x{t}" for k, (b, t) in shapes.items()}, "long_every": a.long_every,
                     "final_train_ce": round(metrics.get("ce", float("nan")), 4),
                     "final_indexer_kl": round(metrics.get("indexer_kl", float("nan")), 4),
                     "hyper": {k: getattr(h, k) for k in h.__dataclass_fields__}, "hooks": have,
                     "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "curve": curve},
        "eval": {"valid_loss_best": round(best[0], 4),
                 "heldout_loss_1k": round(mean_nll(hn), 4), "heldout_tokens_1k": int(hn.size),
                 "indexer_recall": recall},
        "check": {"texts": texts, "length": corpus.CHECK_LEN, "tokens": int(cn.size), "loss": round(check_loss, 5),
                  "ids_sha1": hashlib.sha1(np.ascontiguousarray(cwin, np.int32).tobytes()).hexdigest(),
                  "per_document": [round(float(x), 5) for x in cn.mean(1)]},
        "files": sizes, "checkpoint_bytes": info["total_bytes"],
        "wall_seconds": round(time.perf_counter() - t_all, 1),
    }
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    e, tr = facts["eval"], facts["training"]
    rows = [("train tokens", f"{len(data.train):,}"), ("steps / epochs", f"{step} / {tr['epochs']}"),
            ("tokens/s", f"{tr['tokens_per_second']:,}"), ("compile s / train s", f"{compile_s:.0f} / {train_s:.0f}"),
            ("final train CE", f"{tr['final_train_ce']}"), ("best valid (step)", f"{best[0]:.4f} ({best[2]})"),
            ("held-out loss 1K ctx", f"{e['heldout_loss_1k']} ({e['heldout_tokens_1k']:,} tok)"),
            ("indexer recall (random)", "; ".join(f"{k} {v['recall']} ({v['random']})" for k, v in recall.items())),
            ("check loss", f"{check_loss:.4f}"), ("checkpoint MB", f"{info['total_bytes'] / 1e6:.2f}"),
            ("wall s", f"{facts['wall_seconds']}")]
    print("\n" + "\n".join(f"{k:<28} {v}" for k, v in rows))
    return facts


if __name__ == "__main__":
    main()
