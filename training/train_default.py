"""Train the embedded default model (dsv41_jax/default_model) on Python code, export it, evaluate it.

    python -m training.code_corpus --out /tmp/corpus                      # the corpus (GPU machine: ~1 min)
    python -m training.train_default --corpus /tmp/corpus --out /tmp/run  # one H200, --total-minutes in all
    python -m training.train_default --corpus /tmp/corpus --probe 2048x32,8192x8    # throughput only
    python -m training.train_default --smoke --out /tmp/smoke             # CPU: the whole pipeline, tiny

The model (`model_config`): the V4.1 structure at 13.0M backbone parameters with an 8K context. 8 layers: 0 SWA
only; 1-3 ratio 2 (1: KV + index source, Engram; 2-3 reuse); decoder 4-7 ratio 1 (4: KV source and candidate
source, 5 reuse, 6 Reindex, 7 reuse); window 128, index top-128 of up to 8192 entries inside 64 candidate
blocks of 8; 8 routed experts (top-2, 128 wide) + a shared one; mHC x4; 4 output groups; vocabulary 8192
(training.corpus). Every width that tensor parallelism splits is a multiple of 32 x 4, so TP2 and TP4 load it.

Training (training.objective): f32 masters, quantization-aware forward with the served FP8 / MXFP4 formats
(straight-through), bf16 compute, AdamW with warm-up + cosine over the wall-clock budget, aux-loss-free expert
balancing, an indexer KL term. Data parallel: batches sharded over a mesh of all devices (training.data), made
by background threads. A context curriculum (`--phases`): each phase a (B x T) shape and a share of the budget,
by default most of the time at 2K tokens and the last part at 8K windows starting at document starts; 64K
tokens per step, because the step takes about 820 KB of GPU memory per token (64 x 2048 needed 107 GB on the H200
and ran out of memory beside the eval program: bench/results/train_throughput_h200.json). The step
is compiled once per phase shape (persistent compilation cache), with donated buffers, and the host reads the
metrics only every `--log-every` steps. A checkpoint (masters, optimizer state, step, elapsed time) is written
every `--ckpt-every` seconds and at the end; `--resume` continues from it. The exported checkpoint is the one with
the best validation loss.

Outputs in --out: the HF-layout checkpoint (config.json, safetensors, index, packed: every file <= 4 MiB),
training.json (corpus manifest with licences, training facts and curve, held-out loss and bits per byte per
held-out file, check snippets for tests/test_default_model.py), loss_curve.png. A summary table is printed last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import dsv41_jax  # noqa: F401  (XLA flags before the backend starts)
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.params import num_params
from dsv41_jax.train_attention import TRAIN_ATTENTION
from training import corpus
from training import data as D
from training import objective as T
from training.evaluate import Evaluator, bits_per_byte

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / "dsv41_jax" / "default_model"


def model_config(**overrides) -> ModelConfig:
    kw = dict(
        name="dsv41-pycode-8k", vocab_size=corpus.VOCAB_SIZE, dim=256, n_layers=8, n_heads=4, head_dim=64,
        rope_head_dim=16, q_lora_rank=128, o_groups=4, o_lora_rank=32, window_size=128, norm_eps=1e-20,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layers=(1, 4), index_source_layers=(1, 4, 6),
        index_n_heads=4, index_head_dim=64, index_topk=128, candidate_source_layer=4, candidate_topk_blocks=64,
        candidate_block_size=8, rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=0,
        n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=128, route_scale=1.5,
        swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=(1,),
        engram_max_ngram_size=3, engram_vocab_size=6007, engram_n_heads=2, engram_head_dim=32,
        engram_pad_id=corpus.PAD, engram_compressed_vocab_size=corpus.VOCAB_SIZE, max_seq_len=8192,
        weight_format="fp8", compute_dtype="bfloat16", qdq=True)
    kw.update(overrides)
    return ModelConfig(**kw)


# ----------------------------------------------------------------------------- arguments
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "runs" / "default_model"))
    ap.add_argument("--corpus", default=str(REPO / "runs" / "corpus"),
                    help="directory of training.code_corpus (built there first when it has no manifest.json)")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget of the training loop")
    ap.add_argument("--total-minutes", type=float, default=9.0,
                    help="cut the training budget so that the whole run (compiles, export, eval) ends by then")
    ap.add_argument("--reserve", type=float, default=60.0, help="seconds kept for export and evaluation")
    ap.add_argument("--phases", default="2048x32:0.88,8192x8:0.12",
                    help="context curriculum: TxB:share,... (shares of the budget, in order)")
    ap.add_argument("--probe", default="", help="TxB,...: time each shape's step (--probe-steps) and exit")
    ap.add_argument("--probe-steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", default="blocked", choices=TRAIN_ATTENTION,
                    help="the attention core's training form (dsv41_jax.train_attention; eval/export: served)")
    ap.add_argument("--head", default="f32", choices=("f32", "bf16"),
                    help="the LM head GEMM's operands in training (ops.TrainHooks.head_bf16; eval/export: f32)")
    ap.add_argument("--tokenizer", default=str(DEFAULT_MODEL_DIR), help="directory with tokenizer.json")
    ap.add_argument("--peak-lr", type=float, default=2e-3)
    ap.add_argument("--aux-stride", type=int, default=16, help="indexer KL on every N-th query row (0: off)")
    ap.add_argument("--eval-every", type=float, default=45.0, help="seconds between validation evaluations")
    ap.add_argument("--eval-len", type=int, default=2048, help="window of the validation / held-out scoring")
    ap.add_argument("--max-eval-tokens", type=int, default=1_500_000, help="held-out tokens scored per file")
    ap.add_argument("--ckpt-every", type=float, default=120.0, help="seconds between resumable checkpoints")
    ap.add_argument("--resume", action="store_true",
                    help="continue from --out/ckpt.pkl (or, without it, from the masters of --out/masters.pkl with a "
                         "fresh optimizer state)")
    ap.add_argument("--init-from", default="", metavar="HF_DIR",
                    help="start from a served checkpoint (e.g. dsv41_jax/default_model; a draft in it is dropped): "
                         "its dequantized weights as masters, a fresh optimizer state and a new schedule over "
                         "--minutes (continued training); its training.json is kept as the run's first stage")
    ap.add_argument("--pause-at", type=float, default=0.0,
                    help="unix time: stop the training loop there, write the checkpoint (and masters.pkl) and exit "
                         "without export; `--resume` continues the same schedule (a run split over two device calls)")
    ap.add_argument("--wait-corpus", type=float, default=0.0,
                    help="seconds to wait for --corpus/manifest.json written by another process (the programs are "
                         "compiled meanwhile); 0: build it here when missing")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: budget)")
    ap.add_argument("--log-every", type=int, default=50, help="read and print the step metrics every N steps")
    ap.add_argument("--tokenizer-only", action="store_true", help="train the tokenizer into --tokenizer and exit")
    ap.add_argument("--cache-dir", default=str(REPO / "runs" / "jax_cache"),
                    help="persistent compilation cache ('none': off)")
    ap.add_argument("--smoke", action="store_true", help="CPU pipeline check: tiny corpus and batches, 3 steps")
    a = ap.parse_args(argv)
    if a.smoke:
        a.phases, a.steps, a.eval_every, a.log_every = "128x2:0.7,256x2:0.3", a.steps or 3, 1e9, 1
        a.eval_len = corpus.CHECK_LEN
        a.max_eval_tokens = 4096
    return a


def _shape(s: str) -> tuple[int, int]:
    """'TxB' -> (B, T)."""
    t, b = s.lower().split("x")
    return int(b), int(t)


def _phases(s: str) -> list[tuple[tuple[int, int], float]]:
    out = []
    for part in s.split(","):
        shape, share = part.split(":")
        out.append((_shape(shape), float(share)))
    tot = sum(x for _, x in out)
    return [(sh, x / tot) for sh, x in out]


def train_tokenizer(a) -> None:
    files = corpus.split(corpus.list_files(None, tests=False))["train"]
    t0 = time.perf_counter()
    tok = corpus.train_tokenizer([f.text() for f in files])
    corpus.write_tokenizer(tok, Path(a.tokenizer))
    print(f"tokenizer: {tok.get_vocab_size()} ids from {len(files)} training files in "
          f"{time.perf_counter() - t0:.1f} s -> {a.tokenizer}")


def ensure_corpus(a) -> dict:
    from training import code_corpus

    d = Path(a.corpus)
    if not (d / "manifest.json").exists():
        code_corpus.build(d, Path(a.tokenizer), max_bytes=int(3e6 if a.smoke else 1.5e9), chat_fraction=0.04,
                          tool_fraction=0.04 if not a.smoke else 0.3, seed=a.seed)
    return json.loads((d / "manifest.json").read_text())


# ----------------------------------------------------------------------------- state
class Run:
    """Masters, optimizer state, and one compiled step per batch shape."""

    def __init__(self, cfg, h, mesh, seed):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.cfg, self.h, self.mesh = cfg, h, mesh
        rep = NamedSharding(mesh, P())
        self.masters = jax.jit(lambda: T.init_masters(cfg, seed), out_shardings=rep)()
        self.tx = T.make_optimizer(h, self.masters)
        self.opt_state = jax.jit(self.tx.init)(self.masters)
        self.step_fn = jax.jit(T.make_train_step(cfg, h, self.tx), donate_argnums=(0, 1))
        self.compiled, self.compile_s = {}, {}
        self.export = jax.jit(lambda m: T.export_params(cfg, m))

    def compile(self, hasher, shape):
        if shape in self.compiled:
            return
        t0 = time.perf_counter()
        b, t = shape
        ex = D.shard(self.mesh, D.host_batch(self.cfg, hasher, np.zeros((b, t + 1), np.int32)))
        self.compiled[shape] = self.step_fn.lower(self.masters, self.opt_state, *ex, jnp.float32(0)).compile()
        self.compile_s[f"{t}x{b}"] = round(time.perf_counter() - t0, 1)

    def compile_all(self, hasher, shapes, extra=()):
        """Compile the step for every shape, plus the `extra` thunks, in concurrent threads (XLA compiles with
        the GIL released; the persistent cache serves a second run)."""
        from concurrent.futures import ThreadPoolExecutor

        jobs = [lambda sh=sh: self.compile(hasher, sh) for sh in dict.fromkeys(shapes)] + list(extra)
        with ThreadPoolExecutor(len(jobs)) as pool:
            for f in [pool.submit(j) for j in jobs]:
                f.result()

    def step(self, shape, batch, lr):
        self.masters, self.opt_state, met = self.compiled[shape](self.masters, self.opt_state, *batch,
                                                                 jnp.float32(lr))
        return met

    def init_from(self, directory: Path) -> dict:
        """Masters from a served checkpoint (continued training): every weight dequantized, the optimizer state
        left fresh. Returns the checkpoint's training facts (its training.json's "training"; {} without one)."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from checkpoints import load

        cfg_c, params = load(directory, weight_format="fp8", progress=False)
        if cfg_c.has_draft:  # the backbone alone; the draft is retrained on the new backbone (train_dspark)
            cfg_c = cfg_c.replace(n_mtp_layers=0, dspark_block_size=0)
            params = {k: v for k, v in params.items() if k != "mtp"}
        diff = {k: (getattr(cfg_c, k), getattr(self.cfg, k)) for k in self.cfg.__dataclass_fields__
                if k != "name" and not k.startswith("dspark_") and getattr(cfg_c, k) != getattr(self.cfg, k)}
        if diff:  # the backbone's shapes and formats (the name and the draft's fields aside)
            raise ValueError(f"--init-from {directory}: its config differs from the trainer's (checkpoint, "
                             f"trainer): {diff}")
        masters = jax.jit(lambda p: T.masters_from_params(self.cfg, p),
                          out_shardings=NamedSharding(self.mesh, P()))(params)
        shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
        if shapes(masters) != shapes(self.masters):
            raise ValueError(f"--init-from {directory}: its parameter tree differs from the trainer's masters")
        self.masters = masters
        facts = Path(directory) / "training.json"
        return json.loads(facts.read_text()).get("training", {}) if facts.exists() else {}

    def save(self, path: Path, extra: dict):
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump({"masters": jax.device_get(self.masters), "opt_state": jax.device_get(self.opt_state),
                         **extra}, f)
        os.replace(tmp, path)

    def save_masters(self, path: Path, extra: dict):
        """The masters alone (a third of the checkpoint): small enough to carry between machines."""
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump({"masters": jax.device_get(self.masters), **extra}, f)
        os.replace(tmp, path)

    def load(self, path: Path) -> dict:
        """Restore a checkpoint; one without "opt_state" (masters.pkl) keeps the fresh optimizer state."""
        with open(path, "rb") as f:
            d = pickle.load(f)
        put = lambda tree, like: jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), tree, like)  # noqa: E731
        self.masters = put(d.pop("masters"), self.masters)
        if "opt_state" in d:
            self.opt_state = put(d.pop("opt_state"), self.opt_state)
        return d


