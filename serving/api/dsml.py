"""DeepSeek-V4.1 tool calls (DSML): render them into prompts, parse them out of model text (whole or streamed),
and build the grammar that forces them (`tool_choice` "required" or a named function).

The format (V4.1's chat encoding; tag names carry a leading space, unlike V4's):

    <content>\\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls><｜end▁of▁sentence｜>

String arguments are written raw with string="true"; every other JSON value is written as JSON with
string="false". `ToolCallStream` is the one parser: it turns text deltas into content deltas and OpenAI
`tool_calls` deltas the way vLLM streams them (the first delta of a call carries its index, id, type and name
with empty arguments; then argument fragments, one per parameter, that concatenate to the call's JSON
arguments). The non-streamed parse feeds the whole text through the same parser, so both agree exactly.
Text that could still be the start of the tool-call block is held back, like a stop string. Text after the
block is dropped (the model ends its turn there). Unknown or malformed markup inside the block is skipped; an
invoke without its closing tag (the output was cut off) yields no call.
"""

from __future__ import annotations

import json
import re
import uuid

DSML = "｜DSML｜"
CALLS_START = f"<{DSML} calls>"
CALLS_END = f"</{DSML} calls>"
BLOCK_START = "\n\n" + CALLS_START  # what separates the assistant's content from its tool calls
INVOKE_RE = re.compile(rf'<{DSML} invoke name="([^"]*)">\n?')
INVOKE_END = f"</{DSML} invoke>"
PARAM_RE = re.compile(rf'<{DSML} parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML} parameter>', re.DOTALL)
PARAM_PREFIX = f"<{DSML} parameter"

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class ToolSpecError(ValueError):
    """A tool definition or an assistant tool call in the history is malformed (HTTP 400)."""


# ---------------------------------------------------------------------------------------------- rendering
def render_arguments(arguments) -> str:
    """One assistant tool call's arguments (a JSON object, or its JSON text) as DSML parameter lines."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolSpecError(f"tool call arguments are not valid JSON: {e.msg}") from None
    if not isinstance(arguments, dict):
        raise ToolSpecError("tool call arguments must be a JSON object")
    lines = []
    for k, v in arguments.items():
        is_str = isinstance(v, str)
        value = v if is_str else json.dumps(v, ensure_ascii=False)
        flag = "true" if is_str else "false"
        lines.append(f'<{DSML} parameter name="{k}" string="{flag}">{value}</{DSML} parameter>')
    return "\n".join(lines)


def render_tool_calls(tool_calls: list[dict]) -> str:
    """OpenAI `tool_calls` of an assistant message -> the DSML block (with its leading blank line)."""
    invokes = []
    for tc in tool_calls:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolSpecError("each assistant tool call needs function.name")
        invokes.append(f'<{DSML} invoke name="{fn["name"]}">\n{render_arguments(fn.get("arguments", "{}"))}\n'
                       f"{INVOKE_END}")
    return f"\n\n{CALLS_START}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


# ---------------------------------------------------------------------------------------------- parsing
def _overlap(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-k:]):
            return k
    return 0


def _param_types(tools: list[dict] | None, name: str | None) -> dict:
    for t in tools or []:
        fn = t.get("function", {})
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return props if isinstance(props, dict) else {}
    return {}


def _value(raw: str, string: str, schema: dict):
    if string == "true":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # not JSON although marked string="false": keep the text (the client validates arguments)


class ToolCallStream:
    """Incremental DSML parser: feed(text delta) -> (content delta, [OpenAI tool_call deltas])."""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools
        self.buf = ""
        self.sent = 0  # characters of buf already consumed (content sent, or markup parsed)
        self.state = "content"  # content | calls | done
        self.calls: list[dict] = []  # complete calls: {"id", "name", "arguments" (JSON text)}
        self._open: dict | None = None  # the invoke being parsed: {"index", "id", "name", "n_params"}

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buf += delta
        content, deltas = "", []
        while True:
            if self.state == "content":
                k = self.buf.find(CALLS_START, self.sent)
                if k < 0:
                    hold = 0 if final else max(_overlap(self.buf, BLOCK_START), _overlap(self.buf, CALLS_START))
                    end = len(self.buf) - hold
                    if end > self.sent:
                        content += self.buf[self.sent:end]
                        self.sent = end
                    break
                end = k - 2 if self.buf[max(k - 2, self.sent):k] == "\n\n" and k - 2 >= self.sent else k
                content += self.buf[self.sent:end]
                self.sent = k + len(CALLS_START)
                self.state = "calls"
            elif self.state == "calls":
                if not self._step_calls(deltas):
                    break
            else:
                self.sent = len(self.buf)
                break
        return content, deltas

    def _step_calls(self, deltas: list[dict]) -> bool:
        """Parse one piece of markup inside the block; False when more text is needed."""
        rest = self.buf[self.sent:]
        if self._open is None:
            m = INVOKE_RE.search(rest)
            e = rest.find(CALLS_END)
            if e >= 0 and (m is None or e < m.start()):
                self.state = "done"
                self.sent += e + len(CALLS_END)
                return True
            if m is None or (m.end() == len(rest) and not rest.endswith("\n")):  # the newline may still come
                return False
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            self._open = {"index": len(self.calls), "id": call_id, "name": m.group(1), "n_params": 0, "args": ""}
            deltas.append({"index": self._open["index"], "id": call_id, "type": "function",
                           "function": {"name": m.group(1), "arguments": ""}})
            self.sent += m.end()
            return True
        o = self._open
        p = PARAM_RE.search(rest)
        e = rest.find(INVOKE_END)
        if p is not None and (e < 0 or p.start() < e):
            name, string, raw = p.groups()
            value = _value(raw, string, _param_types(self.tools, o["name"]).get(name, {}))
            frag = ("{" if o["n_params"] == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " + \
                json.dumps(value, ensure_ascii=False)
            o["n_params"] += 1
            self._args(deltas, frag)
            self.sent += p.end()
            return True
        if e >= 0:
            self._args(deltas, "}" if o["n_params"] else "{}")
            self.calls.append({"id": o["id"], "name": o["name"], "arguments": o["args"]})
            self._open = None
            self.sent += e + len(INVOKE_END)
            return True
        return False

    def _args(self, deltas: list[dict], frag: str):
        o = self._open
        o["args"] += frag
        deltas.append({"index": o["index"], "function": {"arguments": frag}})

    def finish(self) -> tuple[str, list[dict]]:
        """End of the output: release held-back content (an unfinished call is dropped)."""
        return self.feed("", final=True)


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas -> complete OpenAI tool calls (what a client accumulates)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            c["id"] = d["id"]
        fn = d.get("function") or {}
        c["function"]["name"] += fn.get("name") or ""
        c["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def parse(text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
    """A whole output -> (content or None, complete OpenAI tool calls); the same parser as streaming."""
    s = ToolCallStream(tools)
    c1, d1 = s.feed(text)
    c2, d2 = s.finish()
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in s.calls]
    content = c1 + c2
    return (content or None) if calls else content, calls


# ---------------------------------------------------------------------------------------------- grammar
def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _string_param(schema: dict) -> bool:
    """Written raw (string="true"): plain strings, string enums and consts; a string with a pattern or format
    is written as JSON (string="false") so its grammar is llguidance's JSON-schema string."""
    if isinstance(schema.get("enum"), list):
        return all(isinstance(v, str) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], str)
    if "pattern" in schema or "format" in schema:
        return False
    t = schema.get("type")
    return t == "string" or (t is None and not any(k in schema for k in ("properties", "items", "anyOf", "oneOf")))


