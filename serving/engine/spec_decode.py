"""Speculative decoding: `--speculative-config` (vLLM's JSON), the proposers, and per-request acceptance figures.

A proposer drafts up to k tokens that continue a running request; the engine then scores the request's last
sampled token and the drafts in one fixed-shape `verify[B]` program (serving/engine/runner.py) that keeps the
accepted prefix plus one token sampled by the target (serving/engine/spec_verify.py), and rolls back everything
the rejected rows wrote (docs/SERVING.md, "Speculative decoding").

Config (vLLM spellings; unknown keys are refused, naming them):
  {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": M, "prompt_lookup_min": m}
      prompt lookup (vLLM's n-gram proposer): the longest suffix of the request's tokens of length m..M that
      occurred earlier, earliest occurrence first; its next k tokens are the draft. Neither bound given: both 5;
      one given: the other equals it.
  {"method": "dspark", "num_speculative_tokens": k}
      V4.1's own draft (the checkpoint's `mtp.*` stages), k in 1..dspark_block_size (5).
  "rejection_sample_method": "standard" only; "draft_sample_method": "greedy" (drafts as one-hot; the ngram and
  test proposers) or "probabilistic" (the draft's probabilities kept for the ratio test: dspark).

Proposers (`Proposer`): `propose(req, k) -> list[int]` runs on the host between steps, from the request's tokens
(prompt + accepted output), and returns at most k tokens (fewer or none is fine: that request then verifies
fewer rows, none = a plain decode row). The ngram proposer's drafts are one-hot; DSpark drafts on the device
inside the programs (serving/engine/spec_draft.py) and its proposer hands over what the last step drafted.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

MAX_SPEC_TOKENS = 5  # V4.1's dspark_block_size: the verify program scores 1 + k <= 6 rows
METHODS = ("ngram", "dspark")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "rejection_sample_method",
         "draft_sample_method", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    draft_sample_method: str = "greedy"

    @staticmethod
    def parse(spec) -> SpeculativeConfig | None:
        """From the flag's JSON text (or a dict); None / "" / "none" / {} = off. Raises ValueError naming the
        problem."""
        if spec is None or spec == "" or spec == {} or (isinstance(spec, str) and spec.strip().lower() == "none"):
            return None
        if isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e.msg}") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unsupported keys {unknown} (supported: {sorted(_KEYS)})")
        method = spec.get("method")
        if method is None and spec.get("model") in ("ngram", "[ngram]"):
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, got {method!r}")
        if spec.get("model") not in (None, "ngram", "[ngram]") and method == "ngram":
            raise ValueError("--speculative-config: a separate draft model is not supported (methods: "
                             f"{list(METHODS)})")
        k = spec.get("num_speculative_tokens", MAX_SPEC_TOKENS if method == "dspark" else None)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in [1, "
                             f"{MAX_SPEC_TOKENS}], got {k!r}")
        rs = spec.get("rejection_sample_method", "standard")
        if rs != "standard":
            raise ValueError(f"--speculative-config: rejection_sample_method {rs!r} is not supported (standard only)")
        ds = spec.get("draft_sample_method", "greedy" if method == "ngram" else "probabilistic")
        if ds not in ("greedy", "probabilistic"):
            raise ValueError(f"--speculative-config: draft_sample_method must be greedy or probabilistic, got {ds!r}")
        if method == "ngram" and ds != "greedy":
            raise ValueError("--speculative-config: the ngram proposer has no probabilities (draft_sample_method "
                             "greedy)")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if method == "ngram":
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {v!r}")
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise ValueError(f"--speculative-config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        elif lo is not None or hi is not None:
            raise ValueError("--speculative-config: prompt_lookup_min / prompt_lookup_max apply to method ngram only")
        return SpeculativeConfig(method, k, hi or 0, lo or 0, ds)

    def describe(self) -> str:
        extra = f", n-grams {self.prompt_lookup_min}..{self.prompt_lookup_max}" if self.method == "ngram" else ""
        return f"{self.method}, k={self.num_speculative_tokens}{extra}"


class Proposer(ABC):
    """Drafts for running requests (host side). Subclasses implement `propose`."""
    method = "base"
    probabilistic = False  # drafts are one-hot (greedy draft sampling)

    @abstractmethod
    def propose(self, req, k: int) -> list[int]:
        """Up to k draft tokens continuing req's sequence."""


class NgramProposer(Proposer):
    """Prompt lookup: the draft is what followed the longest earlier occurrence (length lo..hi) of the sequence's
    suffix, the earliest such occurrence; at most k tokens, fewer when the sequence ends first."""
    method = "ngram"

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def propose(self, req, k: int) -> list[int]:
        return ngram_draft(req.tokens, k, self.lo, self.hi)


def ngram_draft(tokens, k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup over `tokens` (NgramProposer)."""
    t = np.asarray(tokens, np.int64)
    N = len(t)
    if k <= 0 or N < lo + 1:
        return []
    for n in range(min(hi, N - 1), lo - 1, -1):
        # windows of the sequence without its last token: an occurrence that ends before the end
        win = np.lib.stride_tricks.sliding_window_view(t[:N - 1], n)
        hit = np.flatnonzero((win == t[N - n:]).all(axis=1))
        if len(hit):
            s = int(hit[0]) + n
            return t[s:s + k].tolist()
    return []


class DeviceDraftProposer(Proposer):
    """The drafts a device draft (DSpark, serving/engine/spec_draft.py) produced in the request's last step."""
    method = "dspark"

    def propose(self, req, k: int) -> list[int]:
        return req.drafts[:k]


def make_proposer(spec: SpeculativeConfig | None) -> Proposer | None:
    """The proposer of a config (None: off)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return DeviceDraftProposer()


@dataclass
class SpecStats:
    """One request's verification figures (vLLM's per-request `metrics.speculative_decoding`)."""
    k: int
    steps: int = 0  # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # [j]: steps that accepted exactly j drafts
    per_step: list[int] = field(default_factory=list)  # accepted drafts of each step (detailed)

    def observe(self, n_draft: int, n_accepted: int):
        if not self.histogram:
            self.histogram = [0] * (self.k + 1)
        self.steps += 1
        self.draft_tokens += n_draft
        self.accepted += n_accepted
        self.histogram[n_accepted] += 1
        self.per_step.append(n_accepted)

    def report(self, detailed: bool = False) -> dict:
        out = {"mean_acceptance_length": 1 + self.accepted / self.steps if self.steps else 1.0,
               "draft_acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else 0.0,
               "acceptance_histogram": self.histogram or [0] * (self.k + 1), "num_spec_steps": self.steps,
               "num_accepted_draft_tokens": self.accepted, "num_draft_tokens": self.draft_tokens,
               "num_spec_tokens": self.k}
        if detailed:
            out["per_step_accepted"] = list(self.per_step)
        return out
