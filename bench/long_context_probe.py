"""Does the model use its long context? Completing a call to a name defined 4-7K tokens earlier, exactly and
under the served approximations (CED trimming, a warm turn with bounded replay).

    python -m bench.long_context_probe                          # CPU: every case (about 70), 7168-token prompts
    python -m bench.long_context_probe --smoke --out X.json     # CPU check: 2 cases, 1024-token prompts

Cases (`bench.long_context_cases`): in a held-out file of the default model's split (training.json's split rule,
`training.corpus.split_name`: the standard library's held-out files on this machine, test suites included, then
the held-out files of this interpreter's site-packages under the package rule), a function, method or class
whose name occurs nowhere before its first call except in its own definition, which lies 4000-7000 tokens
before the call. The prompt is the held-out stream's `--ctx` tokens before the call's first name token (it may
reach into earlier files; the name must not occur there); the target is the file's tokens of the called name
(up to 8). At most `--per-file` cases per file.

Conditions, each scored on the same target tokens (teacher-forced, so "correct" = every target token is the
greedy choice = greedy decoding writes the name):

- exact:   the prompt prefilled with the decoder on every row, then the target decoded (control of (a)-(c));
- ced:     (a) CED trimming: the decoder on the prompt's last 128 rows only;
- replay:  (b) a warm turn: prefix-cache hit of the whole prompt, SWA rings rebuilt by bounded replay;
- served:  (c) both: hit 64 tokens before the prompt's end, bounded replay, CED trimming of the new rows;
- removed: control of context use: the definition's lines (decorators to its end) cut out of the stream before
           the window is taken, so the name occurs nowhere in the prompt; exact prefill as in `exact`.

(a)-(c) are `bench.replay_quality.variant_logits` with one turn boundary H = --ctx. Reported per condition:
accuracy (whole name), first-token accuracy, accuracy of the rest of the name given its first token (names of
2+ tokens), mean summed NLL of the target; SE = std / sqrt(cases), and an SE clustered by file (cases of one
file are not independent); paired against `exact`: the per-case difference (mean, SE). Results:
bench/results/long_context_probe_<device>.json; the table is rendered into docs/QUALITY.md by
`python -m bench.replay_quality --render FILE --probe THIS_FILE`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax  # noqa: F401
from bench import long_context_cases as lc
from bench import replay_quality as rq
from bench.long_context_report import CONDITIONS, pm
from training import corpus

REPO = Path(__file__).resolve().parents[1]


def heldout_sources(stdlib_root=None, packages: bool = True) -> list[tuple[str, str, str]]:
    """[(label, relative path, text)]: the stdlib's held-out files, then (packages) the held-out files of this
    interpreter's site-packages that the corpus filters would take."""
    from training import code_corpus as cc

    out = [("stdlib", f.rel, f.text()) for f in corpus.split(corpus.list_files(stdlib_root))["heldout"]]
    if packages:
        for root in cc.site_dirs():
            for p in sorted(root.rglob("*.py")):
                rel = p.relative_to(root).as_posix()
                if corpus.split_name(rel, *cc.PACKAGE_SPLIT) != "heldout" or not p.is_file():
                    continue
                data = p.read_bytes()
                if cc.skip_reason(rel, data) is None:
                    out.append(("package", rel, data.decode("utf-8")))
    return out


def build(tok, sources, **case_kw) -> tuple[np.ndarray, list[lc.Case]]:
    """The held-out stream (<|bos|> + tokens + <|end|> per file, as `corpus.encode_docs`) and its cases."""
    enc = tok.encode_batch([t for _, _, t in sources], add_special_tokens=False)
    docs, cases, base = [], [], 0
    for (_, rel, text), e in zip(sources, enc):
        docs.append(np.asarray([corpus.BOS, *e.ids, corpus.END], np.int32))
        cases += lc.file_cases(rel, text, e.offsets, base + 1, **case_kw)
        base += len(docs[-1])
    return corpus.stream(docs), cases


def windows(tok, stream: np.ndarray, cases, ctx: int, m: int):
    """(full [n, ctx+m], removed [n, ctx+m], kept cases): each window is the ctx prompt tokens then m tokens from
    the call's first name token; `removed` takes its ctx prompt tokens from the stream with the definition's
    tokens cut out. A case is dropped when its window does not hold the whole definition or the name occurs
    in the prompt outside the definition."""
    full, rem, kept = [], [], []
    for c in cases:
        a, b = c.block
        lo = c.cut - ctx
        if lo < 0 or a < lo or c.cut + m > len(stream):
            continue
        before, after = tok.decode(stream[lo:a].tolist()), tok.decode(stream[b:c.cut].tolist())
        cut_out = np.concatenate([stream[:a], stream[b:c.cut]])[-ctx:]
        if lc.name_in(c.name, before + "\n" + after) or len(cut_out) < ctx or lc.name_in(c.name,
                                                                                        tok.decode(cut_out.tolist())):
            continue
        tail = stream[c.cut:c.cut + m]
        full.append(stream[lo:c.cut + m])
        rem.append(np.concatenate([cut_out, tail]))
        kept.append(c)
    shape = (-1, ctx + m)
    return (np.asarray(full, np.int32).reshape(shape), np.asarray(rem, np.int32).reshape(shape), kept)


