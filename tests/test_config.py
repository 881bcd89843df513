import json
import os

import pytest

from dsv41_jax.config import ModelConfig
from dsv41_jax.params import num_params
from dsv41_jax.schedule import decoder_schedule, encoder_schedule

from .conftest import DATA


def test_full_param_count_and_kv_bytes():
    full = ModelConfig.preset("full")
    n = num_params(full)
    assert 551e9 < n < 553e9, n  # ~552B backbone (Engram tables excluded)
    assert full.global_kv_bytes_per_token() == 890
    assert full.num_engram_table_params() == (384006168 + 384016682) * 256  # ~196B
    assert full.swa_kv_bytes_per_request() == 40 * 128 * 528
    assert full.exact_tail_rows() == 128 + 19 * 127


def test_presets_sizes():
    assert 200e6 < num_params(ModelConfig.preset("small")) < 280e6
    med = ModelConfig.preset("medium")
    assert med.n_layers == 40 and med.dim == 5120 and med.n_routed_experts == 16
    assert num_params(med) * 2 < 100e9  # bf16 weights fit one H200 with room for KV
    tiny = ModelConfig.preset("tiny")
    assert tiny.exact_tail_rows() == 8 + 3 * 7 == 29
    assert 0.9e6 < num_params(tiny) < 1.5e6


def test_from_hf_config_is_full():
    cfg = ModelConfig.from_hf_config(os.path.join(DATA, "deepseek_v41_config.json"))
    assert cfg == ModelConfig.preset("full")
    # the engram prime layout reproduces the official table sizes
    assert cfg.engram_layout.num_embeddings == (384006168, 384016682)


def test_from_hf_config_rejects_unknown_and_missing(tmp_path):
    raw = json.load(open(os.path.join(DATA, "deepseek_v41_config.json")))
    raw["text_config"]["surprise_field"] = 1
    with pytest.raises(ValueError, match="surprise_field"):
        ModelConfig.from_hf_dict(raw)
    raw = json.load(open(os.path.join(DATA, "deepseek_v41_config.json")))
    del raw["text_config"]["kv_source_layer_ids"]
    with pytest.raises(ValueError, match="kv_source_layer_ids"):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("bad", [
    dict(head_dim=48),
    dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1)),
    dict(candidate_topk_blocks=1),
    dict(engram_layer_ids=(5,)),
    dict(kv_source_layers=(1,)),
])
def test_validation(bad):
    with pytest.raises(ValueError):
        ModelConfig.preset("tiny", **bad)


def test_full_schedule_segments():
    full = ModelConfig.preset("full")
    enc, dec = encoder_schedule(full), decoder_schedule(full)
    covered = []
    for s in enc + dec:
        for f, r in zip(s.firsts, s.reuse):
            covered += [f, *r]
    assert covered == list(range(40))
    assert len(enc) + len(dec) == 6
    sig = [(s.kind, s.firsts, s.n_reuse, s.engram_slot) for s in enc + dec]
    assert sig == [("swa", (0,), 0, -1), ("swa", (1,), 0, 0), ("src", (2, 8), 5, -1), ("src", (14,), 5, 1),
                   ("src", (20,), 3, -1), ("idx", (24, 28, 32, 36), 3, -1)]
    assert dec[0].prebuilt and dec[0].cand_source and dec[1].uses_cand
