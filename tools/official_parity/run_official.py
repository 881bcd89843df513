#!/usr/bin/env python3
"""Run the official DeepSeek-V4.1 reference Transformer (official/model.py, unmodified) on CPU.

  venv/bin/python run_official.py --args-json ARGS.json --weights W.safetensors --tokens T.npy \
      --out OUT.npz [--decode-from K] [--dump-topk] [--force-topk F.npz] \
      [--engram-token-map MAP.npy | --tokenizer-json tokenizer.json]

Outputs (float32 logits; int32 top-k):
  prefill_logits         [B, S, V]   one prefill over all S tokens, every position
  decode_prefill_logits  [B, K, V]   (--decode-from K) prefill of tokens[:, :K] from a clean cache
  decode_logits          [B, S-K, V] (--decode-from K) then one token at a time, positions K..S-1
  spec_*                 (--spec-from K) DSpark: prefill tokens[:, :K] (forward_spec seeds the draft rings), then
                         decode one token at a time and run forward_spec after each step (set "temperature": 0
                         in the args for greedy): spec_prefill_hidden [B, K, n_t*D] (main_hidden of the prefill),
                         spec_hidden [B, S-K, n_t*D], spec_anchor [B, S-K] (the target's token), spec_tokens
                         [B, S-K, block] (drafts), spec_logits [B, S-K, block, V], spec_confidence [B, S-K, block];
                         the prefill's indexer picks are recorded as decode_prefill_topk_L{l} with --dump-topk
  topk_L{l}              [B, S, W]        (--dump-topk) index-source layer l, full prefill
  decode_prefill_topk_L{l} [B, K, W']     (--dump-topk, --decode-from)
  decode_topk_L{l}       [B, S-K, index_topk] (--dump-topk, --decode-from) decode steps, -1 padded;
                         an all -1 row means the indexer was not called (no compressed KV yet)
Top-k values are COMPRESSED POSITIONS (0-based index into the layer's compressed KV), i.e. the
Indexer's return value minus its `offset` argument (the window-KV length), -1 kept as -1. Row order is
as the reference returns it (ascending positions). W = min(index_topk, S // ratio).
--force-topk takes an npz with any subset of those same keys/layout and substitutes them for the
Indexer's output (re-adding the offset). Columns beyond the reference's width must be -1.
"""
import argparse
import json
import time

import numpy as np
import torch
from harness_common import build_model, load_args, load_weights, official_model, reset_state
from official import kernel_cpu

_phase = {"name": None, "step": None}
_records: dict[str, list] = {}
_forced: dict[str, np.ndarray] = {}
_dump = {"on": False}
_orig_indexer_forward = official_model.Indexer.forward


def _patched_indexer_forward(self, x, qr, latent, start_pos, offset):
    out = _orig_indexer_forward(self, x, qr, latent, start_pos, offset)
    layer = self._harness_layer_id
    phase, step = _phase["name"], _phase["step"]
    key = {"prefill": "topk_L{}", "decode_prefill": "decode_prefill_topk_L{}", "decode": "decode_topk_L{}"}[phase]
    key = key.format(layer)
    if key in _forced:
        arr = _forced[key]
        if phase == "decode":
            arr = arr[:, step : step + 1]
        width = out.shape[-1]
        forced = torch.from_numpy(np.ascontiguousarray(arr[: out.shape[0]])).long()
        if forced.shape[:2] != out.shape[:2]:
            raise SystemExit(f"--force-topk {key}: leading shape {tuple(forced.shape[:2])} != {tuple(out.shape[:2])}")
        if forced.shape[-1] > width:
            if (forced[..., width:] >= 0).any():
                raise SystemExit(f"--force-topk {key}: valid entries beyond reference width {width}")
            forced = forced[..., :width]
        elif forced.shape[-1] < width:
            forced = torch.cat([forced, forced.new_full((*forced.shape[:-1], width - forced.shape[-1]), -1)], -1)
        out = torch.where(forced >= 0, forced + offset, -1).int()
    if _dump["on"]:
        pos = torch.where(out >= 0, out.long() - offset, -1).int()
        _records.setdefault(key, []).append((step, pos.numpy().copy()))
    return out


