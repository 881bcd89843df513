"""Tokenizers for the engine and the servers: byte-level (default), an HF tokenizer.json, or none.

- `ByteTokenizer`: ids 0..255 are UTF-8 bytes; 256 = <bos>, 257 = <eos> (when the vocabulary has room);
  other ids decode to nothing. Works with any vocabulary >= 256 (the tiny preset has 512).
- `HFTokenizer`: a `tokenizer.json` through the `tokenizers` package (chat template: the one shipped in a
  sibling tokenizer_config.json when present).
- `none`: token-id prompts only; decode returns "".
"""

from __future__ import annotations

import json
from pathlib import Path


class ByteTokenizer:
    name = "byte"

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError("the byte tokenizer needs a vocabulary of at least 256")
        self.vocab_size = vocab_size
        self.bos_token_id = 256 if vocab_size > 256 else None
        self.eos_token_id = 257 if vocab_size > 257 else None
        self.chat_template = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_str(self, i: int) -> str:
        return self.decode([i]) if i < 256 else f"<{i}>"


class HFTokenizer:
    name = "hf"

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        p = Path(path)
        self.tok = Tokenizer.from_file(str(p if p.is_file() else p / "tokenizer.json"))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        conf = (p.parent if p.is_file() else p) / "tokenizer_config.json"
        meta = json.loads(conf.read_text()) if conf.exists() else {}
        self.chat_template = meta.get("chat_template")

        def tid(name):
            v = meta.get(name)
            if isinstance(v, dict):
                v = v.get("content")
            return self.tok.token_to_id(v) if isinstance(v, str) else None

        self.bos_token_id = tid("bos_token")
        self.eos_token_id = tid("eos_token")

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_str(self, i: int) -> str:
        return self.tok.id_to_token(int(i)) or ""


class NoTokenizer:
    name = "none"
    bos_token_id = eos_token_id = chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise ValueError("this server has no tokenizer (--tokenizer none): send token ids")

    def decode(self, ids) -> str:
        return ""

    def token_str(self, i: int) -> str:
        return ""


def load_tokenizer(spec: str | None, vocab_size: int):
    if spec in (None, "", "byte"):
        return ByteTokenizer(vocab_size)
    if spec == "none":
        return NoTokenizer(vocab_size)
    tok = HFTokenizer(spec)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocabulary is {vocab_size}")
    return tok
