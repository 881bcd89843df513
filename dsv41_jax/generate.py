"""Generate text with the model directly (no server): CED prefill, then greedy or sampled decode steps.

    python -m dsv41_jax.generate --preset tiny --prompt "Hello" --max-tokens 16

Byte-level tokenizer (ids 0..255 are bytes; the tiny preset's vocabulary is 512) and random weights of the
preset unless --checkpoint points at parameters saved by `checkpoints` (issue 3). Prints the tokens, the
text and the time per phase.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import dsv41_jax  # noqa: F401
from dsv41_jax import paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompt", default="The quick brown fox")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--mode", default="bounded", choices=["bounded", "exact", "full"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cfg = ModelConfig.preset(a.preset)
    ids = np.frombuffer(a.prompt.encode(), np.uint8).astype(np.int32)[None] % cfg.vocab_size
    if ids.shape[1] == 0:
        raise SystemExit("empty prompt")
    max_len = max(cfg.window_size, ids.shape[1] + a.max_tokens)
    t0 = time.perf_counter()
    params = jax.jit(lambda: init_params(cfg, a.seed))()
    t1 = time.perf_counter()
    logits, ds, _ = paths.ced_prefill(cfg, params, ids, mode=a.mode, max_len=max_len)
    logits = np.asarray(logits[:, -1])
    t2 = time.perf_counter()
    rng = np.random.default_rng(a.seed)
    out = []
    for _ in range(a.max_tokens):
        if a.temperature > 0:
            p = np.exp((logits - logits.max(-1, keepdims=True)) / a.temperature)
            tok = np.array([rng.choice(p.shape[-1], p=p[0] / p[0].sum())])
        else:
            tok = logits.argmax(-1)
        out.append(int(tok[0]))
        lg, ds = paths.decode_step(cfg, params, ds, tok)
        logits = np.asarray(lg)
    t3 = time.perf_counter()
    text = bytes(t for t in out if t < 256).decode("utf-8", errors="replace")
    print(f"tokens: {out}")
    print(f"text:   {text!r}")
    print(f"init {t1 - t0:.2f}s  prefill {t2 - t1:.2f}s (incl. compile)  decode {t3 - t2:.2f}s for {len(out)} tokens")


if __name__ == "__main__":
    main()