official_model.Indexer.forward = _patched_indexer_forward
# every position's logits, not just the last (Transformer.forward calls self.head(x) positionally)
official_model.ParallelHead.forward.__defaults__ = (True,)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--args-json", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--tokens", required=True, help="int64 .npy [B, S]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode-from", type=int, default=None, metavar="K")
    ap.add_argument("--dump-topk", action="store_true")
    ap.add_argument("--spec-from", type=int, default=None, metavar="K")
    ap.add_argument("--force-topk", default=None, metavar="FILE.npz")
    ap.add_argument("--engram-token-map", default=None, help="int .npy [vocab_size] compressed ids")
    ap.add_argument("--tokenizer-json", default=None, help="use the real upstream token-map builder")
    ap.add_argument("--skip-full", action="store_true", help="skip the all-tokens prefill")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.set_default_dtype(torch.bfloat16)
    args = load_args(a.args_json)
    t0 = time.time()
    model, engram_desc = build_model(args, a.engram_token_map, a.tokenizer_json)
    load_weights(model, a.weights)
    t_load = time.time() - t0
    print(f"[run_official] built+loaded in {t_load:.2f}s; engram: {engram_desc}", flush=True)

    tokens = np.load(a.tokens)
    if tokens.ndim != 2:
        raise SystemExit(f"tokens must be [B, S], got {tokens.shape}")
    ids = torch.from_numpy(tokens.astype(np.int64))
    B, S = ids.shape
    if B > args.max_batch_size or S > args.max_seq_len:
        raise SystemExit(f"tokens {ids.shape} exceed max_batch_size={args.max_batch_size}/"
                         f"max_seq_len={args.max_seq_len}")
    if a.spec_from is not None and a.decode_from is not None:
        raise SystemExit("--spec-from and --decode-from record the same phases: pass one")
    if a.force_topk:
        _forced.update(dict(np.load(a.force_topk)))
    _dump["on"] = a.dump_topk
    out, timing = {}, {"build_load_s": t_load}

    if not a.skip_full:
        reset_state(model)
        _phase.update(name="prefill", step=None)
        t0 = time.time()
        _, logits, _ = model(ids, 0)
        timing["prefill_s"] = time.time() - t0
        out["prefill_logits"] = logits.float().numpy()

    if a.decode_from is not None:
        K = a.decode_from
        if not 1 <= K < S:
            raise SystemExit(f"--decode-from must be in [1, {S - 1}]")
        reset_state(model)
        _phase.update(name="decode_prefill", step=None)
        t0 = time.time()
        _, logits, _ = model(ids[:, :K], 0)
        out["decode_prefill_logits"] = logits.float().numpy()
        steps = []
        for t in range(K, S):
            _phase.update(name="decode", step=t - K)
            _, logits, _ = model(ids[:, t : t + 1], t)
            steps.append(logits.float().numpy())  # [B, 1, V]
        timing["decode_s"] = time.time() - t0
        out["decode_logits"] = np.concatenate(steps, axis=1)

    if a.spec_from is not None:
        K = a.spec_from
        reset_state(model)
        _phase.update(name="decode_prefill", step=None)
        out_ids, _, hidden = model(ids[:, :K], 0)
        model.forward_spec(out_ids[:, -1], hidden, 0)
        out["spec_prefill_hidden"] = hidden.float().numpy()
        rec = {k: [] for k in ("hidden", "anchor", "tokens", "logits", "confidence")}
        for t in range(K, S):
            _phase.update(name="decode", step=t - K)
            out_ids, _, hidden = model(ids[:, t : t + 1], t)
            toks, dlogits, conf = model.forward_spec(out_ids[:, -1], hidden, t)
            for k, v in zip(rec, (hidden[:, 0], out_ids[:, -1], toks[:, 1:], dlogits, conf)):
                rec[k].append(v.float().numpy() if v.is_floating_point() else v.numpy())
        for k, v in rec.items():
            out[f"spec_{k}"] = np.stack(v, axis=1)
        a.decode_from = K  # the decode-phase top-k records below are shaped by it

    for key, recs in _records.items():
        if key.startswith("decode_topk_"):
            arr = np.full((B, S - a.decode_from, args.index_topk), -1, np.int32)
            for step, pos in recs:
                arr[:, step, : pos.shape[-1]] = pos[:, 0]
            out[key] = arr
        else:
            assert len(recs) == 1, key
            out[key] = recs[0][1].astype(np.int32)

    np.savez(a.out, **out)
    finite = {k: bool(np.isfinite(v).all()) for k, v in out.items() if k.endswith("logits")}
    print(f"[run_official] wrote {a.out}: " + ", ".join(f"{k}{list(v.shape)}" for k, v in out.items()))
    print(f"[run_official] finite: {finite}")
    print(f"[run_official] timing: {json.dumps({k: round(v, 3) for k, v in timing.items()})}")
    print(f"[run_official] kernel calls: {kernel_cpu.COUNTS}")


if __name__ == "__main__":
    main()