@jax.jit
def _score(logits, targets, mask):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
    hit = (lp.argmax(-1) == targets) | ~mask
    return {"correct": hit.all(1), "first": hit[:, 0], "rest": hit[:, 1:].all(1), "nll": (nll * mask).sum(1)}


def score(logits, targets: np.ndarray, n_target: np.ndarray) -> dict:
    """Per case (numpy): the whole target greedy-correct, its first token, the tokens after the first (given the
    first; True for 1-token targets, which `summarize` leaves out), and the summed NLL of the target tokens."""
    mask = np.arange(targets.shape[1])[None] < np.asarray(n_target)[:, None]
    out = _score(jnp.asarray(logits), jnp.asarray(targets, jnp.int32), jnp.asarray(mask))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def mean_se(x, groups=None) -> dict:
    """Mean, SE (std / sqrt n) and, given groups, the SE clustered by group (sandwich estimator, G/(G-1))."""
    x = np.asarray(x, np.float64)
    n = len(x)
    out = {"mean": float(x.mean()) if n else float("nan"),
           "se": float(x.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")}
    if groups is not None and n > 1:
        g = np.asarray(groups)
        keys = sorted(set(g.tolist()))
        if len(keys) > 1:
            s = np.asarray([np.sum(x[g == k] - x.mean()) for k in keys])
            out["se_file"] = float(np.sqrt(np.sum(s ** 2) * len(keys) / (len(keys) - 1)) / n)
    return out


def summarize(per: dict, cases) -> dict:
    files = [c.file for c in cases]
    multi = np.asarray([c.n_target > 1 for c in cases])
    res = {}
    for v, m in per.items():
        r = {"cases": len(files), "accuracy": mean_se(m["correct"], files), "first_token": mean_se(m["first"], files),
             "rest_given_first": {**mean_se(m["rest"][multi], np.asarray(files)[multi]), "cases": int(multi.sum())},
             "target_nll": mean_se(m["nll"], files)}
        if v != "exact":
            r["vs_exact_accuracy"] = mean_se(m["correct"] - per["exact"]["correct"], files)
            r["vs_exact_nll"] = mean_se(m["nll"] - per["exact"]["nll"], files)
            r["flips"] = {"lost": int(np.sum((per["exact"]["correct"] > 0) & (m["correct"] == 0))),
                          "gained": int(np.sum((per["exact"]["correct"] == 0) & (m["correct"] > 0)))}
        res[v] = r
    return res


def run(cfg, params, full: np.ndarray, removed: np.ndarray, n_target: np.ndarray, *, ctx: int, m: int,
        batch: int, n_new: int, hasher, progress: bool = True, seconds: float | None = None,
        partial: Path | None = None) -> dict:
    """{condition: per-case score arrays} over the windows in order (padded to whole batches); with `seconds`,
    stop after the batch that ends past that budget. `partial`: an .npz of the cases measured so far, saved
    after every batch and resumed from (the same cases in the same order)."""
    from tqdm import tqdm

    per: dict = {}
    t0, start = time.perf_counter(), 0
    if partial is not None and partial.exists():
        z = np.load(partial)
        for key in z.files:
            v, k = key.split("/")
            per.setdefault(v, {})[k] = [z[key]]
        start = len(z[z.files[0]])
        print(f"resuming after {start} cases from {partial}")
    for i in tqdm(range(start, len(full), batch), desc="cases", unit="batch", disable=not progress):
        if seconds is not None and time.perf_counter() - t0 > seconds:
            print(f"time budget spent: {i} of {len(full)} cases measured")
            break
        k = min(batch, len(full) - i)
        idx = np.r_[np.arange(i, i + k), np.full(batch - k, i + k - 1)]
        nt = n_target[idx]
        for toks, variants in ((full[idx], rq.VARIANTS), (removed[idx], ("exact",))):
            tgt = toks[:, ctx:ctx + m]
            for v, _, lg in rq.variant_logits(cfg, params, toks, (ctx,), n_next=m, chunk=ctx, n_new=n_new,
                                              hasher=hasher, variants=variants):
                name = v if variants is rq.VARIANTS else "removed"
                for key, val in score(lg, tgt, nt).items():
                    per.setdefault(name, {}).setdefault(key, []).append(val[:k])
        if partial is not None:
            np.savez(partial, **{f"{v}/{k}": np.concatenate(x) for v, d in per.items() for k, x in d.items()})
    return {v: {k: np.concatenate(x) for k, x in d.items()} for v, d in per.items()}


# ----------------------------------------------------------------------------- rendering
# ----------------------------------------------------------------------------- main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(rq.DEFAULT_MODEL_DIR))
    ap.add_argument("--ctx", type=int, default=7168, help="prompt tokens (the turn boundary H)")
    ap.add_argument("--min-dist", type=int, default=4000)
    ap.add_argument("--max-dist", type=int, default=7000)
    ap.add_argument("--target", type=int, default=8, help="most target tokens (the scored continuation)")
    ap.add_argument("--per-file", type=int, default=4)
    ap.add_argument("--new", type=int, default=64, help="(c): prompt tokens after the prefix-cache hit")
    ap.add_argument("--cases", type=int, default=0, help="at most this many cases (0: all), a seeded random pick")
    ap.add_argument("--minutes", type=float, default=0, help="stop after the batch that ends past this (0: none)")
    ap.add_argument("--partial", default=None, help=".npz of the cases measured so far: saved per batch, resumed")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--no-packages", dest="packages", action="store_false")
    ap.add_argument("--stdlib-root", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="2 cases, --ctx 1024, distances 300-900")
    a = ap.parse_args(argv)
    if a.smoke:
        a.ctx, a.min_dist, a.max_dist, a.cases, a.batch, a.packages = 1024, 300, 900, 2, 2, False
    return a


def main(argv=None):
    a = parse(argv)
    from bench.common import device_name, write_result
    from checkpoints import load
    from dsv41_jax.engram_hash import EngramHasher

    t0 = time.perf_counter()
    ckpt = Path(a.checkpoint)
    cfg, params = load(ckpt, progress=False)
    tok = corpus.load_tokenizer(ckpt)
    hasher = EngramHasher(cfg) if cfg.engram_layer_ids else None
    sources = heldout_sources(a.stdlib_root, a.packages)
    stream, cases = build(tok, sources, min_dist=a.min_dist, max_dist=a.max_dist, max_target=a.target)
    full, removed, cases = windows(tok, stream, lc.spread(cases, a.per_file), a.ctx, a.target)
    pick = np.random.default_rng(0).permutation(len(cases))[:a.cases or None]  # any prefix is a random sample
    full, removed, cases = full[pick], removed[pick], [cases[i] for i in pick]
    n_target = np.asarray([c.n_target for c in cases])
    print(f"{len(cases)} cases from {len({c.file for c in cases})} files ({time.perf_counter() - t0:.0f} s)")
    per = run(cfg, params, full, removed, n_target, ctx=a.ctx, m=a.target, batch=a.batch, n_new=a.new, hasher=hasher,
              progress=not a.smoke, seconds=60 * a.minutes if a.minutes else None,
              partial=Path(a.partial) if a.partial else None)
    cases = cases[:len(per["exact"]["correct"])]
    dev = "cpu" if jax.default_backend() == "cpu" else "h200" if "H200" in device_name() else jax.default_backend()
    out = a.out or str(REPO / "bench" / "results" / f"long_context_probe_default_{dev}.json")
    train = ckpt / "training.json"
    name = json.loads(train.read_text())["model"]["name"] if train.exists() else ckpt.name
    n_pkg = len({c.file for c in cases} & {rel for lab, rel, _ in sources if lab == "package"})
    result = {
        "model": name, "checkpoint": str(ckpt), "device": device_name(), "cases": len(cases),
        "files": len({c.file for c in cases}), "ctx": a.ctx, "target_tokens": a.target, "min_dist": a.min_dist,
        "max_dist": a.max_dist, "per_file": a.per_file, "batch": a.batch,
        "median_distance": int(np.median([c.distance for c in cases])) if cases else 0,
        "sources": f"{len(sources)} held-out files, {len(stream):,} tokens; the cases' files: "
                   f"{len({c.file for c in cases}) - n_pkg} stdlib, {n_pkg} site-packages",
        "summary": summarize(per, cases), "seconds": round(time.perf_counter() - t0, 1),
        "per_case": [{"file": c.file, "name": c.name, "kind": c.kind, "distance": c.distance,
                      "nearest": c.nearest, "target": c.target_text, "n_target": c.n_target,
                      **{v: bool(per[v]["correct"][i]) for v in CONDITIONS}} for i, c in enumerate(cases)],
        "file": str(Path(out).resolve().relative_to(REPO)) if Path(out).resolve().is_relative_to(REPO) else out}
    cmd = "python -m bench.long_context_probe " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    rec = write_result(out, result, cmd.strip())
    print(f"\n{'condition':<9} {'accuracy':>14} {'first':>14} {'vs exact':>14} {'NLL':>16}")
    for v in CONDITIONS:
        m = result["summary"][v]
        vs = m.get("vs_exact_accuracy")
        print(f"{v:<9} {pm(m['accuracy']):>14} {pm(m['first_token']):>14} {pm(vs) if vs else '':>14} "
              f"{pm(m['target_nll'], pct=False):>16}")
    print(f"{len(cases)} cases in {result['seconds']} s -> {out}")
    return rec


if __name__ == "__main__":
    main()
