"""Incremental detokenization equals decoding the whole output (byte-level and HF byte-level BPE, Metaspace),
stop strings are found in the new window only and never partly released, and the work per token is bounded."""
import pytest

from serving.engine.detokenizer import IncrementalDetokenizer
from serving.tokenizer import ByteTokenizer

TEXTS = ["hello world, the quick brown fox", "naïve café – 日本語のテキスト 🙂 ok", "def f(x):\n    return x ** 2\n"]


class CountingTokenizer:
    """Wraps a tokenizer and counts how many ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def _hf(tmp_path, kind):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # sentencepiece-style spaces
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = sorted(set("".join(TEXTS).replace(" ", "\u2581")))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], initial_alphabet=alphabet)
    tok.train_from_iterator(TEXTS * 10, trainer)
    path = tmp_path / f"{kind}.json"
    tok.save(str(path))
    from serving.tokenizer import HFTokenizer

    return HFTokenizer(str(path))


@pytest.fixture(params=["byte", "bytelevel", "metaspace"])
def tokenizer(request, tmp_path):
    return ByteTokenizer(512) if request.param == "byte" else _hf(tmp_path, request.param)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.append(t) for t in ids]
    d.flush()
    assert "".join(pieces) == d.text == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # never a half UTF-8 character


def test_special_ids_are_skipped():
    tok = ByteTokenizer(512)
    d = IncrementalDetokenizer(tok, skip_ids={257})
    for t in tok.encode("ab") + [257] + tok.encode("c"):
        d.append(t)
    assert d.text == "abc"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_and_never_partly_released(include):
    tok = ByteTokenizer(512)
    d = IncrementalDetokenizer(tok, stop=["hO", "xyz"], include_stop=include)
    released = []
    for ch in "abchdhO tail":
        d.append(tok.encode(ch)[0])
        released.append(d.text[:d.releasable()])
        if d.stopped:
            break
    assert d.stopped == "hO"
    assert d.text == ("abchdhO" if include else "abchd")
    # while streaming, the held-back tail that could start "hO" (the 'h') was never released early
    assert "abch" not in released[:4] and released[3] == "abc"
    assert all(not r.endswith("h") for r in released[:-1] if r)


def test_stop_string_spanning_tokens_found_once(tmp_path):
    tok = _hf(tmp_path, "bytelevel")
    ids = tok.encode("the quick brown fox jumps")
    d = IncrementalDetokenizer(tok, stop=["brown f"])
    for t in ids:
        d.append(t)
    assert d.stopped == "brown f" and d.text == "the quick "


def test_work_per_token_is_bounded():
    tok = CountingTokenizer(ByteTokenizer(512))
    d = IncrementalDetokenizer(tok, stop=["never"])
    ids = ByteTokenizer(512).encode("x" * 4000)
    for t in ids:
        d.append(t)
    assert d.text == "x" * 4000
    assert tok.decoded < 6 * len(ids)  # O(n), not O(n^2) (which would be ~8e6)
