"""The shipped default model (dsv41_jax/default_model): its files and formats, its tokenizer and chat template, the
held-out loss recorded when it was exported (re-scored here through the server's loader and tokenizer), the QAT
view used to train it, and notebooks/model_tour.ipynb run top to bottom.

The check loss is re-scored on CPU while it was recorded on the training device (an H200): bf16 GEMM rounding and
near-ties of the MoE / indexer top-k differ between the two, so the tolerance is CHECK_TOL nats/token on the mean
over 2 x 576 tokens (a wrong tokenizer, loader or model change moves it by far more).
"""

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import checkpoints
from checkpoints.tree import flat
from dsv41_jax import paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.default_model import DIR
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.params import num_params
from serving.api.chat_template import ChatTemplate
from serving.engine.config import shared_cache_dir
from serving.tokenizer import HFTokenizer
from training import objective as T

REPO = Path(__file__).resolve().parents[1]
CHECK_TOL = 0.03
MAX_BYTES = 48_000_000  # issue 24: the package's model files <= 48 MB in all (decimal megabytes)


@pytest.fixture(scope="module")
def facts():
    return json.loads((DIR / "training.json").read_text())


@pytest.fixture(scope="module")
def model():
    return checkpoints.load(DIR, progress=False)


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(DIR)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    """Share compiled programs with the notebook kernel and tests/test_replay_quality.py (same shapes)."""
    jax.config.update("jax_compilation_cache_dir", shared_cache_dir())
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def test_files_config_and_formats(model):
    cfg, params = model
    names = {p.name for p in DIR.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "training.json"} <= names
    shards = sorted(DIR.glob("model-*.safetensors*"))  # plain, or xz-compressed (checkpoints.packed_shards)
    index = json.loads((DIR / "model.safetensors.index.json").read_text())
    assert {s.name.removesuffix(".xz") for s in shards} == set(index["weight_map"].values())
    ckpt_bytes = sum(p.stat().st_size for p in shards) + sum((DIR / n).stat().st_size for n in
                                                              ("config.json", "model.safetensors.index.json"))
    assert ckpt_bytes <= MAX_BYTES and index["metadata"]["total_size"] <= MAX_BYTES  # on disk, and unpacked
    assert max(p.stat().st_size for p in DIR.iterdir()) <= 4 * 2 ** 20  # every file under the repository's 4 MiB
    assert cfg == ModelConfig.from_hf_config(DIR)
    # every CED mechanism binds at 8K: window 128, ratio 0/2/1 layers with KV sharing, top-k << entries
    assert cfg.max_seq_len >= 8192 and cfg.window_size == 128
    assert set(cfg.compress_ratios) == {0, 1, 2} and cfg.n_decoder_layers >= 3
    assert len(cfg.kv_source_layers) < sum(1 for r in cfg.compress_ratios if r)  # reuse layers exist
    assert cfg.index_topk * 16 <= cfg.max_seq_len and cfg.candidate_source_layer >= 0
    assert cfg.n_routed_experts > cfg.n_activated_experts and cfg.hc_mult == 4 and cfg.engram_layer_ids
    assert 10e6 <= num_params(cfg) + cfg.num_engram_table_params() <= 15e6
    # FP8 linears and MXFP4 experts as the official layout stores them
    f = flat(params)
    assert f[("layers", "attn", "wq_a", "weight")].dtype == jnp.float8_e4m3fn
    assert f[("layers", "attn", "wq_a", "scale")].dtype == jnp.float8_e8m0fnu
    assert f[("layers", "ffn", "experts", "w1", "weight")].dtype == jnp.uint8  # two E2M1 per byte
    assert f[("layers", "ffn", "experts", "w1", "scale")].dtype == jnp.float8_e8m0fnu


