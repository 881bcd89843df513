"""The server speculates with a model's DSpark draft without being asked only where the draft was measured to help:
a GPU, a draft in the model, its dspark.json recording a mean accepted length >= DRAFT_MIN_ACCEPTED, no
--speculative-config given (an explicit one, `none` included, wins)."""

import dataclasses
import json
from types import SimpleNamespace

from serving import run
from serving.engine.config import EngineArgs
from serving.engine.engine import model_config_of
from serving.engine.spec_decode import SpeculativeConfig

ARGS = EngineArgs(max_model_len=256)
DRAFTED = SimpleNamespace(has_draft=True, dspark_block_size=4, engram_layer_ids=())


def _model_dir(tmp_path, accepted):
    rec = {"acceptance_greedy_heldout": {f"new_{i}": {"mean_accepted_length": a} for i, a in enumerate(accepted)}}
    (tmp_path / run.DRAFT_RECORD).write_text(json.dumps(rec))
    return str(tmp_path)


def test_the_rule(tmp_path):
    for d in ("good", "weak", "unmeasured"):
        (tmp_path / d).mkdir()
    good = _model_dir(tmp_path / "good", [3.1, 2.5])
    on = run.with_measured_draft(ARGS, good, DRAFTED, "gpu")
    assert SpeculativeConfig.parse(on.speculative_config) == SpeculativeConfig.parse(
        {"method": "dspark", "num_speculative_tokens": 4})
    assert run.with_measured_draft(ARGS, good, DRAFTED, "cpu") is ARGS  # not the CPU default (serving/run.py says why)
    assert run.with_measured_draft(ARGS, good, SimpleNamespace(has_draft=False), "gpu") is ARGS
    for explicit in ("none", '{"method": "ngram", "num_speculative_tokens": 3}'):
        a = dataclasses.replace(ARGS, speculative_config=explicit)
        assert run.with_measured_draft(a, good, DRAFTED, "gpu").speculative_config == explicit
    assert SpeculativeConfig.parse("none") is None and SpeculativeConfig.parse(" None ") is None
    weak = _model_dir(tmp_path / "weak", [3.1, 1.9])  # one evaluation under the bar: not by default
    assert run.with_measured_draft(ARGS, weak, DRAFTED, "gpu") is ARGS
    assert run.with_measured_draft(ARGS, str(tmp_path / "unmeasured"), DRAFTED, "gpu") is ARGS
    assert run.with_measured_draft(ARGS, "medium", DRAFTED, "gpu") is ARGS  # a preset: random weights
    engram = SimpleNamespace(has_draft=True, dspark_block_size=4, engram_layer_ids=(1,))
    host = dataclasses.replace(ARGS, engram_config='{"cpu_offload": true}')  # not combined with speculation
    assert run.with_measured_draft(host, good, engram, "gpu") is host
    dev = dataclasses.replace(ARGS, engram_config='{"cpu_offload": false}')
    assert run.with_measured_draft(dev, good, engram, "gpu").speculative_config is not None


def test_the_embedded_default_model_qualifies():
    """The shipped draft and its record: on a GPU the default model is served with DSpark, k = its block."""
    cfg = model_config_of(run.DEFAULT_MODEL, None)
    assert cfg.has_draft
    got = run.with_measured_draft(ARGS, run.DEFAULT_MODEL, cfg, "gpu")
    assert json.loads(got.speculative_config) == {"method": "dspark", "num_speculative_tokens": cfg.dspark_block_size}
