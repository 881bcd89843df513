"""OpenAI-compatible request schemas (with vLLM's extensions) and their validation into engine inputs.

Everything a client sends is checked here, on the server side, before anything reaches the engine thread:
types (pydantic), ranges, prompt shape and token ids, context length, Unicode, tools and `tool_choice`,
structured-output constraints. A problem raises `ApiError` (HTTP status + a message that says what is wrong).
Unknown fields are accepted and logged, as vLLM does, so newer clients keep working. The gRPC server reuses
`build_sampling_params` and `check_prompt_ids`.

Structured outputs (one per request): `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"schema": ...}}), vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object"}) and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields;
`tool_choice` "required" or a named function adds the DSML tool-call grammar (so it excludes the others).
A constrained request whose max_tokens cannot hold the constraint's shortest completion is a 400 (`check_budget`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from serving.api import dsml
from serving.engine.structured import GrammarError, StructuredOutputs
from serving.engine.types import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("serving.api")

MAX_N = 16  # completions per prompt (n)
MAX_SUBREQUESTS = 256  # prompts x n in one HTTP request


class ApiError(Exception):
    """A client-visible error: HTTP status, OpenAI error type, message."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
             413: "RequestEntityTooLarge", 429: "RateLimitError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

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
    end_session: bool = False  # the session's last turn: its retention ends with this request
    cache_salt: str | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = 0
    add_special_tokens: bool = False
    max_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common):
    prompt: Any = None
    add_special_tokens: bool = True  # vLLM's default for completions (chat: False, the template adds BOS)
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
    if req.stream_options is not None and not req.stream:
        raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
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
    return out


# ---------------------------------------------------------------------------------------------- structured outputs
def _from_response_format(rf: dict) -> StructuredOutputs | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return StructuredOutputs(json=schema)
    raise bad(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")


def structured_outputs(req: _Common) -> StructuredOutputs | None:
    """The request's output constraint (at most one source), not yet compiled."""
    found = []
    if req.response_format is not None:
        so = _from_response_format(req.response_format)
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs is not None:
        d = {k: v for k, v in req.structured_outputs.items() if v not in (None, False)}
        unknown = set(d) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise bad(f"structured_outputs: unsupported field(s) {sorted(unknown)}", "structured_outputs")
        if isinstance(d.get("json"), str):
            try:
                d["json"] = json.loads(d["json"])
            except json.JSONDecodeError as e:
                raise bad(f"structured_outputs.json is not valid JSON: {e.msg}", "structured_outputs") from None
        found.append(("structured_outputs", StructuredOutputs(**d)))
    legacy = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    for field_, key in legacy.items():
        v = getattr(req, field_)
        if v is not None:
            if key == "json" and isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise bad(f"{field_} is not valid JSON: {e.msg}", field_) from None
            found.append((field_, StructuredOutputs(**{key: v})))
    if len(found) > 1:
        raise bad(f"only one output constraint per request (got {', '.join(n for n, _ in found)})")
    if not found:
        return None
    name, so = found[0]
    try:
        so.kind()
    except ValueError as e:
        raise bad(f"{name}: {e}", name) from None
    return so


def check_budget(so: StructuredOutputs | None, max_tokens: int, field: str = "max_tokens"):
    """400 when a compiled output constraint has no completion that fits in max_tokens (before any work)."""
    if so is not None and so.compiled is not None:
        try:
            so.compiled.check_budget(max_tokens)
        except GrammarError as e:
            raise bad(str(e), field) from None


def tool_choice(req: ChatCompletionRequest, auto_enabled: bool) -> tuple[str, str | None]:
    """vLLM's rules for tools / tool_choice -> (mode: none | auto | required | named, function name)."""
    tools, tc = req.tools, req.tool_choice
    if tools is not None:
        try:
            dsml.check_tools(tools)
        except dsml.ToolSpecError as e:
            raise bad(str(e), "tools") from None
    if tc is None:
        tc = "auto" if tools else "none"
    if tc not in ("none", "auto", "required") and not isinstance(tc, dict):
        raise bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': "
                  f"...}}}}, got {tc!r}", "tool_choice")
    if tc != "none" and not tools:
        raise bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tc == "auto" and not auto_enabled:
        raise bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                  "tool_choice")
    if isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str):
            raise bad("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return "named", name
    return tc, None