def test_tokenizer_and_chat_template(model, tok):
    cfg, _ = model
    assert tok.vocab_size == cfg.vocab_size
    assert tok.token_str(tok.bos_token_id) == "<|bos|>" and tok.token_str(tok.eos_token_id) == "<|end|>"
    assert tok.tok.token_to_id("<|pad|>") == cfg.engram_pad_id
    code = ("import os\n\n\ndef read_config(path, default=None):\n    \"\"\"Return the parsed file, or default.\"\"\"\n"
            "    if not os.path.exists(path):\n        return default  # é\n    with open(path) as f:\n"
            "        return f.read().splitlines()\n")
    ids = tok.encode(code)
    assert tok.decode(ids) == code and len(ids) < len(code) / 3  # BPE merges of Python code, lossless
    ct = ChatTemplate(tok)
    assert ct.origin == "tokenizer"
    text, ids = ct.encode([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n")
    assert text.endswith("<|assistant|>\n") and ids[0] == tok.bos_token_id
    assert ids.count(tok.eos_token_id) == 2  # each <|end|> is one special token
    conf = json.loads((DIR / "tokenizer_config.json").read_text())
    assert conf["eos_token"] == "<|end|>" and "chat_template" in conf


def test_recorded_check_loss_reproduces(model, tok, facts):
    """Re-score the stored held-out check documents with the loader, the server's tokenizer and the full
    forward: the same tokens as recorded (hash), and the mean loss within CHECK_TOL of the recorded one."""
    cfg, params = model
    c = facts["check"]
    docs = np.array([([tok.bos_token_id] + tok.encode(t))[:c["length"]] for t in c["texts"]], np.int32)
    assert docs.shape == (2, c["length"])
    assert hashlib.sha1(docs.tobytes()).hexdigest() == c["ids_sha1"]
    logits = paths.forward(cfg, params, docs[:, :-1])
    nll = np.asarray(T.token_nll(logits, jnp.asarray(docs[:, 1:])))
    assert np.all(np.isfinite(nll))
    assert abs(nll.mean() - c["loss"]) <= CHECK_TOL, (nll.mean(), c["loss"])
    np.testing.assert_allclose(nll.mean(1), c["per_document"], atol=2 * CHECK_TOL)
    if not facts["corpus"]["smoke"]:  # a trained model, far below the uniform distribution's log(V) = 9.01
        assert c["loss"] < np.log(cfg.vocab_size) - 3


def test_qat_view_serves_the_exported_values(tiny, tokens):
    """The training view (f32 masters, straight-through quantization) and the exported fp8 tree give the same
    forward bit for bit (the tiny preset); the head is exported as bf16 values."""
    m = jax.jit(lambda: T.init_masters(tiny, 3))()
    ids = EngramHasher(tiny).hash_ids(tokens)
    exported = jax.jit(lambda m: T.export_params(tiny, m))(m)
    hooks = T.train_hooks(indexer_stride=4)
    got, aux = jax.jit(lambda m: T.full_forward(tiny, T.qat_params(tiny, m), jnp.asarray(tokens), ids, hooks))(m)
    want = paths.forward(tiny, exported, tokens)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert float(aux.indexer_layers) == len(tiny.index_source_layers) and float(aux.indexer_kl) > 0
    head = np.asarray(flat(exported)[("head", "weight")])
    assert head.dtype == np.float32 and np.array_equal(head, head.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.timeout(600)
def test_model_tour_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("optax")
    monkeypatch.setenv("DSV41_COMPILATION_CACHE_DIR", shared_cache_dir())
    nb = nbformat.read(REPO / "notebooks" / "model_tour.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=400, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "check loss" in out and "greedy continuation" in out and "served" in out
    assert "reloaded fine-tuned model" in out


def test_continued_training_starts_at_the_shipped_weights(model):
    """`train_default --init-from` (a second training stage): masters made from the shipped checkpoint (its draft
    dropped) export back to the values it serves, every tensor equal in value (a block whose largest value lies
    below its scale's range may re-encode with half the scale and twice the codes), so the continued run starts
    exactly at the shipped model; the earlier stage's facts come with it."""
    from training import data as D
    from training.train_default import Run, model_config

    cfg = model_config()
    run = Run(cfg, T.Hyper(), D.data_mesh(), 0)
    fresh = flat(jax.device_get(run.export(run.masters)))
    prior = run.init_from(DIR)
    assert prior["tokens_seen"] > 0 and prior["steps"] > 0
    shipped = {k: v for k, v in model[1].items() if k != "mtp"}
    exported = jax.device_get(run.export(run.masters))
    got, want = flat(exported), flat(shipped)
    assert got.keys() == want.keys()
    values = jax.jit(lambda t: T.masters_from_params(cfg, t))
    got_v, want_v = flat(jax.device_get(values(exported))), flat(jax.device_get(values(shipped)))
    assert got_v.keys() == want_v.keys()
    for k, w in want_v.items():
        assert np.array_equal(got_v[k], w), k  # f32 views of the served values
    for k, w in want.items():
        g = np.ascontiguousarray(got[k])
        assert g.dtype == w.dtype and g.shape == w.shape, k
    assert any(fresh[k].tobytes() != np.ascontiguousarray(w).tobytes() for k, w in want.items())
