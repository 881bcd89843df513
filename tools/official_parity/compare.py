"""Parity of dsv41_jax with the official V4.1 reference code on CPU (see README.md in this folder).

    python -m tools.official_parity.compare --python /path/to/torch-venv/bin/python [--config '{"n_layers": 2}']

Writes our random tiny parameters in the official layout, runs the official Transformer on the same tokens
(run_official.py, under the given Python with torch), then runs our forward with the reference's indexer
selections forced (bf16 near-ties otherwise flip) and prints the logits error. With --layerwise it also
feeds every layer the reference's own input and reports per-layer differences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax  # noqa: F401
from checkpoints.hf_layout import export_tensors
from checkpoints.safetensors_io import save_file
from dsv41_jax import paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params

HERE = Path(__file__).resolve().parent


def official_args(cfg: ModelConfig, batch: int) -> dict:
    skip = {"name", "weight_format", "compute_dtype", "qdq", "engram_num_embeddings"}
    args = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in args.items()}
    args.update(engram_num_embeddings=list(cfg.engram_rows), max_batch_size=batch, max_seq_len=cfg.max_seq_len,
                vision_n_layers=0, dtype="fp8", expert_dtype="fp4")
    if cfg.has_draft:  # the reference lists a ratio for every layer, the DSpark stages (SWA only) included
        args["compress_ratios"] = args["compress_ratios"] + [0] * cfg.n_mtp_layers
    return args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True, help="a Python with torch and the official code importable")
    ap.add_argument("--config", default="{}", help="JSON overrides of the tiny preset")
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--decode-from", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the numbers to this results JSON")
    a = ap.parse_args()
    ov = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(a.config).items()}
    cfg = ModelConfig.preset("tiny", **ov)
    params = jax.jit(lambda: init_params(cfg, 0))()
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        save_file(dict(export_tensors(cfg, params, module_format=True)), td / "w.safetensors")
        (td / "args.json").write_text(json.dumps(official_args(cfg, a.batch)))
        toks = np.random.default_rng(1).integers(0, cfg.vocab_size, (a.batch, a.seq))
        np.save(td / "t.npy", toks)
        cmd = [a.python, str(HERE / "run_official.py"), "--args-json", str(td / "args.json"), "--weights",
               str(td / "w.safetensors"), "--tokens", str(td / "t.npy"), "--dump-topk", "--out", str(td / "r.npz")]
        if a.decode_from:
            cmd += ["--decode-from", str(a.decode_from)]
        subprocess.run(cmd, check=True, cwd=HERE)
        ref = dict(np.load(td / "r.npz"))
    forced = {l: jnp.asarray(ref[f"topk_L{l}"]) for l in cfg.index_source_layers}
    ours = paths.forward(cfg, params, toks, forced_topk=forced or None)
    ours, r = np.asarray(ours), ref["prefill_logits"]
    rel = float(np.linalg.norm(ours - r) / np.linalg.norm(r))
    print(f"forward (forced top-k): rel err {rel:.3g}  max abs {np.abs(ours - r).max():.3g}  "
          f"argmax agree {np.mean(ours.argmax(-1) == r.argmax(-1)):.3f}  "
          f"bit-identical rows {np.mean(np.all(ours == r, -1)):.3f}")
    _, free_topk = paths.forward(cfg, params, toks, return_topk=True)
    res = {"config": json.loads(a.config), "batch": a.batch, "seq": a.seq, "forced_rel_err": rel,
           "forced_max_abs": float(np.abs(ours - r).max()), "forced_argmax_agree": float(np.mean(
               ours.argmax(-1) == r.argmax(-1))), "forced_bit_identical_rows": float(np.mean(np.all(ours == r, -1)))}
    for l in cfg.index_source_layers:
        agree = float(np.mean(np.asarray(free_topk[l]) == ref[f"topk_L{l}"]))
        res[f"unforced_topk_agree_L{l}"] = agree
        print(f"  unforced top-k agreement, layer {l}: {agree:.3f}")
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, command="python -m tools.official_parity.compare --python PY --config "
                     f"'{a.config}' --seq {a.seq} --batch {a.batch}")


if __name__ == "__main__":
    main()
