"""OpenAI response bodies: choices accumulated from RequestOutputs, logprobs in both OpenAI formats, usage.

- legacy completions logprobs: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
- chat logprobs: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
- vLLM's prompt_logprobs: [None, {"<id>": {logprob, rank, decoded_token}}, ...]
- `return_tokens_as_token_ids` (vLLM) renders tokens as "token_id:<id>" so clients recover exact ids.
- vLLM's per-request speculative-decoding figures (--per-request-spec-decode-metrics): a top-level
  `metrics: {speculative_decoding: {...}}` on responses with one choice (vLLM leaves them out for n > 1), in the
  final usage chunk when streaming.
Logprobs of -inf / NaN are clamped to -9999.0 (vLLM does the same) so the JSON stays valid.
"""

from __future__ import annotations

import math
import time

from serving.engine.types import RequestOutput

FLOOR = -9999.0


def clamp(lp: float) -> float:
    return FLOOR if (math.isnan(lp) or lp < FLOOR) else float(lp)


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class TokenText:
    """How token ids are spelled in logprobs (cached per id)."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tok = tokenizer
        self.as_ids = as_ids or getattr(tokenizer, "name", "") == "none"
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        s = self._cache.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if getattr(self.tok, "name", "") == "hf" else ""
            if not s:
                s = self.tok.token_str(tid)
            self._cache[tid] = s
        return s

    def bytes(self, tid: int) -> list[int]:
        if getattr(self.tok, "name", "") == "byte" and 0 <= tid < 256:
            return [tid]
        return list(self(tid).encode("utf-8"))


def _ranked(d: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -clamp(kv[1]))


def legacy_logprobs(spell: TokenText, ids: list[int], lps: list, offset0: int = 0) -> dict:
    """Completions logprobs for tokens `ids` with their {id: logprob} dicts (None: no context, the first
    prompt token)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for tid, d in zip(ids, lps):
        s = spell(tid)
        out["tokens"].append(s)
        out["text_offset"].append(off)
        off += len(s)
        if d is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(clamp(d.get(tid, FLOOR)))
            out["top_logprobs"].append({spell(k): clamp(v) for k, v in _ranked(d)})
    return out


def merge_legacy(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(spell: TokenText, ids: list[int], lps: list, n_top: int) -> dict:
    content = []
    for tid, d in zip(ids, lps):
        top = [{"token": spell(k), "logprob": clamp(v), "bytes": spell.bytes(k)} for k, v in _ranked(d)[:n_top]]
        content.append({"token": spell(tid), "logprob": clamp(d.get(tid, FLOOR)), "bytes": spell.bytes(tid),
                        "top_logprobs": top})
    return {"content": content}


def vllm_prompt_logprobs(spell: TokenText, ids: list[int], plps: list | None, n_top: int) -> list | None:
    """rank: 1-based position in the distribution; None for the actual token when it is outside the top-n
    (the engine reports the top-n plus the actual token, so a lower rank is not known)."""
    if plps is None:
        return None
    out = []
    for d in plps:
        if d is None:
            out.append(None)
            continue
        pos = {k: i + 1 for i, (k, _) in enumerate(_ranked(d))}
        out.append({str(k): {"logprob": clamp(v), "rank": pos[k] if pos[k] <= max(n_top, 1) else None,
                             "decoded_token": spell(k)} for k, v in d.items()})
    return out


class Choice:
    """One completion (one engine request) accumulated from its streaming outputs."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], prompt_text: str | None = None):
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the matched stop string or stop token id
        self.num_prompt = len(prompt_ids)
        self.num_cached = 0
        self.num_output = 0
        self.finished = False
        self.spec_decoding: dict | None = None  # the engine's SpecStats report (speculative decoding)

    def update(self, out: RequestOutput):
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        if out.new_logprobs:
            self.logprobs += out.new_logprobs
        self.num_prompt = out.num_prompt_tokens
        self.num_cached = out.num_cached_tokens
        self.num_output = out.num_output_tokens
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs
            self.spec_decoding = out.spec_decoding


def total_usage(choices: list[Choice], n: int) -> dict:
    """Prompt and cached tokens counted once per prompt (the first of its n samples)."""
    firsts = [c for c in choices if c.index % n == 0]
    return usage(sum(c.num_prompt for c in firsts), sum(c.num_output for c in choices),
                 sum(c.num_cached for c in firsts))


SPEC_METRICS_LEVELS = ("none", "summary", "detailed")


def spec_report(report: dict | None, level: str) -> dict | None:
    """A request's speculative-decoding figures at --per-request-spec-decode-metrics `level` (None: off)."""
    if report is None or level == "none":
        return None
    return report if level == "detailed" else {k: v for k, v in report.items() if k != "per_step_accepted"}


def response_metrics(choices: list[Choice], level: str) -> dict | None:
    """vLLM's top-level `metrics` of a response (None: nothing to report)."""
    if len(choices) != 1:
        return None
    rep = spec_report(choices[0].spec_decoding, level)
    return None if rep is None else {"speculative_decoding": rep}


def now() -> int:
    return int(time.time())
