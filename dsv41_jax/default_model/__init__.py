"""The embedded default model: a small V4.1-architecture model trained on the Python standard library.

The files of this directory are package data: config.json, model-*.safetensors[.xz] and
model.safetensors.index.json (the official HF layout: FP8 linears, MXFP4 experts; every file under 4 MiB, the
embedding and head shards xz-compressed by ``checkpoints.packed_shards``), tokenizer.json and
tokenizer_config.json (byte-level BPE, 8192 ids, chat template) and training.json (how it was trained, the
data split, the recorded held-out losses and the check documents tests/test_default_model.py re-scores).
Made by the first version of ``training/train_default.py`` (then in ``bench/``, commit c00bbf5; Python
standard library only); load it with ``checkpoints.load(DIR)``.
"""

from pathlib import Path

DIR = Path(__file__).resolve().parent
