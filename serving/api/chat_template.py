"""Chat templates: turn OpenAI chat messages (with tools) into prompt token ids.

Which template: `--chat-template` (a file, a literal Jinja string, or `dsv41`) if given, else the tokenizer's own
(`chat_template` of an HF tokenizer's tokenizer_config.json), else the built-in DeepSeek-V4.1 encoding
(`render_dsv41`, the model's own format, written here from its specification):

    <bos><｜System｜>{system}[\n\n## Tools ... (tool schemas, DSML call syntax)]
    <｜User｜>{user}<｜Assistant｜></think>{reply}[\n\n<｜DSML｜ calls>...</｜DSML｜ calls>]<｜end▁of▁sentence｜>
    <｜User｜><tool_result>{tool output}</tool_result><｜Assistant｜></think>

`tool` messages become `<tool_result>` blocks of a user turn (in the order of the calls they answer); assistant
`tool_calls` are rendered as DSML (serving/api/dsml.py); `chat_template_kwargs={"thinking": true}` selects
thinking mode (`<think>` opens the reply; earlier turns' reasoning is dropped unless tools are present). In
chat mode the rendering is append-only (turn k's prompt is a prefix of turn k+1's when the reply is sent back
verbatim), so multi-turn conversations hit the prefix cache. Jinja templates run in a sandbox with the helpers
HF templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps Unicode).
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from serving.api import dsml

EOS_TEXT = "<｜end▁of▁sentence｜>"
USER, ASSISTANT, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
THINK, END_THINK = "<think>", "</think>"

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{d}{calls}>" block like the following:

<{d}{calls}>
<{d}{invoke} name="$TOOL_NAME">
<{d}{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}{param}>
...
</{d}{invoke}>
<{d}{invoke} name="$TOOL_NAME2">
...
</{d}{invoke}>
</{d}{calls}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside \
{think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def render_tools(tools: list[dict]) -> str:
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return TOOLS_TEMPLATE.format(d=dsml.DSML, calls=" calls", invoke=" invoke", param=" parameter", think=THINK,
                                 end_think=END_THINK, schemas=schemas)


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """`tool` messages -> <tool_result> blocks of a user turn, ordered like the calls they answer."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            order = {tc.get("id"): i for i, tc in enumerate(m["tool_calls"]) if isinstance(tc, dict) and tc.get("id")}
        if role in ("tool", "function"):
            block = {"id": m.get("tool_call_id") or "", "text": f"<tool_result>{m.get('content') or ''}</tool_result>"}
            if out and out[-1]["role"] == "user" and "blocks" in out[-1]:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block], "order": order})
        elif role == "user" and out and out[-1]["role"] == "user" and "blocks" in out[-1]:
            out[-1]["blocks"].append({"id": None, "text": m.get("content") or ""})
        else:
            out.append(dict(m))
    for m in out:
        if "blocks" in m:
            rank = m.pop("order")
            results = sorted((b for b in m["blocks"] if b["id"] is not None), key=lambda b: rank.get(b["id"], 0))
            it = iter(results)
            m["content"] = "\n\n".join(next(it)["text"] if b["id"] is not None else b["text"] for b in m["blocks"])
            del m["blocks"]
    return out


EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}


