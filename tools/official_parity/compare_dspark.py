"""DSpark parity with the official reference's `forward_spec` on CPU (see README.md in this folder).

    python -m tools.official_parity.compare_dspark --python /path/to/torch-venv/bin/python [--spec-from 3 12]

Writes our random tiny parameters (the draft's mtp.* tensors included) in the official layout, then for each K
runs the official Transformer (run_official.py --spec-from K, temperature 0): prefill of K tokens (forward_spec
seeds the rings), then one decode step per remaining token, each followed by forward_spec (greedy drafts). Both
sides get the same inputs: our draft (dsv41_jax.dspark: write_context + propose) reads the reference's own
main_hidden and anchors, so the numbers measure the draft alone. K < window tests a ring still filling, K >
window a wrapped one. Separately, our backbone's features (model.step(features=True), prefill, the reference's
indexer picks forced) are compared with the reference's main_hidden.
"""

from __future__ import annotations

import argparse
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
from dsv41_jax import dspark, model, paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params
from tools.official_parity.compare import HERE, official_args


def _stats(ours, ref, prefix):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    return {f"{prefix}_rel_err": float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30)),
            f"{prefix}_max_abs": float(np.abs(ours - ref).max()),
            f"{prefix}_bit_identical": float(np.mean(ours == ref))}


def run_ours(cfg, params, ref, K):
    """Our draft on the reference's inputs: (logits [B,n,k,V], tokens [B,n,k], confidence [B,n,k])."""
    B = ref["spec_anchor"].shape[0]
    write = jax.jit(dspark.write_context, static_argnums=0)
    prop = jax.jit(dspark.propose, static_argnums=0)
    rings = dspark.DraftRings.init(cfg, B)
    pos = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
    rings = write(cfg, params, rings, jnp.asarray(ref["spec_prefill_hidden"]), pos, jnp.ones((B, K), bool))
    out = {"logits": [], "tokens": [], "confidence": []}
    for i in range(ref["spec_anchor"].shape[1]):
        t = K + i
        p1 = jnp.full((B, 1), t, jnp.int32)
        rings = write(cfg, params, rings, jnp.asarray(ref["spec_hidden"][:, i:i + 1]), p1, jnp.ones((B, 1), bool))
        pr = prop(cfg, params, rings, jnp.asarray(ref["spec_anchor"][:, i], jnp.int32), p1[:, 0] + 1,
                  jax.random.key(0), jnp.zeros((B,)))
        for k in out:
            out[k].append(np.asarray(getattr(pr, k)))
    return {k: np.stack(v, axis=1) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True, help="a Python with torch and the official code importable")
    ap.add_argument("--config", default="{}", help="JSON overrides of the tiny preset")
    ap.add_argument("--seq", type=int, default=24)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--spec-from", type=int, nargs="+", default=[3, 12])
    ap.add_argument("--out", default=None, help="write the numbers to this results JSON")
    a = ap.parse_args()
    ov = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(a.config).items()}
    cfg = ModelConfig.preset("tiny", **ov)
    assert cfg.has_draft
    params = jax.jit(lambda: init_params(cfg, 0))()
    res = {"config": json.loads(a.config), "batch": a.batch, "seq": a.seq, "runs": {}}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        save_file(dict(export_tensors(cfg, params, module_format=True)), td / "w.safetensors")
        (td / "args.json").write_text(json.dumps(dict(official_args(cfg, a.batch), temperature=0)))
        toks = np.random.default_rng(1).integers(0, cfg.vocab_size, (a.batch, a.seq))
        np.save(td / "t.npy", toks)
        for K in a.spec_from:
            cmd = [a.python, str(HERE / "run_official.py"), "--args-json", str(td / "args.json"), "--weights",
                   str(td / "w.safetensors"), "--tokens", str(td / "t.npy"), "--dump-topk", "--skip-full",
                   "--spec-from", str(K), "--out", str(td / f"r{K}.npz")]
            subprocess.run(cmd, check=True, cwd=HERE)
            ref = dict(np.load(td / f"r{K}.npz"))
            ours = run_ours(cfg, params, ref, K)
            r = _stats(ours["logits"], ref["spec_logits"], "logits")
            r.update(_stats(ours["confidence"], ref["spec_confidence"], "confidence"))
            r["argmax_agree"] = float(np.mean(ours["logits"].argmax(-1) == ref["spec_logits"].argmax(-1)))
            r["tokens_agree"] = float(np.mean(ours["tokens"] == ref["spec_tokens"]))
            r["logit_rows_bit_identical"] = float(np.mean(np.all(ours["logits"] == ref["spec_logits"], -1)))
            # our backbone's features on the prefill, the reference's indexer picks forced
            st = model.init_state(cfg, a.batch, cfg.max_seq_len)
            width = {r: min(cfg.index_topk, st.glob.lat[r].shape[2]) for r in st.glob.lat}
            forced = {}
            for l in cfg.index_source_layers:
                t = ref[f"decode_prefill_topk_L{l}"]
                w = width[cfg.compress_ratios[l]]
                forced[l] = jnp.asarray(np.pad(t, [(0, 0), (0, 0), (0, w - t.shape[-1])], constant_values=-1))
            ids = paths.engram_ids(cfg, toks[:, :K])
            f = model.step(cfg, params, st, model.ChunkInputs.make(toks[:, :K], ids), fresh=True, n_dec=K,
                           n_logits=1, forced_topk=forced, features=True).features
            r.update(_stats(f.x, ref["spec_prefill_hidden"], "features"))
            res["runs"][f"spec_from_{K}"] = r
            print(f"K={K}: draft logits rel err {r['logits_rel_err']:.3g} (max abs {r['logits_max_abs']:.3g}, "
                  f"bit-identical rows {r['logit_rows_bit_identical']:.3f}), argmax agree {r['argmax_agree']:.3f}, "
                  f"tokens agree {r['tokens_agree']:.3f}, confidence max abs {r['confidence_max_abs']:.3g}; "
                  f"backbone features rel err {r['features_rel_err']:.3g} "
                  f"(bit-identical {r['features_bit_identical']:.3f})")
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, command="python -m tools.official_parity.compare_dspark --python PY --config "
                     f"'{a.config}' --seq {a.seq} --batch {a.batch} --spec-from {' '.join(map(str, a.spec_from))}")
    return res


if __name__ == "__main__":
    main()