def probe(a, cfg, h, mesh, hasher, train):
    """Compile and time each --probe shape: median step seconds after 2 warm-up steps."""
    run = Run(cfg, h, mesh, a.seed)
    rows = []
    for s in a.probe.split(","):
        shape = _shape(s)
        run.compile(hasher, shape)
        pf = D.Prefetch(train, cfg, hasher, mesh, shape, long=shape[1] >= 8192, seed=a.seed)
        t_host = time.perf_counter()
        D.host_batch(cfg, hasher, train.sample(np.random.default_rng(0), *shape, False))
        t_host = time.perf_counter() - t_host
        times, met = [], None
        for _i in range(a.probe_steps):
            batch = pf.get()
            t0 = time.perf_counter()
            met = run.step(shape, batch, 1e-4)
            jax.block_until_ready(met)
            times.append(time.perf_counter() - t0)
        # free-running (no sync per step, prefetch feeding): what the training loop sees
        t0 = time.perf_counter()
        for _i in range(a.probe_steps):
            met = run.step(shape, pf.get(), 1e-4)
        jax.block_until_ready(met)
        free = (time.perf_counter() - t0) / a.probe_steps
        pf.close()
        med = float(np.median(times[2:]))
        b, t = shape
        mem = jax.devices()[0].memory_stats() or {}
        rows.append({"shape": f"{t}x{b}", "tokens_per_step": b * t, "compile_s": run.compile_s[f"{t}x{b}"],
                     "step_s_median_synced": round(med, 4), "step_s_free_running": round(free, 4),
                     "tokens_per_s": round(b * t / free), "host_batch_s": round(t_host, 4),
                     "peak_bytes": int(mem.get("peak_bytes_in_use", 0)), "ce": float(met["ce"])})
        print(json.dumps(rows[-1]), flush=True)
    res = {"device": str(jax.devices()[0].device_kind), "n_devices": mesh.size, "jax": jax.__version__,
           "backbone_params": num_params(cfg), "attention": a.attention, "rows": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "probe.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n" + "\n".join(f"{r['shape']:>10} {r['tokens_per_s']:>10,} tok/s  step {r['step_s_free_running']:.3f} s"
                           f"  compile {r['compile_s']:.0f} s  host batch {r['host_batch_s']:.3f} s" for r in rows))
    return res