def _value_rule(schema: dict) -> tuple[str, str]:
    """(string attribute, Lark expression of the value)."""
    if _string_param(schema):
        if isinstance(schema.get("enum"), list):
            return "true", "(" + " | ".join(_lit(v) for v in schema["enum"]) + ")"
        if "const" in schema:
            return "true", _lit(schema["const"])
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if isinstance(hi, int) or (isinstance(lo, int) and lo > 0):
            lo = lo if isinstance(lo, int) and lo >= 0 else 0
            return "true", f"/[^<]{{{lo},{hi if isinstance(hi, int) else ''}}}/"
        return "true", "/[^<]*/"  # raw text without "<" (a "<" would have to extend the text or start the tag)
    sub = dict(schema)
    sub["x-guidance"] = {"whitespace_flexible": False}
    return "false", "%json " + json.dumps(sub, ensure_ascii=False)


def check_tools(tools) -> list[dict]:
    """Validate OpenAI `tools` (function tools with DSML-safe names)."""
    if not isinstance(tools, list) or not tools:
        raise ToolSpecError("tools must be a non-empty list")
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolSpecError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            raise ToolSpecError(f"tools[{i}].function.name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
        if name in seen:
            raise ToolSpecError(f"tools[{i}]: duplicate function name {name!r}")
        seen.add(name)
        params = fn.get("parameters", {})
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ToolSpecError(f"tools[{i}].function.parameters must be a JSON schema object")
        props = params.get("properties", {}) or {}
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise ToolSpecError(f"tools[{i}].function.parameters.properties must map names to schemas")
        for k in props:
            if any(c in k for c in '"<>\n') or not k:
                raise ToolSpecError(f"tools[{i}]: parameter name {k!r} cannot be written in a tool call")
    return tools


def tool_call_grammar(tools: list[dict], only: str | None = None, parallel: bool = True) -> str:
    """Lark (llguidance dialect) for an output that is exactly one DSML block: calls of `only` (one call) or of
    any tool (one or more when `parallel`). Parameters come in schema order; required ones must appear, optional
    ones may; no whitespace between elements beyond the format's own newlines. Raw string values cannot contain
    "<": llguidance's lexer is greedy, so a "<" that could continue the text would never end it."""
    lines, alts = [], []
    for ti, t in enumerate(tools):
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        items = []
        for pi, (k, schema) in enumerate(props.items()):
            string, value = _value_rule(schema)
            rule = f"p{ti}_{pi}"
            head = _lit(f'<{DSML} parameter name="{k}" string="{string}">')
            lines.append(f"{rule}: {head} {value} {_lit(f'</{DSML} parameter>' + chr(10))}")
            items.append(rule if k in required else f"{rule}?")
        body = " ".join(items) if items else _lit("\n")
        lines.append(f"call{ti}: {_lit(f'<{DSML} invoke name=\"{fn['name']}\">' + chr(10))} {body} "
                     f"{_lit(INVOKE_END)}")
        alts.append(f"call{ti}")
    if not alts:
        raise ToolSpecError(f"tool_choice names {only!r}, which is not in tools")
    more = ' ("\\n" call)*' if parallel and only is None else ""
    head = [f"start: {_lit(BLOCK_START + chr(10))} call{more} {_lit(chr(10) + CALLS_END)}",
            "call: " + " | ".join(alts)]
    return "\n".join(head + lines) + "\n"
