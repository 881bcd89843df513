"""The Python standard library's ``.py`` sources as a corpus (the default model's full corpus, with the installed
packages' sources, is `training.code_corpus`): files, the fixed held-out split, the BPE tokenizer,
token streams, and the long held-out documents of the replay-quality benchmark.

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` of the running interpreter, test suites included
when installed, except anything under ``site-packages`` / ``dist-packages`` / ``__pycache__``; read as UTF-8
(undecodable bytes replaced). Each file is one document: ``<|bos|>`` + its text + ``<|end|>``.

Split (fixed, documented in the shipped training.json): ``h = int(sha256(rel).hexdigest()[:16], 16) % 100``
where ``rel`` is the path relative to the stdlib root in POSIX form (e.g. ``asyncio/tasks.py``); ``h < 20`` is
held out (20 % of paths: the reported held-out loss, completions and the replay benchmark), ``20 <= h < 23``
is validation (3 %: monitoring and best-checkpoint selection during training), the rest is training data. The
hash depends on the path only, so two Python builds (3.12.1 here, 3.12.3 on the GPU) agree on every common file;
files present on one machine only just join their side of the split, and training.json lists the held-out files
(path, SHA-1) that were read.

Tokenizer: byte-level BPE (the `tokenizers` library), 8192 ids, trained on the training split's files without
test suites (the same files on every machine). Special tokens, ids 0-7: <|bos|> <|end|> <|pad|> <|system|>
<|user|> <|assistant|> <|tool|> <|tools|>. <|end|> ends a file and a chat turn (the EOS token); <|pad|> is
id 2, the Engram pad id. The chat template is the engine's built-in layout with a BOS:
``<|bos|><|system|>\\n...<|end|>\\n<|user|>\\n...<|end|>\\n<|assistant|>\\n``.

Replay documents: the held-out documents concatenated in split-hash order and cut into consecutive,
non-overlapping windows of `doc_len` tokens (a window may span files, as an agent's context does).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHECK_LEN = 577  # tokens of each check document (training.json "check": loss test, replay smoke, notebook)
HELD_OUT_PERCENT = 20
VALID_PERCENT = 3
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|bos|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|tools|>"]
BOS, END, PAD = 0, 1, 2
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SYSTEM_PROMPT = "You are a Python coding assistant. Answer with Python code."


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_bucket(rel: str) -> int:
    """0..99 from the SHA-256 of the POSIX relative path."""
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:16], 16) % 100


def is_held_out(rel: str) -> bool:
    return split_bucket(rel) < HELD_OUT_PERCENT


def split_name(rel: str, held_out: int = HELD_OUT_PERCENT, valid: int = VALID_PERCENT) -> str:
    """'heldout' / 'valid' / 'train' by the path's bucket (the stdlib's shares by default)."""
    b = split_bucket(rel)
    return "heldout" if b < held_out else "valid" if b < held_out + valid else "train"


def is_test(rel: str) -> bool:
    return bool(TEST_DIRS & set(rel.split("/")[:-1]))


@dataclass(frozen=True)
class SourceFile:
    rel: str
    path: Path

    @property
    def held_out(self) -> bool:
        return is_held_out(self.rel)

    @property
    def split(self) -> str:
        return split_name(self.rel)

    def text(self) -> str:
        return self.path.read_bytes().decode("utf-8", errors="replace")

    def sha1(self) -> str:
        return hashlib.sha1(self.path.read_bytes()).hexdigest()


def list_files(root: Path | None = None, *, tests: bool = True) -> list[SourceFile]:
    """Every corpus file, sorted by (split bucket, path): a fixed order on every machine."""
    root = Path(root) if root else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if EXCLUDED_DIRS & set(parts) or not p.is_file():
            continue
        if not tests and is_test(rel):
            continue
        out.append(SourceFile(rel, p))
    return sorted(out, key=lambda f: (split_bucket(f.rel), f.rel))


def split(files: list[SourceFile]) -> dict[str, list[SourceFile]]:
    """{'train': [...], 'valid': [...], 'heldout': [...]}"""
    out = {"train": [], "valid": [], "heldout": []}
    for f in files:
        out[f.split].append(f)
    return out


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE with the special tokens at ids 0..7."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, tr)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|end|>",
            "pad_token": "<|pad|>", "model_max_length": 8192, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}


def write_tokenizer(tok, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def encode_docs(tok, texts: list[str]) -> list[np.ndarray]:
    """[<|bos|>] + tokens + [<|end|>] per text, int32."""
    enc = tok.encode_batch(texts, add_special_tokens=False)
    return [np.asarray([BOS, *e.ids, END], np.int32) for e in enc]


# ----------------------------------------------------------------------------- streams and windows
def stream(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(docs) if docs else np.zeros((0,), np.int32)


def windows(s: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows [n, length] of a stream (the tail shorter than `length` dropped)."""
    n = len(s) // length
    if limit is not None:
        n = min(n, limit)
    return s[: n * length].reshape(n, length)


def replay_documents(tok, held_out: list[SourceFile], doc_len: int, limit: int | None = None) -> np.ndarray:
    """The replay benchmark's documents: [n, doc_len] windows of the held-out stream (module docstring)."""
    return windows(stream(encode_docs(tok, [f.text() for f in held_out])), doc_len, limit)


# ----------------------------------------------------------------------------- check documents
def check_texts(tok, held_out: list[SourceFile], n: int = 2, length: int = CHECK_LEN) -> list[str]:
    """The first `n` held-out files long enough for a `length`-token window, each cut at the first line end
    after <|bos|> + its tokens reach `length` (stored in training.json, so tests need no stdlib)."""
    out = []
    for f in held_out:
        text = f.text()
        if len(tok.encode(text).ids) + 1 < length:
            continue
        cut, n_chars = text.splitlines(keepends=True), 0
        for i in range(len(cut)):
            n_chars += len(cut[i])
            if len(tok.encode(text[:n_chars]).ids) + 1 >= length:
                break
        out.append(text[:n_chars])
        if len(out) == n:
            break
    return out


def prefix_texts(tok, held_out: list[SourceFile], n: int = 20, tokens: int = 192) -> list[str]:
    """Starts of the first `n` held-out files with over 2 x `tokens` tokens, each cut at the last line end within
    its first `tokens` tokens (the greedy-completion prompts of tests/test_default_model.py)."""
    out = []
    for f in held_out:
        text = f.text()
        ids = tok.encode(text).ids
        if len(ids) < 2 * tokens:
            continue
        head = tok.decode(ids[:tokens])
        cut = head.rfind("\n")
        if cut > 0 and text.startswith(head[:cut + 1]):
            out.append(head[:cut + 1])
        if len(out) == n:
            break
    return out


def check_windows(tok, texts: list[str], length: int = CHECK_LEN) -> np.ndarray:
    """[n, length] int32: (<|bos|> + tokens of each text)[:length]."""
    rows = []
    for t in texts:
        ids = [BOS, *tok.encode(t).ids][:length]
        if len(ids) < length:
            raise ValueError(f"check text too short: {len(ids)} < {length} tokens")
        rows.append(ids)
    return np.asarray(rows, np.int32)
