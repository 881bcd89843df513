"""The quality cost of CED decoder trimming and SWA bounded replay, measured on held-out code.

    python -m bench.replay_quality                        # GPU: 128 documents of 6400 tokens, H = 1K, 2K, 4K, 6K
    python -m bench.replay_quality --smoke --out X.json   # CPU: the 2 check documents of 577 tokens, H = 448
    python -m bench.replay_quality --render bench/results/replay_quality_<device>.json   # plot + docs/QUALITY.md only

Documents: consecutive `--doc-len`-token windows of the held-out split (training.corpus), scored with the
shipped default model (or --checkpoint). For each turn boundary H, the next `--next` tokens [H, H+next) are
teacher-forced and every variant's next-token distributions are compared with the exact full forward
(`paths.forward` over the whole document: causal, so row t is exact for the prefix [0, t]):

- exact:  control. The prompt [0, H) prefilled in chunks of `--chunk` tokens with the decoder on every row,
          then the next tokens in one chunk with the decoder on every row (= that many decode steps). Differs from
          the forward only by execution order (bf16 rounding, near-ties of the MoE / indexer top-k that resolve
          differently): it validates the harness and gives the noise floor.
- ced:    (a) CED trimming at the end of a cold prompt: the same chunks with the decoder on the last 128 rows of
          each chunk only (window clipped there), so the decoder's sliding-window KV of [H-128, H) is approximate.
- replay: (b) a warm turn after a prefix-cache hit of H tokens: the cached global KV of [0, H) is kept, the SWA
          rings are rebuilt by replaying [H-128, H) with every window clipped at H-128 (bounded replay, decoder on
          every row), then the next tokens as above.
- served: (c) both, as the engine serves a warm turn whose prompt is [0, H): the prefix cache hits H - `--new`
          tokens (64: one page, the most the engine reuses of an H-token prompt), the replay starts 128 tokens
          before the hit, the decoder runs on the prompt's last 128 rows, then the next tokens are decoded.

Per document and H: mean NLL difference (variant - exact) over the next tokens, greedy-token agreement and mean
KL(exact || variant); over documents: means and standard errors (std / sqrt(n)). A difference "is within
1.5 SE of zero" when |mean| <= 1.5 SE. Results: bench/results/replay_quality_<device>.json (via write_result),
a plot (NLL difference with SE bars against H) and docs/QUALITY.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax  # noqa: F401
from dsv41_jax import paths
from training import corpus

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / "dsv41_jax" / "default_model"
VARIANTS = ("exact", "ced", "replay", "served")
LABELS = {"exact": "control: chunked, no approximation", "ced": "(a) CED trimming, cold prompt",
          "replay": "(b) bounded replay, warm turn", "served": "(c) both, as served"}


@jax.jit
def _compare(ref_logits, var_logits, targets):
    lr = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    lv = jax.nn.log_softmax(var_logits.astype(jnp.float32), axis=-1)
    t = targets[..., None]
    nll_r = -jnp.take_along_axis(lr, t, -1)[..., 0]
    nll_v = -jnp.take_along_axis(lv, t, -1)[..., 0]
    kl = jnp.sum(jnp.exp(lr) * (lr - lv), axis=-1)
    return {"dnll": (nll_v - nll_r).mean(1), "agree": (lr.argmax(-1) == lv.argmax(-1)).mean(1),
            "kl": kl.mean(1), "nll_exact": nll_r.mean(1),
            "max_abs_dlogit": jnp.abs(var_logits - ref_logits).max(axis=(1, 2))}


def compare(ref_logits, var_logits, targets) -> dict:
    """Per-document metrics [B] (numpy) of var against ref over the scored tokens: logits [B, n, V], targets
    [B, n]: NLL difference, greedy agreement, KL(ref || var), the exact NLL and the largest logit difference."""
    out = _compare(jnp.asarray(ref_logits), jnp.asarray(var_logits), jnp.asarray(targets, jnp.int32))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def _with_history(cfg, hasher, ds, tokens, pos: int):
    """ds with the Engram history of the tokens before `pos` (what a rewind to pos must restart from)."""
    if hasher is None:
        return ds
    n = cfg.engram_max_ngram_size - 1
    B = tokens.shape[0]
    hist = np.full((B, n), -1, np.int64)
    lo = max(pos - n, 0)
    if pos > 0:
        hist[:, n - (pos - lo):] = hasher.compress(tokens[:, lo:pos])
    return replace(ds, history=hist)


POSITION_BUCKETS = (0, 128, 512, 1024, 2048, 4096, 8192)


@jax.jit
def _token_nll(logits, targets):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


def position_nll(ref, tokens) -> dict:
    """Per-document mean NLL of the exact forward by position bucket ("lo-hi": predicted positions [lo, hi))."""
    nll = np.asarray(_token_nll(ref, jnp.asarray(tokens[:, 1:ref.shape[1] + 1], jnp.int32)), np.float64)
    pos = np.arange(1, nll.shape[1] + 1)
    out = {}
    for lo, hi in zip(POSITION_BUCKETS[:-1], POSITION_BUCKETS[1:]):
        m = (pos >= lo) & (pos < hi)
        if m.any():
            out[f"{lo}-{min(hi, int(pos[-1]) + 1)}"] = nll[:, m].mean(1)
    return out


def _continue(cfg, params, ds, tokens, H: int, n_next: int, first_logits, hasher):
    """Teacher-force tokens [H, H+n_next-1) from state ds (decoder on every row, = decode steps): the n_next
    predictions [B, n_next, V] (the first from `first_logits`, the prompt's last row)."""
    cont, _, _ = paths.prefill_chunk(cfg, params, ds, tokens[:, H:H + n_next - 1], mode="full", n_logits=n_next - 1,
                                     hasher=hasher)
    return jnp.concatenate([first_logits[:, -1:], cont], axis=1)


def variant_logits(cfg, params, tokens: np.ndarray, Hs, *, n_next: int, chunk: int, n_new: int, hasher,
                   variants=VARIANTS, ced_states: dict | None = None):
    """Yield (variant, H, logits [B, n_next, V]) for one batch of documents tokens [B, L]: every variant's
    predictions of tokens [H, H + n_next) (the module docstring's variants; `variants` picks some).

    Programs compiled (one each, reused for every H and batch): a fresh and (if some H > chunk) a continuing
    `chunk`-token prefill per pass (bounded; full for the control); the (n_next-1)-token continuation; the
    W-token replay (decoder on every row) and the (W+n_new)-token replay (decoder on the last W rows).
    `ced_states` ({H: (logits, DecodeState)} of a cold bounded CED prefill of [0, H), e.g. `paths.ced_prefill`
    with max_len L) may be passed in when the caller has them already."""
    W = cfg.window_size
    B, L = tokens.shape
    Hmax = max(Hs)
    assert Hmax + n_next <= L and all(H % chunk == 0 for H in Hs), (Hs, L, chunk)
    assert all(H - n_new - W >= 0 and (H - n_new - W) % 2 == 0 for H in Hs), "replay starts must be even, >= 0"
    states = dict(ced_states or {})
    need_ced = any(v in variants for v in VARIANTS[1:])  # (b) and (c) start from the cold CED state
    for mode, name in (("full", "exact"), ("bounded", "ced")):
        if name not in variants and (name == "exact" or not need_ced or all(H in states for H in Hs)):
            continue
        if name == "ced" and all(H in states for H in Hs):
            for H in Hs:
                lg, ds = states[H]
                yield name, H, _continue(cfg, params, ds, tokens, H, n_next, lg, hasher)
            continue
        ds = paths.empty_state(cfg, B, L)
        for pos in range(0, Hmax, chunk):
            lg, ds, _ = paths.prefill_chunk(cfg, params, ds, tokens[:, pos:pos + chunk], mode=mode, hasher=hasher)
            H = pos + chunk
            if H in Hs:
                if name in variants:
                    yield name, H, _continue(cfg, params, ds, tokens, H, n_next, lg, hasher)
                if name == "ced":
                    states[H] = (lg, ds)
    for H in Hs if need_ced else ():
        _, ds = states[H]
        # (b) prefix-cache hit at H: rebuild the SWA rings by replaying [H-W, H) clipped at H-W; the cached
        # global KV of [0, H) is kept (write_from=H); decoder on every row
        if "replay" in variants:
            s = H - W
            r = _with_history(cfg, hasher, paths.rewind(ds, s), tokens, s)
            lg, r, _ = paths.prefill_chunk(cfg, params, r, tokens[:, s:H], mode="full", enc_clip=s, write_from=H,
                                           n_logits=W, hasher=hasher)  # n_logits=W: the continuation's program
            yield "replay", H, _continue(cfg, params, r, tokens, H, n_next, lg, hasher)  # when n_next - 1 == W
        # (c) prompt [0, H) with a cache hit at H - n_new: replay from the hit - W, CED on the prompt's last W rows
        if "served" in variants:
            hit = H - n_new
            s = hit - W
            r = _with_history(cfg, hasher, paths.rewind(ds, s), tokens, s)
            lg, r, _ = paths.prefill_chunk(cfg, params, r, tokens[:, s:H], mode="bounded", enc_clip=s,
                                           write_from=hit, hasher=hasher)
            yield "served", H, _continue(cfg, params, r, tokens, H, n_next, lg, hasher)


def measure_batch(cfg, params, tokens: np.ndarray, Hs, *, n_next: int, chunk: int, n_new: int, hasher,
                  control: bool = True, ref=None, ced_states: dict | None = None) -> dict:
    """{variant: {H: per-document metric arrays}} (and "position": the exact NLL by position) for one batch of
    documents tokens [B, L]: `variant_logits` compared with the exact forward over tokens[:, :max(H)+n_next-1]
    (`ref`, computed here unless passed in)."""
    if ref is None:
        ref = paths.forward(cfg, params, tokens[:, :max(Hs) + n_next - 1], hasher=hasher)
    variants = VARIANTS if control else VARIANTS[1:]
    out = {v: {} for v in variants}
    out["position"] = position_nll(ref, tokens)
    for v, H, lg in variant_logits(cfg, params, tokens, Hs, n_next=n_next, chunk=chunk, n_new=n_new, hasher=hasher,
                                   variants=variants, ced_states=ced_states):
        out[v][H] = compare(ref[:, H - 1:H + n_next - 1], lg, tokens[:, H:H + n_next])
    return out


def summarize(per_doc: dict) -> dict:
    """Means and standard errors over documents per (variant, H)."""
    res = {}
    for v, byH in per_doc.items():
        res[v] = {}
        for H, m in sorted(byH.items()):
            n = len(m["dnll"])
            se = float(np.std(m["dnll"], ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
            mean = float(np.mean(m["dnll"]))
            res[v][str(H)] = {
                "docs": n, "dnll_mean": mean, "dnll_se": se, "within_1p5_se": bool(abs(mean) <= 1.5 * se),
                "agree_mean": float(np.mean(m["agree"])),
                "agree_se": float(np.std(m["agree"], ddof=1) / np.sqrt(n)) if n > 1 else float("nan"),
                "kl_mean": float(np.mean(m["kl"])),
                "kl_se": float(np.std(m["kl"], ddof=1) / np.sqrt(n)) if n > 1 else float("nan"),
                "nll_exact_mean": float(np.mean(m["nll_exact"])), "max_abs_dlogit": float(np.max(m["max_abs_dlogit"])),
                "dnll_per_doc": [round(float(x), 7) for x in m["dnll"]]}
    ctrl = per_doc.get("exact")
    for v, byH in per_doc.items():  # paired against the control: what the approximation adds to the float noise
        if ctrl is None or v == "exact":
            continue
        for H, m in byH.items():
            if H not in ctrl or len(ctrl[H]["dnll"]) != len(m["dnll"]) or len(m["dnll"]) < 2:
                continue
            d = np.asarray(m["dnll"], np.float64) - np.asarray(ctrl[H]["dnll"], np.float64)
            mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
            res[v][str(H)].update(vs_control_mean=mean, vs_control_se=se,
                                  vs_control_within_1p5_se=bool(abs(mean) <= 1.5 * se))
    return res


def run(cfg, params, docs: np.ndarray, Hs, *, n_next: int, chunk: int, n_new: int, batch: int, hasher,
        control: bool = True, progress: bool = True, seconds: float | None = None) -> dict:
    """Measure the documents (padded to whole batches; padding rows are dropped) and summarize; with `seconds`,
    stop after the batch that ends past that budget ("docs" in the summary: how many were measured)."""
    per, pos = {}, {}
    n, done, t0 = len(docs), 0, time.perf_counter()
    from tqdm import tqdm

    for i in tqdm(range(0, n, batch), desc="documents", unit="batch", disable=not progress):
        if seconds is not None and time.perf_counter() - t0 > seconds:
            print(f"time budget spent: {done} of {n} documents measured")
            break
        b = docs[i:i + batch]
        k = len(b)
        if k < batch:
            b = np.concatenate([b, np.repeat(b[-1:], batch - k, axis=0)])
        got = measure_batch(cfg, params, b, Hs, n_next=n_next, chunk=chunk, n_new=n_new, hasher=hasher,
                            control=control)
        for b_, x in got.pop("position").items():
            pos.setdefault(b_, []).append(np.asarray(x)[:k])
        for v, byH in got.items():
            for H, m in byH.items():
                acc = per.setdefault(v, {}).setdefault(H, {key: [] for key in m})
                for key, val in m.items():
                    acc[key].append(np.asarray(val)[:k])
        done += k
    per = {v: {H: {k: np.concatenate(x) for k, x in m.items()} for H, m in byH.items()} for v, byH in per.items()}
    out = summarize(per)
    out["nll_by_position"] = {b_: float(np.mean(np.concatenate(x))) for b_, x in pos.items()}
    out["docs"] = done
    return out


def sample_completion(cfg, params, tok, doc: np.ndarray, H: int, n_new: int, hasher) -> dict:
    """Greedy continuation of a held-out prefix doc[:H] through the served paths (CED prefill, decode steps)."""
    ids = doc[None, :H]
    lg, ds, _ = paths.ced_prefill(cfg, params, ids, max_len=H + n_new + 1, hasher=hasher)
    out, nxt = [], int(np.asarray(lg)[0, -1].argmax())
    for _ in range(n_new):
        if nxt == corpus.END:
            break
        out.append(nxt)
        lg, ds = paths.decode_step(cfg, params, ds, np.asarray([nxt]), hasher=hasher)
        nxt = int(np.asarray(lg)[0].argmax())
    prompt = tok.decode(doc[:H].tolist())
    return {"prompt_tail": "".join(prompt.splitlines(keepends=True)[-12:]), "completion": tok.decode(out),
            "reference": tok.decode(doc[H:H + len(out)].tolist())}


# ----------------------------------------------------------------------------- plot and document
def plot(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result["result"] if "result" in result else result
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for j, v in enumerate([v for v in VARIANTS if v in r["summary"]]):
        rows = r["summary"][v]
        Hs = sorted(int(h) for h in rows)
        x = np.asarray(Hs, float) * (1 + 0.025 * (j - 1.5))
        mean = [rows[str(h)]["dnll_mean"] for h in Hs]
        se = [rows[str(h)]["dnll_se"] for h in Hs]
        ax[0].errorbar(x, mean, yerr=se, marker="o", capsize=3, label=LABELS[v])
        ax[1].plot(Hs, [1 - rows[str(h)]["agree_mean"] for h in Hs], marker="o", label=LABELS[v])
    ax[0].axhline(0, color="k", lw=0.6)
    ax[0].set_xscale("log", base=2)
    ax[0].set_xlabel("turn boundary H (tokens)")
    ax[0].set_ylabel("NLL difference vs exact (nats/token), ±1 SE")
    ax[1].set_xscale("log", base=2)
    ax[1].set_xlabel("turn boundary H (tokens)")
    ax[1].set_ylabel("greedy-token disagreement")
    ax[0].legend(fontsize=7)
    n = r["docs"]
    fig.suptitle(f"{r['model']}: next {r['next_tokens']} tokens after H, {n} held-out documents ({r['device']})",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


METHOD = """\
Two approximations make V4.1 serving cheap: **CED trimming** (a prompt's decoder band runs on its last 128 rows
only, so the decoder's sliding-window KV of those rows sees a window clipped at the 128th-last token) and **SWA
bounded replay** (after a prefix-cache hit of H tokens the sliding-window rings are not stored but rebuilt by
recomputing the last 128 cached tokens, whose windows are clipped at H - 128). Both only change sliding-window
keys near the boundary; the global (compressed) KV is exact. Documents are consecutive windows of the held-out
split; at each turn boundary H the next tokens are teacher-forced (scored all at once with the decoder on every
row, which equals decoding them one by one) and every next-token distribution is compared with the exact full
forward over the document:

- control: the prompt prefilled in chunks with the decoder on every row: no approximation. What remains is the
  float noise of another execution order (bf16 rounding, near-ties of the MoE / indexer top-k), the floor that
  the other rows should be read against;
- (a) CED trimming at the end of a cold prompt [0, H);
- (b) a warm turn: prefix-cache hit at H, bounded replay of [H - 128, H), the new tokens after H;
- (c) both, as the engine serves a warm turn whose prompt is [0, H): cache hit one page (64 tokens) before H,
  replay from 128 tokens before the hit, CED trimming at the end of the prompt, then decoding.

Per document: the mean NLL difference (variant - exact) over the scored tokens, greedy-token agreement and
mean KL(exact || variant); then means and standard errors (SE = std / sqrt(documents)) over documents. "Within
1.5 SE" means |mean NLL difference| <= 1.5 SE."""


def _vs_control(rows: dict) -> str:
    """The plain sentence on a variant's paired difference from the control ('' when not measured)."""
    if not all("vs_control_mean" in m for m in rows.values()):
        ctrl = "the control's own differences (float noise of another execution order) are of the same size"
        return "; " + ctrl
    bad = [H for H, m in rows.items() if not m["vs_control_within_1p5_se"]]
    worst = max(abs(m["vs_control_mean"]) for m in rows.values())
    return ("; paired against the control it is " + ("within 1.5 standard errors of zero at every H" if not bad else
            f"**not** within 1.5 standard errors of zero at H = {', '.join(bad)}")
            + f" (largest {worst:.5f} nats/token)")


def _stage_text(tr: dict) -> str:
    """One training stage as training.json records it: device, time, steps, tokens, phases."""
    phases = "; ".join(f"{k} (length x batch): {v['steps']} steps, {v['tokens']:,} tokens in {v['seconds']:.0f} s "
                       f"({tr['tokens_per_second_by_phase'][k]:,} tokens/s)" for k, v in tr.get("phases", {}).items())
    return (f"on {tr.get('n_devices', 1)} {tr['device']} in {tr['train_seconds']:.0f} s "
            f"(+ {tr.get('compile_seconds', 0):.0f} s compiling): {tr['steps']} steps, {tr.get('tokens_seen', 0):,} "
            f"tokens at {tr['tokens_per_second']:,} tokens/s, {tr['epochs']} epochs"
            + (f". Phases: {phases}" if phases else ""))


def model_section(training: dict) -> list[str]:
    """'The default model' section: its facts as training.json records them (a continued stage names the stage
    it started from under training.init_from; both are described)."""
    e, tr, c, mo = training["eval"], training["training"], training["corpus"], training["model"]
    first = tr.get("init_from")
    how = (f"in two stages: stage 1 {_stage_text(first)}; stage 2, continued from it (`--init-from`), "
           f"{_stage_text(tr)}; {tr['tokens_seen_total']:,} tokens in {tr['train_seconds_total']:.0f} s of training "
           "in all" if first else _stage_text(tr))
    L = ["## The default model", "",
         f"`dsv41_jax/default_model` ({mo['name']}): {mo['backbone_params'] / 1e6:.1f}M backbone parameters "
         f"(+ {mo['engram_table_params'] / 1e6:.2f}M Engram table rows), {mo['max_seq_len'] // 1024}K context, "
         f"trained by `python -m training.train_default` over {c['tokens']['train']:,} training tokens "
         f"({c['files']['train']:,} files of Python {c['python']}'s standard library and installed packages, with "
         f"chat and tool-call documents) {how}. Checkpoint of step {tr['best_step']} of the last stage, the best "
         "validation loss.", "",
         "| metric | value |", "|---|---|"]
    for key, what in (("heldout", "all held-out"), ("heldout_stdlib", "stdlib"), ("heldout_packages", "packages")):
        if key in e:
            h = e[key]
            L.append(f"| held-out loss, {what} ({h['files']} files, {e['window']}-token windows) | {h['loss']} "
                     f"nats/token, {h['bits_per_byte']} bits/byte ({h['tokens']:,} tokens) |")
    if "valid_loss_best" in e:
        L.append(f"| best validation loss | {e['valid_loss_best']} nats/token |")
    if e.get("indexer_recall"):
        rec = "; ".join(f"{k}: {v['recall']} ({v['random']})" for k, v in e["indexer_recall"].items())
        L.append(f"| indexer recall: attention mass in its top-k on the last training batches (random pick) | {rec} |")
    if "final_indexer_kl" in tr:
        L.append(f"| indexer KL loss at the end of training (final_indexer_kl) | {tr['final_indexer_kl']} |")
    L += [f"| split | {c['split_rule']}; files {c['files']} |", ""]
    return L


def render_doc(result: dict, training: dict | None, img: str, extra: str = "") -> str:
    r = result["result"] if "result" in result else result
    L = [
        "# Quality of the default model, and the cost of CED trimming and SWA bounded replay", "",
        "Generated by `python -m bench.replay_quality` (the numbers below come from "
        f"`{r.get('file', 'bench/results/replay_quality_*.json')}`; re-render with "
        "`python -m bench.replay_quality --render FILE`).", "",
    ]
    if training:
        L += model_section(training)
    if r.get("nll_by_position"):
        L += ["Held-out NLL of the exact forward by position in the document (longer context, lower loss):", "",
              "| positions | " + " | ".join(r["nll_by_position"]) + " |",
              "|---|" + "---|" * len(r["nll_by_position"]),
              "| NLL (nats/token) | " + " | ".join(f"{v:.3f}" for v in r["nll_by_position"].values()) + " |", ""]
    src = f" ({r['source']})" if r.get("source") else ""
    L += ["## Replay and trimming", "", METHOD, "",
          f"Here: {r['docs']} held-out documents of {r['doc_len']} tokens{src}, turn boundaries H = "
          f"{', '.join(map(str, r['H']))}, the next {r['next_tokens']} tokens scored, prefill chunks of {r['chunk']}, "
          f"(c) with a cache hit {r['new_tokens']} tokens before H.", "",
          f"![NLL difference against H]({img})", "",
          "| variant | H | NLL diff (nats/token) | SE | within 1.5 SE of 0 | greedy agreement | mean KL | exact NLL |",
          "|---|---|---|---|---|---|---|---|"]
    for v in [v for v in VARIANTS if v in r["summary"]]:
        for H, m in sorted(r["summary"][v].items(), key=lambda kv: int(kv[0])):
            L.append(f"| {LABELS[v]} | {H} | {m['dnll_mean']:+.5f} | {m['dnll_se']:.5f} | "
                     f"{'yes' if m['within_1p5_se'] else '**no**'} | {m['agree_mean']:.4f} | {m['kl_mean']:.2e} | "
                     f"{m['nll_exact_mean']:.3f} |")
    paired = [(v, H, m) for v in VARIANTS if v in r["summary"] and v != "exact"
              for H, m in sorted(r["summary"][v].items(), key=lambda kv: int(kv[0])) if "vs_control_mean" in m]
    if paired:
        L += ["", "Paired against the control (per document: the variant's NLL difference minus the control's, so the "
              "float noise both share cancels): what the approximation itself adds.", "",
              "| variant | H | NLL diff - control's (nats/token) | SE | within 1.5 SE of 0 |", "|---|---|---|---|---|"]
        L += [f"| {LABELS[v]} | {H} | {m['vs_control_mean']:+.5f} | {m['vs_control_se']:.5f} | "
              f"{'yes' if m['vs_control_within_1p5_se'] else '**no**'} |" for v, H, m in paired]
    L += ["", "Plainly:", ""]
    for v in [v for v in VARIANTS if v in r["summary"]]:
        rows = r["summary"][v]
        bad = [H for H, m in rows.items() if not m["within_1p5_se"]]
        worst = max(abs(m["dnll_mean"]) for m in rows.values())
        L.append(f"- {LABELS[v]}: " + ("within 1.5 standard errors of zero at every H" if not bad else
                                        f"**not** within 1.5 standard errors of zero at H = {', '.join(bad)}")
                 + f"; the largest mean difference is {worst:.5f} nats/token"
                 + (_vs_control(rows) if v != "exact" else "") + ".")
    if paired:
        v, H, m = max(paired, key=lambda t: abs(t[2]["vs_control_mean"]))
        d = abs(m["vs_control_mean"])
        mixed = len({x[2]["vs_control_mean"] > 0 for x in paired if x[0] == v}) > 1
        tail = "; its sign changes with H." if mixed else "."
        L.append(f"- In proportion: the largest paired difference ({LABELS[v]}, H = {H}) is {d:.5f} nats/token, "
                 f"{100 * d / m['nll_exact_mean']:.3f}% of the exact NLL{tail}")
    if r.get("sample"):
        smp = r["sample"]
        L += ["", "## A completion of held-out code", "",
              "Greedy decoding after a CED prefill of the first held-out document's first "
              f"{r['H'][0]} tokens (the prompt's last lines, then the model's continuation):", "",
              "```python", smp["prompt_tail"].rstrip("\n"), "# ---- model continues ----", smp["completion"], "```",
              "", "The file itself continues:", "", "```python", smp["reference"], "```"]
    L += ["", f"Device: {r['device']}; command: `{result.get('command', '')}`.", ""]
    if extra:
        L += [extra]
    return "\n".join(L)


# ----------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--docs", type=int, default=128)
    ap.add_argument("--doc-len", type=int, default=6400)
    ap.add_argument("--H", default="1024,2048,4096,6144", help="turn boundaries (multiples of --chunk)")
    ap.add_argument("--next", type=int, default=256, help="teacher-forced tokens scored after H")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk of the cold prompt")
    ap.add_argument("--new", type=int, default=64, help="(c): prompt tokens after the prefix-cache hit")
    ap.add_argument("--batch", type=int, default=16, help="documents per batch")
    ap.add_argument("--stdlib-root", default=None)
    ap.add_argument("--minutes", type=float, default=0, help="stop after the batch that ends past this (0: none)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/replay_quality_<dev>.json)")
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "replay_quality.png"))
    ap.add_argument("--doc", default=str(REPO / "docs" / "QUALITY.md"))
    ap.add_argument("--probe", default=str(REPO / "bench" / "results" / "long_context_probe_default_cpu.json"),
                    help="long-context probe results (bench.long_context_probe) whose table the doc ends with")
    ap.add_argument("--render", default=None, help="only draw the plot and write the doc from this results JSON")
    ap.add_argument("--no-control", dest="control", action="store_false", help="skip the exact control")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check: the checkpoint's 2 check documents (training.json) of 577 tokens, H = 448, "
                         "next 129, no control, no plot / doc")
    a = ap.parse_args(argv)
    if a.smoke:
        n_next = 129  # the 128-token continuation shares its program with the 128-token replay of (b)
        H = corpus.CHECK_LEN - n_next
        a.docs, a.doc_len, a.H, a.next, a.chunk, a.batch, a.control = 2, corpus.CHECK_LEN, str(H), n_next, H, 2, False
    return a


def write_outputs(rec: dict, a, checkpoint: Path):
    train = checkpoint / "training.json"
    training = json.loads(train.read_text()) if train.exists() else None
    if a.plot:
        plot(rec, Path(a.plot))
    if a.doc:
        img = Path(a.plot).relative_to(Path(a.doc).parent) if a.plot else ""
        extra = ""
        if a.probe and Path(a.probe).exists():
            from bench.long_context_report import render_section

            extra = render_section(json.loads(Path(a.probe).read_text()))
        Path(a.doc).write_text(render_doc(rec, training, str(img), extra))


def main(argv=None):
    a = parse(argv)
    ckpt = Path(a.checkpoint)
    if a.render:
        rec = json.loads(Path(a.render).read_text())
        rec["result"]["file"] = a.render
        write_outputs(rec, a, ckpt)
        return rec
    from bench.common import device_name, write_result
    from checkpoints import load
    from dsv41_jax.engram_hash import EngramHasher

    t0 = time.perf_counter()
    cfg, params = load(ckpt, progress=False)
    tok = corpus.load_tokenizer(ckpt)
    hasher = EngramHasher(cfg) if cfg.engram_layer_ids else None
    source = "the check documents of training.json"
    if a.smoke:  # the stored check texts: the same documents on every machine and Python version
        docs = corpus.check_windows(tok, json.loads((ckpt / "training.json").read_text())["check"]["texts"],
                                    a.doc_len)
    else:
        held = corpus.split(corpus.list_files(a.stdlib_root))["heldout"]
        docs = corpus.replay_documents(tok, held, a.doc_len, a.docs)
        n_test = sum(corpus.is_test(f.rel) for f in held)
        source = (f"the held-out files of this machine's standard library (Python {platform.python_version()}: "
                  f"{len(held)} files, {n_test} of them in test suites), in split order")
    if len(docs) < a.docs:
        print(f"warning: only {len(docs)} held-out documents of {a.doc_len} tokens (asked for {a.docs})")
    Hs = tuple(int(h) for h in a.H.split(","))
    summary = run(cfg, params, docs, Hs, n_next=a.next, chunk=a.chunk, n_new=a.new, batch=a.batch, hasher=hasher,
                  control=a.control, progress=not a.smoke, seconds=60 * a.minutes if a.minutes else None)
    by_pos = summary.pop("nll_by_position")
    docs = docs[:summary.pop("docs")]
    sample = None if a.smoke else sample_completion(cfg, params, tok, docs[0], Hs[0], 64, hasher)
    dev = "cpu" if jax.default_backend() == "cpu" else "h200" if "H200" in device_name() else jax.default_backend()
    out = a.out or str(REPO / "bench" / "results" / f"replay_quality_{dev}.json")
    train_json = ckpt / "training.json"
    name = json.loads(train_json.read_text())["model"]["name"] if train_json.exists() else ckpt.name
    result = {"model": name, "checkpoint": str(ckpt), "device": device_name(), "docs": int(len(docs)),
              "doc_len": a.doc_len, "H": list(Hs), "next_tokens": a.next, "chunk": a.chunk, "new_tokens": a.new,
              "window": cfg.window_size, "seconds": round(time.perf_counter() - t0, 1), "summary": summary,
              "sample": sample, "nll_by_position": by_pos, "source": source,
              "file": str(Path(out).resolve().relative_to(REPO)) if Path(out).resolve().is_relative_to(REPO) else out}
    cmd = "python -m bench.replay_quality " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    rec = write_result(out, result, cmd.strip())
    if not a.smoke:
        write_outputs(rec, a, ckpt)
    rows = [(v, H, m) for v in VARIANTS if v in summary for H, m in sorted(summary[v].items(),
                                                                          key=lambda kv: int(kv[0]))]
    print(f"\n{'variant':<8} {'H':>6} {'dNLL':>10} {'SE':>9} {'<=1.5SE':>8} {'agree':>7} {'KL':>9}")
    for v, H, m in rows:
        print(f"{v:<8} {H:>6} {m['dnll_mean']:>+10.5f} {m['dnll_se']:>9.5f} {str(m['within_1p5_se']):>8} "
              f"{m['agree_mean']:>7.4f} {m['kl_mean']:>9.2e}")
    print(f"{len(docs)} documents x {len(Hs)} boundaries in {result['seconds']} s -> {out}")
    return rec


if __name__ == "__main__":
    main()
