"""OpenAI-compatible request schemas (with vLLM's extensions) and their validation into engine inputs.

Everything a client sends is checked here, on the server side, before anything reaches the engine thread:
types (pydantic), ranges, prompt shape and token ids, context length, Unicode. A problem raises `ApiError`
(HTTP status + a message that says what is wrong). Unknown fields are accepted and logged, as vLLM does, so
newer clients keep working. The gRPC server reuses `build_sampling_params` and `check_prompt_ids`.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from serving.engine.types import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("serving.api")

MAX_N = 16  # completions per prompt (n)
MAX_SUBREQUESTS = 256  # prompts x n in one HTTP request


class ApiError(Exception):
    """A client-visible error: HTTP status, OpenAI error type, message."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLarge", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        return self.TYPES.get(self.status, "Error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# ---------------------------------------------------------------------------------------------- schemas
class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Model):
    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = 0
    add_special_tokens: bool | None = None
    max_tokens: int | None = None


class CompletionRequest(_Common):
    prompt: Any = None
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


# ---------------------------------------------------------------------------------------------- parsing
def _format_errors(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "body"
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        parts.append(f"{loc}: {err.get('msg')} (got {got})")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def check_unicode(obj, path: str = "body"):
    """Reject strings that cannot be encoded as UTF-8 (JSON escapes can smuggle in lone surrogates)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(f"{path} contains invalid Unicode (an unpaired surrogate at character {e.start})",
                      path) from None
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_unicode(k, path)
            check_unicode(v, f"{path}.{k}" if path != "body" else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_unicode(v, f"{path}[{i}]")


def parse(schema: type[_Common], obj) -> _Common:
    if not isinstance(obj, dict):
        raise bad("the request body must be a JSON object")
    try:
        check_unicode(obj)
        req = schema.model_validate(obj)
    except ValidationError as e:
        raise bad(f"invalid request: {_format_errors(e)}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if req.model_extra:
        log.warning("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
    return req


# ---------------------------------------------------------------------------------------------- checks
def check_prompt_ids(ids: list[int], vocab_size: int, what: str = "prompt"):
    if not ids:
        raise bad(f"the {what} is empty", "prompt")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad(f"{what} token id {t!r} is not in the vocabulary [0, {vocab_size})", "prompt")


def check_length(n_prompt: int, max_tokens: int, max_model_len: int):
    if n_prompt + max(max_tokens, 1) > max_model_len:
        raise bad(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                  f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                  "Please reduce the length of the prompt or the completion.", "max_tokens")


def resolve_max_tokens(value: int | None, n_prompt: int, max_model_len: int, field: str = "max_tokens") -> int:
    """None: whatever the context allows (vLLM's behaviour)."""
    if value is None:
        value = max_model_len - n_prompt
        if value < 1:
            check_length(n_prompt, 1, max_model_len)
        return value
    if value < 0:
        raise bad(f"{field} must be at least 0, got {value}", field)
    check_length(n_prompt, value, max_model_len)
    return value


def completion_prompts(prompt) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of token-id lists -> a list of prompts."""
    if prompt is None:
        raise bad("prompt is required", "prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        for p in prompt:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise bad("prompt: a list of token-id lists must contain only integers", "prompt")
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad("the prompt is empty", "prompt")
    else:
        raise bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
                  "prompt")
    for p in prompts:
        if not p:
            raise bad("the prompt is empty", "prompt")
    return prompts


def build_sampling_params(req: _Common, *, max_tokens: int, vocab_size: int, has_tokenizer: bool,
                          logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Translate (and range-check) the OpenAI / vLLM sampling fields."""
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        v = getattr(req, name)
        if v is not None and v != neutral:
            raise bad(f"{name} is not supported by this server (only {neutral})", name)
    if req.logit_bias:
        raise bad("logit_bias is not supported by this server", "logit_bias")
    if req.min_tokens:
        raise bad("min_tokens is not supported by this server (only 0)", "min_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise bad("best_of other than n is not supported", "best_of")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stop and not has_tokenizer:
        raise bad("stop strings need a tokenizer (this server runs with --tokenizer none): use stop_token_ids",
                  "stop")
    top_k = -1 if req.top_k in (None, 0) else req.top_k
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k,
        top_p=1.0 if req.top_p is None else req.top_p,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    try:
        sp.validate(vocab_size)
    except ValueError as e:
        raise bad(str(e)) from None
    return sp


def check_n(req: _Common, n_prompts: int = 1):
    if not 1 <= req.n <= MAX_N:
        raise bad(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if n_prompts * req.n > MAX_SUBREQUESTS:
        raise bad(f"too many completions in one request ({n_prompts} prompts x n={req.n} > {MAX_SUBREQUESTS})")


def check_logprobs(value: int | None, field: str):
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad(f"{field} must be in [0, {MAX_LOGPROBS}], got {value}", field)


def check_ids(req: _Common):
    for name in ("session_id", "cache_salt", "request_id"):
        v = getattr(req, name)
        if v is not None and (not v or len(v) > 512):
            raise bad(f"{name} must be a non-empty string of at most 512 characters", name)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Validated messages as plain dicts for the chat template (text content parts are joined)."""
    if not req.messages:
        raise bad("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {sorted(ROLES)}, got {m.role!r}", "messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                              f"supported, got type {kind!r}", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        d = {"role": m.role, "content": content if content is not None else ""}
        for k in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, k) is not None:
                d[k] = getattr(m, k)
        for k, v in (m.model_extra or {}).items():  # e.g. reasoning_content: templates may use it
            d.setdefault(k, v)
        out.append(d)
    if req.add_generation_prompt and req.continue_final_message:
        raise bad("add_generation_prompt and continue_final_message cannot both be true")
    if req.continue_final_message and out[-1]["role"] != "assistant":
        raise bad("continue_final_message needs a final assistant message")
    rf = req.response_format
    if rf is not None and rf.get("type") not in (None, "text"):
        raise bad(f"response_format {rf.get('type')!r} is not supported (only 'text')", "response_format")
    return out
