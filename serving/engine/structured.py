"""Grammar-constrained decoding (structured outputs) with llguidance.

A request's `SamplingParams.structured` (a `StructuredOutputs`: a JSON schema, any JSON object, a regex, a
choice of strings, or a Lark / GBNF grammar) is compiled once into a `CompiledGrammar`; each request gets its own
`GrammarState` (an `llguidance.LLMatcher`). The engine then, per sampling row:

- `GrammarState.fill(row)` writes the allowed-token bitmask into the row's `SamplingInputs.allowed` words
  (bit t % 32 of word t // 32 = token t: llguidance's own layout), so the compiled programs take the mask as an
  ordinary input: no recompiles, no extra device round trip; unconstrained rows keep the all-ones default and
  cost nothing;
- `GrammarState.advance(token)` consumes the sampled token when it is appended; `done` turns true once the
  grammar can only end (the engine finishes the request with reason "stop").

Budgets: `new_state(max_tokens)` makes the state budget-aware (serving/engine/grammar_budget.py): the output
closes within `max_tokens` whenever a valid completion fits, and `CompiledGrammar.min_tokens` (the fewest tokens
of any completion, in the served tokenizer's tokens, end-of-sequence included when the grammar needs it) lets
the API refuse a request whose budget is smaller, before any work (`check_budget`).

Why llguidance: one self-contained Rust wheel (abi3, no Python dependencies, no torch) that computes masks on
the CPU in tens of microseconds per token even for large vocabularies, supports JSON schema, regex, Lark (with
inline `%json` sub-grammars, used for tool calls) and GBNF, and writes the exact uint32 bitmask layout our
sampler takes. xgrammar needs torch at import; outlines-core only compiles regular languages (JSON schemas via
regexes, no recursion, no context-free grammars).

Tokenizers: the byte tokenizer (ids 0..255 are bytes, the rest special) and HF `tokenizer.json` files. JSON is
generated compactly (no optional whitespace), so a model cannot spend its budget on whitespace.
Invariant: a compiled grammar is immutable and shared; a `GrammarState` belongs to exactly one request.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import numpy as np

from serving.engine import grammar_budget as budget

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar): a client error (HTTP 400)."""


