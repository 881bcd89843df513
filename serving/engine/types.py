"""Request-level types shared by the engine, the offline API and the servers."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.structured import StructuredOutputs

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """vLLM-compatible sampling parameters (temperature 0 = greedy)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (echo); disables prefix-cache reads
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None  # grammar-constrained decoding (serving/engine/structured.py)

    def validate(self, vocab_size: int):
        """Raise ValueError naming the bad field."""
        def bad(msg):
            raise ValueError(msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            bad(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k > vocab_size:
            bad(f"top_k must be -1 (off) or in [1, {vocab_size}], got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0 or self.seed >= 2 ** 63):
            bad(f"seed must be a non-negative 64-bit integer, got {self.seed!r}")
        for n, v in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(f"{n} must be in [0, {MAX_LOGPROBS}], got {v!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids):
            bad(f"stop_token_ids must be token ids in [0, {vocab_size})")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                bad("structured must be a StructuredOutputs")
            self.structured.kind()  # exactly one constraint (GrammarError is a ValueError)


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob} (sampled + top-n)
    finish_reason: str | None  # stop | length | abort


@dataclass
class RequestOutput:
    """One streaming update (or the final result) of a request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that finished the request (vLLM's)
    spec_decoding: dict | None = None  # final output with speculative decoding: SpecStats.report(detailed=True)