def _stage_curves(prior: dict) -> list[tuple[int, list]]:
    """(tokens before the stage, its curve) for each earlier stage of a continued run, oldest first."""
    if not prior:
        return []
    earlier = _stage_curves(prior.get("init_from", {}))
    before = prior["init_from"].get("tokens_seen_total", prior["init_from"].get("tokens_seen", 0)) \
        if prior.get("init_from") else 0
    return earlier + [(before, prior.get("curve", []))]


def plot(stages, path: Path, title: str):
    """The loss curves of a run's stages ((tokens before the stage, curve), ...), on one token axis."""
    try:
        import matplotlib
    except ImportError:  # the `bench` extra (pyproject.toml); the GPU image has it
        print("matplotlib is not installed: no loss-curve PNG", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (before, curve) in enumerate(stages):
        tr = [((before + c["tokens"]) / 1e6, c["train_ce"]) for c in curve if c.get("train_ce") is not None]
        va = [((before + c["tokens"]) / 1e6, c["valid"]) for c in curve if c.get("valid") is not None]
        tag = f" (stage {i + 1})" if len(stages) > 1 else ""
        if tr:
            ax.plot(*zip(*tr), label="train CE (batch)" + tag, lw=1)
        if va:
            ax.plot(*zip(*va), "o-", label="validation (served fp8 tree)" + tag, ms=3)
        if i:
            ax.axvline(before / 1e6, color="gray", ls=":", lw=1)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("nats / token")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wait_for_corpus(a) -> dict:
    """The manifest of a corpus another process is writing (h200_run.sh builds it beside the compiles)."""
    path, t0 = Path(a.corpus) / "manifest.json", time.perf_counter()
    while not path.exists():
        if time.perf_counter() - t0 > a.wait_corpus:
            raise TimeoutError(f"no {path} after {a.wait_corpus:.0f} s")
        time.sleep(1.0)
    return json.loads(path.read_text())


def _compile(a, cfg, h, mesh, hasher, phases, vwin):
    """The run state and every compiled program (the phases' steps and the eval program), concurrently."""
    t0 = time.perf_counter()
    run = Run(cfg, h, mesh, a.seed)
    evals = Evaluator(cfg, hasher, mesh, batch=8 * mesh.size, length=a.eval_len)
    if vwin is None:
        vwin = np.random.default_rng(0).integers(0, cfg.vocab_size, (evals.batch, a.eval_len + 1), dtype=np.int32)
    run.compile_all(hasher, [sh for sh, _ in phases], [lambda: evals.nll(run.export(run.masters), vwin[: evals.batch])])
    compile_s = time.perf_counter() - t0
    print(f"compiled {run.compile_s} + eval in {compile_s:.1f} s", flush=True)
    return run, evals, compile_s


# ----------------------------------------------------------------------------- main
def main(argv=None):
    a = parse(argv)
    if a.tokenizer_only:
        return train_tokenizer(a)
    import optax  # noqa: F401  (fail early when missing)

    if a.cache_dir and a.cache_dir.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from checkpoints import load, write_hf
    from checkpoints.packed_shards import repack

    t_all = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.smoke and a.corpus == parse([]).corpus:
        a.corpus = str(out / "corpus")
    cfg = model_config()
    tok = corpus.load_tokenizer(a.tokenizer)
    assert tok.get_vocab_size() == cfg.vocab_size, "tokenizer and model vocabulary differ"
    hasher = EngramHasher(cfg)
    mesh = D.data_mesh()
    h = T.Hyper(peak_lr=a.peak_lr, aux_stride=a.aux_stride, attention=a.attention,
                head_bf16=a.head == "bf16")
    phases = _phases(a.phases)
    run = evals = None
    if a.wait_corpus and not a.probe:
        # another process builds the corpus: compile meanwhile (the eval program on a window of random ids)
        run, evals, compile_s = _compile(a, cfg, h, mesh, hasher, phases, None)
    manifest = wait_for_corpus(a) if a.wait_corpus else ensure_corpus(a)
    corpus_s = time.perf_counter() - t_all
    train, valid, held = (D.TokenFile(a.corpus, s) for s in ("train", "valid", "heldout"))
    print(f"corpus: train {len(train):,} tokens ({len(train.starts):,} documents), valid {len(valid):,}, held-out "
          f"{len(held):,}; ready in {corpus_s:.0f} s; mesh {mesh.size} x {jax.devices()[0].device_kind}", flush=True)
    if a.probe:
        return probe(a, cfg, h, mesh, hasher, train)

    vwin = corpus.windows(valid.tokens.astype(np.int32), a.eval_len + 1, limit=32 if not a.smoke else 2)
    if run is None:
        run, evals, compile_s = _compile(a, cfg, h, mesh, hasher, phases, vwin)

    ckpt = out / "ckpt.pkl"
    phase_stats = {}
    step, seen, elapsed0, curve, best = 0, 0, 0.0, [], (math.inf, None, 0)
    if a.resume and (ckpt.exists() or (out / "masters.pkl").exists()):
        st = run.load(ckpt if ckpt.exists() else out / "masters.pkl")
        step, seen, elapsed0, curve = st["step"], st["seen"], st["elapsed"], st["curve"]
        phase_stats.update(st.get("phases", {}))
        print(f"resumed at step {step} ({seen:,} tokens, {elapsed0:.0f} s trained)")
    prior = {}  # the first stage of a continued run (--init-from): its training facts
    if a.init_from:
        if step == 0:
            prior = run.init_from(Path(a.init_from))
        else:  # resumed mid-continuation: the weights came from the checkpoint, the facts from the directory
            f = Path(a.init_from) / "training.json"
            prior = json.loads(f.read_text()).get("training", {}) if f.exists() else {}
        print(f"continuing from {a.init_from}: {prior.get('tokens_seen_total', prior.get('tokens_seen', 0)):,} "
              f"tokens trained before", flush=True)
    left = a.total_minutes * 60.0 - (time.perf_counter() - t_all) - a.reserve
    budget = max(min(a.minutes * 60.0, left + elapsed0), 10.0)
    if budget < a.minutes * 60.0:
        print(f"training budget cut to {budget:.0f} s to finish within --total-minutes {a.total_minutes}")
    bounds = np.cumsum([x for _, x in phases])
    metrics, pending, phase_i, pf = {}, [], -1, None
    t_start = time.perf_counter() - elapsed0
    last_eval, last_ckpt = -math.inf, time.perf_counter()
    bar = tqdm(total=int(budget), initial=int(elapsed0), unit="s", desc="train", mininterval=2.0, disable=a.smoke)

    def record(el, vl=None):
        curve.append({"t": round(el, 1), "step": step, "tokens": int(seen), "epochs": round(seen / len(train), 3),
                      "train_ce": round(metrics["ce"], 4) if "ce" in metrics else None,
                      "valid": None if vl is None else round(vl, 4),
                      "indexer_kl": round(metrics["indexer_kl"], 4) if "indexer_kl" in metrics else None})

    paused = False
    while True:
        el = time.perf_counter() - t_start
        frac = step / a.steps if a.steps else el / budget
        if frac >= 1.0:
            break
        if a.pause_at and time.time() >= a.pause_at:
            paused = True
            break
        i = int(min(np.searchsorted(bounds, frac, side="right"), len(phases) - 1))
        if i != phase_i:
            if pf is not None:
                pf.close()
            phase_i, shape = i, phases[i][0]
            pf = D.Prefetch(train, cfg, hasher, mesh, shape, long=shape[1] >= 8192, seed=a.seed + step)
            phase_stats.setdefault(f"{shape[1]}x{shape[0]}", {"steps": 0, "tokens": 0, "seconds": 0.0})
            t_phase = time.perf_counter()
        met = run.step(shape, pf.get(), h.lr(frac))
        step += 1
        seen += shape[0] * shape[1]
        ps = phase_stats[f"{shape[1]}x{shape[0]}"]
        ps["steps"] += 1
        ps["tokens"] += shape[0] * shape[1]
        pending.append(met)
        if len(pending) >= a.log_every or a.smoke:
            metrics = {k: float(v) for k, v in jax.device_get(pending[-1]).items()}
            pending = []
            ps["seconds"] = round(ps["seconds"] + time.perf_counter() - t_phase, 2)
            t_phase = time.perf_counter()
            record(el)
            tqdm.write(f"step {step:>5} {shape[1]}x{shape[0]} ce {metrics['ce']:.4f} kl {metrics['indexer_kl']:.3f} "
                       f"gn {metrics['grad_norm']:.2f} imb {metrics['expert_imbalance']:.2f} lr {h.lr(frac):.2e} "
                       f"{seen / 1e6:.0f}M tok {seen / max(el, 1e-9):,.0f} tok/s")
        bar.update(int(time.perf_counter() - t_start) - bar.n)
        if metrics:
            bar.set_postfix(ce=f"{metrics['ce']:.3f}", ep=f"{seen / len(train):.2f}", refresh=False)
        now = time.perf_counter()
        if now - t_start - last_eval >= a.eval_every or (a.steps and step == a.steps):
            last_eval = now - t_start
            vl = float(np.mean(evals.nll(run.export(run.masters), vwin)))
            record(el, vl)
            if vl < best[0]:
                best = (vl, jax.tree.map(jnp.copy, run.masters), step)
        if now - last_ckpt >= a.ckpt_every:
            last_ckpt = now
            run.save(ckpt, {"step": step, "seen": seen, "elapsed": now - t_start, "curve": curve,
                            "phases": phase_stats})
    jax.block_until_ready(run.masters)
    if pf is not None:  # None when paused before this call's first step
        ps["seconds"] = round(ps["seconds"] + time.perf_counter() - t_phase, 2)
        pf.close()
    if pending:
        metrics = {k: float(v) for k, v in jax.device_get(pending[-1]).items()}
    bar.close()
    train_s = time.perf_counter() - t_start
    if paused:  # a split run: checkpoint and stop; `--resume` continues the same schedule
        st = {"step": step, "seen": seen, "elapsed": train_s, "curve": curve, "phases": phase_stats}
        run.save(ckpt, st)
        run.save_masters(out / "masters.pkl", st)
        print(f"paused at step {step} ({seen:,} tokens, {train_s:.0f} of {budget:.0f} s trained); "
              f"continue with --resume", flush=True)
        return {"paused": True, "step": step, "seen": seen}
    vl = float(np.mean(evals.nll(run.export(run.masters), vwin)))
    record(train_s, vl)
    if vl <= best[0] or best[1] is None:
        best = (vl, run.masters, step)
    run.save(ckpt, {"step": step, "seen": seen, "elapsed": train_s, "curve": curve})

    # ---- export, reload through the loader, evaluate the served checkpoint
    params = jax.device_get(run.export(best[1]))
    info = write_hf(cfg, params, out, shard_size_mb=8, overwrite=True, progress=False)
    repack(out, out)  # every file under 4 MiB (the repository's rule): small shards, the embedding / head xz'd
    cfg2, served = load(out, progress=False)
    assert cfg2 == cfg, "config.json does not round-trip"
    served = jax.device_put(served)
    files = json.loads((Path(a.corpus) / "heldout_files.json").read_text())
    order = np.random.default_rng(a.seed).permutation(len(files))
    pick, ntok = [], 0
    for j in order:  # a seeded sample of held-out files up to --max-eval-tokens
        if ntok + files[j][3] > a.max_eval_tokens and pick:
            continue
        pick.append(int(j))
        ntok += files[j][3]
    pick.sort()
    sums = evals.per_file(served, [held.doc(j) for j in pick])
    per_file = [[files[j][0], files[j][1], files[j][2], int(files[j][3] - 1), round(s, 2),
                 round(bits_per_byte(s, files[j][2]), 4)] for j, s in zip(pick, sums)]

    def agg(rows):
        n, b, t = sum(r[4] for r in rows), sum(r[2] for r in rows), sum(r[3] for r in rows)
        return {"files": len(rows), "tokens": t, "bytes": b, "loss": round(n / max(t, 1), 4),
                "bits_per_byte": round(bits_per_byte(n, b), 4)}

    # the check documents (stdlib held-out files, stored as text): through the same program, padded
    sfiles = corpus.split(corpus.list_files(None))["heldout"]
    texts = corpus.check_texts(tok, sfiles)
    cwin = corpus.check_windows(tok, texts)
    pad = np.full((len(cwin), a.eval_len + 1 - cwin.shape[1]), corpus.PAD, np.int32)
    cn = evals.nll(served, np.concatenate([cwin, pad], axis=1))[:, :cwin.shape[1] - 1]
    check_loss = float(np.mean(cn))

    tok_s = {k: round(v["tokens"] / max(v["seconds"], 1e-9)) for k, v in phase_stats.items()}
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.name.startswith(("model", "config"))}
    facts = {
        "model": {"name": cfg.name, "backbone_params": num_params(cfg), "engram_table_params":
                  cfg.num_engram_table_params(), "max_seq_len": cfg.max_seq_len, "vocab_size": cfg.vocab_size},
        "corpus": dict(manifest, smoke=a.smoke),
        "training": {"seed": a.seed, "steps": step, "best_step": best[2], "train_seconds": round(train_s, 1),
                     "compile_seconds": round(compile_s, 1), "compile": run.compile_s,
                     "corpus_seconds": round(corpus_s, 1), "tokens_seen": int(seen),
                     "tokens_per_second": round(seen / max(train_s, 1e-9)), "tokens_per_second_by_phase": tok_s,
                     "phases": phase_stats, "epochs": round(seen / len(train), 3),
                     "final_train_ce": round(metrics.get("ce", float("nan")), 4),
                     "final_indexer_kl": round(metrics.get("indexer_kl", float("nan")), 4),
                     "hyper": {k: getattr(h, k) for k in h.__dataclass_fields__}, "n_devices": mesh.size,
                     "attention": a.attention,
                     "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                     "command": "python -m training.train_default " + " ".join(sys.argv[1:] if argv is None else argv),
                     "curve": curve},
        "eval": {"valid_loss_best": round(best[0], 4), "window": a.eval_len,
                 "heldout": agg(per_file), "heldout_stdlib": agg([r for r in per_file if r[0] == "stdlib"]),
                 "heldout_packages": agg([r for r in per_file if r[0] != "stdlib"]),
                 "per_file_columns": ["source", "path", "bytes", "tokens", "nll_nats", "bits_per_byte"],
                 "per_file": per_file},
        "check": {"texts": texts, "length": corpus.CHECK_LEN, "tokens": int(cn.size), "loss": round(check_loss, 5),
                  "ids_sha1": hashlib.sha1(np.ascontiguousarray(cwin, np.int32).tobytes()).hexdigest(),
                  "per_document": [round(float(x), 5) for x in cn.mean(1)]},
        "prefixes": corpus.prefix_texts(tok, sfiles),
        "files": sizes, "checkpoint_bytes": info["total_bytes"],
        "wall_seconds": round(time.perf_counter() - t_all, 1),
    }
    before = prior.get("tokens_seen_total", prior.get("tokens_seen", 0))
    if a.init_from:  # a continued run: this stage's facts above, the earlier stages' here, and the totals
        facts["training"]["init_from"] = {"checkpoint": a.init_from, **prior}
        facts["training"]["tokens_seen_total"] = int(before + seen)
        facts["training"]["train_seconds_total"] = round(prior.get("train_seconds_total",
                                                                   prior.get("train_seconds", 0.0)) + train_s, 1)
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    stages = _stage_curves(prior) + [(before, curve)]
    total_s = facts["training"].get("train_seconds_total", train_s)
    plot(stages, out / "loss_curve.png",
         f"{cfg.name}: {(before + seen) / 1e6:.0f}M tokens in {total_s / 60:.1f} min"
         + (f" ({len(stages)} stages)" if len(stages) > 1 else ""))
    e, tr = facts["eval"], facts["training"]
    rows = [("train tokens", f"{len(train):,}"), ("steps / epochs", f"{step} / {tr['epochs']}"),
            ("tokens/s (by phase)", f"{tr['tokens_per_second']:,} ({tok_s})"),
            ("compile s / train s", f"{compile_s:.0f} / {train_s:.0f}"),
            ("final train CE", f"{tr['final_train_ce']}"), ("best valid (step)", f"{best[0]:.4f} ({best[2]})"),
            ("held-out loss / bpb", f"{e['heldout']['loss']} / {e['heldout']['bits_per_byte']} "
                                    f"({e['heldout']['files']} files)"),
            ("held-out stdlib bpb", f"{e['heldout_stdlib']['bits_per_byte']}"),
            ("held-out packages bpb", f"{e['heldout_packages']['bits_per_byte']}"),
            ("check loss", f"{check_loss:.4f}"), ("checkpoint MB", f"{info['total_bytes'] / 1e6:.2f}"),
            ("wall s", f"{facts['wall_seconds']}")]
    print("\n" + "\n".join(f"{k:<28} {v}" for k, v in rows))
    return facts


if __name__ == "__main__":
    main()