@dataclass
class StructuredOutputs:
    """vLLM's `structured_outputs` (exactly one of the constraint fields), plus `lark` for internal grammars."""
    json: dict | bool | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF (llama.cpp) grammar
    lark: str | None = None  # a Lark grammar in llguidance's dialect (tool calls)
    compiled: CompiledGrammar | None = field(default=None, repr=False, compare=False)

    def kind(self) -> str:
        set_ = [k for k in KINDS if k != "json_object" and getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise GrammarError("structured outputs need exactly one of json, json_object, regex, choice, grammar "
                               f"(got {', '.join(set_) or 'none'})")
        return set_[0]

    def grammar_spec(self) -> str:
        """The llguidance grammar (a JSON string) of this constraint."""
        import llguidance as llg

        k = self.kind()
        try:
            if k == "json":
                schema = {} if self.json is True else self.json
                if not isinstance(schema, dict):
                    raise GrammarError("json must be a JSON schema object")
                return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            if k == "json_object":
                return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if k == "regex":
                return llg.LLMatcher.grammar_from_regex(self.regex)
            if k == "choice":
                if not self.choice or not all(isinstance(c, str) for c in self.choice):
                    raise GrammarError("choice must be a non-empty list of strings")
                return llg.grammar_from("choice", json.dumps(self.choice))
            if k == "grammar":
                return llg.grammar_from("grammar", self.grammar)
            return llg.LLMatcher.grammar_from_lark(self.lark)
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid {k} constraint: {e}") from None


class _ByteVocab:
    """The byte tokenizer as llguidance sees it: ids 0..255 are bytes, every other id is a special token."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """An llguidance tokenizer for our tokenizers (byte or HF tokenizer.json)."""
    import llguidance as llg

    name = getattr(tokenizer, "name", "none")
    eos = sorted(eos_ids) or None
    if name == "byte":
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size)), n_vocab=vocab_size,
                               eos_token=eos)
    if name == "hf":
        return llg.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    raise GrammarError("structured outputs need a tokenizer (this server runs with --tokenizer none)")


class GrammarCompiler:
    """Compiles constraints for one tokenizer (thread-safe; compiled grammars are cached by their spec)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 256):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, set(eos_ids)
        self._ll = None
        self._table: budget.TokenTable | None = None
        self._lock = threading.Lock()
        self._cache: dict[str, CompiledGrammar] = {}
        self.cache_size = cache_size

    @property
    def ll(self):
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._ll

    @property
    def table(self) -> budget.TokenTable:
        """Token lengths and UTF-8 boundaries, for the closing-path search."""
        ll = self.ll
        with self._lock:
            if self._table is None:
                self._table = budget.TokenTable([ll.decode_bytes([t]) for t in range(self.vocab_size)],
                                                {t for t in range(self.vocab_size) if ll.is_special_token(t)})
            return self._table

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile (or fetch from the cache) and attach the result to `spec.compiled`. Raises GrammarError."""
        import llguidance as llg

        if spec.compiled is not None and spec.compiled.vocab_size == self.vocab_size:
            return spec.compiled
        g = spec.grammar_spec()
        with self._lock:
            hit = self._cache.get(g)
        if hit is None:
            m = llg.LLMatcher(self.ll, g, log_level=0)  # drops the GIL while it builds
            if m.is_error():
                raise GrammarError(f"invalid {spec.kind()} constraint: {m.get_error()}")
            eos = min(self.eos_ids) if self.eos_ids else None
            hit = CompiledGrammar(m, self.vocab_size, eos, self.table)
            if hit.min_path is None:
                raise GrammarError(f"the {spec.kind()} constraint has no completion that this server can find "
                                   f"(searched {budget.MAX_NODES} states)")
            with self._lock:
                if len(self._cache) >= self.cache_size:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[g] = hit
        spec.compiled = hit
        return hit


class CompiledGrammar:
    """A compiled grammar in its start state (never advanced; each request deep-copies it), with its shortest
    completion (`min_path`, `min_tokens`)."""

    def __init__(self, matcher, vocab_size: int, eos: int | None, table: budget.TokenTable):
        self._proto = matcher
        self.vocab_size, self.eos, self.table = vocab_size, eos, table
        self.min_path = budget.shortest_closing(matcher, vocab_size, eos, table)
        self.min_tokens = len(self.min_path) if self.min_path is not None else None
        self.zone = budget.MIN_ZONE + (self.min_tokens or 0)

    def check_budget(self, max_tokens: int):
        """GrammarError (HTTP 400) when no completion fits in `max_tokens` tokens."""
        if self.min_tokens is not None and max_tokens < self.min_tokens:
            raise GrammarError(f"max_tokens={max_tokens} is too small for this output constraint: its shortest "
                               f"valid completion is {self.min_tokens} tokens")

    def new_state(self, max_tokens: int | None = None) -> GrammarState:
        """A request's state; with `max_tokens`, budget-aware (GrammarError if no completion fits)."""
        m = self._proto.deep_copy()
        if max_tokens is None:
            return GrammarState(m)
        self.check_budget(max_tokens)
        return GrammarState(m, budget.Budget(m, max_tokens, self.min_path, self.vocab_size, self.eos, self.table,
                                             self.zone))


class GrammarState:
    """One request's position in its grammar (and, when budget-aware, its closing path)."""

    def __init__(self, matcher, budget_: budget.Budget | None = None):
        self.m = matcher
        self.budget = budget_
        self.error: str | None = None

    def fill(self, row: np.ndarray):
        """Write the allowed-token bitmask for the next token into `row` (a C-contiguous uint32 [W] view)."""
        if not row.flags["C_CONTIGUOUS"] or row.dtype != np.uint32:
            raise ValueError("the mask row must be a C-contiguous uint32 array")
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.budget is not None:
            self.budget.filter(row)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False (and `error` set) if the grammar rejects it."""
        if self.m.consume_token(int(token)):
            if self.budget is not None:
                self.budget.advance(int(token))
            return True
        self.error = self.m.get_error() or f"token {token} is not allowed by the grammar"
        return False

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but the end of the sequence."""
        return self.m.is_stopped()


def mask_tokens(row: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows (tests and debugging)."""
    bits = (row[:, None] >> np.arange(32, dtype=np.uint32)[None, :]) & 1
    return np.flatnonzero(bits.reshape(-1)[:vocab_size]).tolist()
