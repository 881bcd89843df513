"""Chat templates: turn OpenAI chat messages into prompt token ids.

Which template: `--chat-template` (a file or a literal Jinja string) if given, else the tokenizer's own
(`chat_template` of an HF tokenizer's tokenizer_config.json), else a small built-in template for tokenizers
without one (the byte tokenizer):

    <bos><|system|>\\n...<|end|>\\n<|user|>\\n...<|end|>\\n<|assistant|>\\n

The built-in rendering is append-only (turn k's prompt is a prefix of turn k+1's when the assistant reply is
sent back verbatim), so multi-turn conversations hit the prefix cache. Templates run in Jinja's sandbox with
the helpers HF templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps Unicode).
"""

from __future__ import annotations

import json
import os
from datetime import datetime

BUILTIN_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


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
        if override:
            source = open(override).read() if os.path.isfile(override) else override
            self.origin = f"--chat-template {override if os.path.isfile(override) else '(inline)'}"
        elif _pick(getattr(tokenizer, "chat_template", None)):
            source = _pick(tokenizer.chat_template)
            self.origin = "tokenizer"
        else:
            source = BUILTIN_TEMPLATE
            self.origin = "built-in"
        self.builtin = source is BUILTIN_TEMPLATE
        self.available = getattr(tokenizer, "name", "") != "none"
        self.template = _environment().from_string(source)  # a syntax error fails at start-up

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

        ctx = dict(kwargs or {})
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