def _effort(value) -> str:
    """Thinking mode's reasoning-effort line (an int in [1, 100] or low | high | xhigh | max; default high)."""
    value = "high" if value is None else value
    if isinstance(value, str) and value in EFFORTS:
        value = EFFORTS[value]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise TemplateError(f"reasoning_effort must be an integer in [1, 100] or one of {sorted(EFFORTS)}, "
                            f"got {value!r}")
    return f"Reasoning Effort: {value} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def render_dsv41(messages: list[dict], *, tools: list[dict] | None = None, thinking: bool = False,
                 reasoning_effort=None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> str:
    """DeepSeek-V4.1's prompt for these messages (without the BOS token: the caller adds its id)."""
    msgs = _merge_tool_results(messages)
    if tools:  # the tool schemas go into the (first) system message
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = dict(msgs[0], tools=tools)
        else:
            msgs.insert(0, {"role": "system", "content": "", "tools": tools})
    drop_thinking = not tools
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")
                     or (m["role"] == "system" and i > 0)), default=-1)
    out = []
    for i, m in enumerate(msgs):
        role, content = m["role"], m.get("content") or ""
        text = SYSTEM + _effort(reasoning_effort) if i == 0 and thinking else ""
        if role == "system":
            text = (text or SYSTEM) + content
            if m.get("tools"):
                text += "\n\n" + render_tools(m["tools"])
        elif role in ("user", "developer"):
            text += USER + content
        elif role == "assistant":
            reasoning = ""
            if thinking and (not drop_thinking or i > last_user):
                reasoning = (m.get("reasoning_content") or "") + END_THINK
            calls = dsml.render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
            last = i == len(msgs) - 1
            text += reasoning + content + calls + ("" if continue_final_message and last else EOS_TEXT)
        else:
            raise TemplateError(f"the DeepSeek-V4.1 format has no role {role!r}")
        nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        opens_reply = role in ("user", "developer") or (role == "system" and i > 0)
        if opens_reply and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            think = thinking and (not drop_thinking or i >= last_user)
            text += ASSISTANT + (THINK if think else END_THINK)
        out.append(text)
    return "".join(out)


class TemplateError(ValueError):
    """Rendering failed for this conversation (HTTP 400)."""


def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _pick(template):
    """tokenizer_config.json may hold a list of named templates: take 'default'."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template


class ChatTemplate:
    def __init__(self, tokenizer, override: str | None = None):
        self.tokenizer = tokenizer
        source = None
        if override and override != "dsv41":
            source = open(override).read() if os.path.isfile(override) else override
            self.origin = f"--chat-template {override if os.path.isfile(override) else '(inline)'}"
        elif not override and _pick(getattr(tokenizer, "chat_template", None)):
            source = _pick(tokenizer.chat_template)
            self.origin = "tokenizer"
        else:
            self.origin = "dsv41"
        self.builtin = source is None  # the DeepSeek-V4.1 encoding
        self.available = getattr(tokenizer, "name", "") != "none"
        self.template = None if source is None else _environment().from_string(source)  # syntax errors: start-up

    def _special(self, attr: str) -> str:
        tid = getattr(self.tokenizer, attr, None)
        if tid is None:
            return ""
        if hasattr(self.tokenizer, "tok"):  # HF tokenizer: its own spelling of the special token
            return self.tokenizer.tok.id_to_token(tid) or ""
        return ""

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list | None = None, kwargs: dict | None = None) -> str:
        from jinja2 import TemplateError as JinjaError

        kwargs = dict(kwargs or {})
        if self.template is None:
            try:
                return render_dsv41(messages, tools=tools, thinking=bool(kwargs.get("thinking")),
                                    reasoning_effort=kwargs.get("reasoning_effort"),
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message)
            except dsml.ToolSpecError as e:
                raise TemplateError(str(e)) from None
        ctx = kwargs
        ctx.update(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                   bos_token=self._special("bos_token_id"), eos_token=self._special("eos_token_id"))
        try:
            text = self.template.render(**ctx)
        except TemplateError:
            raise
        except (JinjaError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        if continue_final_message:  # cut after the final message's content (drop its end-of-turn markup)
            last = messages[-1]["content"]
            k = text.rfind(last) if last else -1
            if k >= 0:
                text = text[:k + len(last)]
        return text

    def encode(self, messages: list[dict], **kw) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids)."""
        if not self.available:
            raise TemplateError("chat completions need a tokenizer (this server runs with --tokenizer none): "
                                "use /v1/completions with token ids")
        text = self.render(messages, **kw)
        ids = self.tokenizer.encode(text)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if self.builtin and bos is not None:
            ids = [bos] + ids
        return text, ids
