"""Chat-formatted training documents built from corpus files, rendered exactly as the default model's chat
template (`corpus.CHAT_TEMPLATE`, through the server's Jinja environment: compact-key JSON, ensure_ascii off)
renders the same messages, without the leading <|bos|> and the final <|end|> (`corpus.encode_docs` adds both).

Kinds (each a seeded choice per training file, `chat_documents`):
- "continue": the user shows the start of a file and asks to continue it; the reply is the next lines.
- "function": "Write a function that <its docstring's first line>" (or "Write <name>(<args>)"); the reply is a
  top-level function of the file in a ```python block (parsed with `ast`, so it is real code).
- "tool_call": with file tools declared, the user asks to read / list / search; the reply is one DSML
  tool-call block (the format serving/api/dsml.py forces and parses: ``\\n\\n<｜DSML｜ calls>`` ...).
- "tool_answer": the same request, the call in the history (as the template renders an assistant `tool_calls`
  message), the tool's output as a <|tool|> turn, and a reply naming what the file defines.
"""

from __future__ import annotations

import ast
import json
import random

from training.corpus import SYSTEM_PROMPT

DSML = "｜DSML｜"
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a text file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "list_files", "description": "List the files of a directory.",
                                      "parameters": {"type": "object",
                                                     "properties": {"directory": {"type": "string"}},
                                                     "required": ["directory"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the repository for a regex.",
                                      "parameters": {"type": "object",
                                                     "properties": {"pattern": {"type": "string"},
                                                                    "max_results": {"type": "integer"}},
                                                     "required": ["pattern"]}}},
]


def dsml_block(name: str, args: dict) -> str:
    """One call as a DSML block (the layout of serving.api.dsml.render_tool_calls; tests check they agree)."""
    params = []
    for k, v in args.items():
        s = isinstance(v, str)
        params.append(f'<{DSML} parameter name="{k}" string="{"true" if s else "false"}">'
                      f'{v if s else json.dumps(v, ensure_ascii=False)}</{DSML} parameter>')
    return (f'\n\n<{DSML} calls>\n<{DSML} invoke name="{name}">\n' + "\n".join(params) +
            f"\n</{DSML} invoke>\n</{DSML} calls>")


def render(messages: list[dict], tools: list | None = None) -> str:
    """CHAT_TEMPLATE's text for `messages` (no BOS; the last message's <|end|> dropped)."""
    out = f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}<|end|>\n" if tools else ""
    for m in messages:
        out += f"<|{m['role']}|>\n{m.get('content') or ''}"
        if m.get("tool_calls"):
            out += json.dumps(m["tool_calls"], ensure_ascii=False)
        out += "<|end|>\n"
    return out[: -len("<|end|>\n")]


def _functions(text: str) -> list[tuple[str, str, str]]:
    """(name, signature args, docstring first line, source) of top-level functions with a docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.end_lineno and node.end_lineno - node.lineno < 60:
            doc = ast.get_docstring(node)
            src = "".join(lines[node.lineno - 1 - len(node.decorator_list): node.end_lineno])
            if doc and src.startswith(("def ", "@")):
                out.append((node.name, ast.unparse(node.args), doc.strip().splitlines()[0], src))
    return out


def _names(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))][:12]


def _sys(rng):
    return {"role": "system", "content": SYSTEM_PROMPT}


def _continue(rng, f):
    lines = f["text"].splitlines(keepends=True)
    if len(lines) < 8:
        return None
    cut = rng.randrange(3, len(lines) - 2)
    ask = rng.choice(["Continue this Python code:", "Complete the following file.", "What comes next?"])
    user = f"{ask}\n```python\n{''.join(lines[:cut])[-3000:]}```"
    return render([_sys(rng), {"role": "user", "content": user},
                   {"role": "assistant", "content": "".join(lines[cut:])[:2000]}])


def _function(rng, f):
    fns = _functions(f["text"])
    if not fns:
        return None
    name, args, doc, src = rng.choice(fns)
    doc = doc.rstrip(".")
    if rng.random() < 0.6 and doc:
        user = f"Write a function that {doc[0].lower() + doc[1:]}."
    else:
        user = f"Write a Python function `{name}({args})`: {doc}."
    return render([_sys(rng), {"role": "user", "content": user},
                   {"role": "assistant", "content": f"```python\n{src.rstrip()}\n```"}])


def _request(rng, f):
    rel = f["rel"]
    d = rel.rsplit("/", 1)[0] if "/" in rel else "."
    names = _names(f["text"])
    r = rng.random()
    if r < 0.6:
        ask = rng.choice(["Read the file {p}.", "Show me {p}.", "Open {p} and tell me what it defines.",
                          "What is in {p}?"]).format(p=rel)
        return ask, "read_file", {"path": rel}
    if r < 0.8 or not names:
        return rng.choice(["List the files in {d}.", "Which files are in {d}?"]).format(d=d), "list_files", \
            {"directory": d}
    n = rng.choice(names)
    args = {"pattern": f"def {n}" if rng.random() < 0.5 else n}
    if rng.random() < 0.5:
        args["max_results"] = rng.choice([5, 10, 20])
    return f"Where is {n} defined?", "search", args


def _tool_call(rng, f):
    ask, name, args = _request(rng, f)
    return render([_sys(rng), {"role": "user", "content": ask},
                   {"role": "assistant", "content": dsml_block(name, args)}], TOOLS)


def _tool_answer(rng, f):
    ask, name, args = _request(rng, f)
    if name != "read_file":
        return None
    names = _names(f["text"])
    if not names:
        return None
    call = [{"id": f"call_{rng.randrange(10**8):08d}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}]
    answer = f"`{f['rel']}` defines " + ", ".join(f"`{n}`" for n in names) + "."
    return render([_sys(rng), {"role": "user", "content": ask},
                   {"role": "assistant", "content": "", "tool_calls": call},
                   {"role": "tool", "content": f["text"][:1500]}, {"role": "assistant", "content": answer}], TOOLS)


def chat_documents(files: list[dict], fraction: float, tool_fraction: float, seed: int) -> list[tuple[str, str]]:
    """[(text, kind)] from a seeded subset of files ({'rel', 'text'} dicts): each file is shown as a
    continue / function chat with probability `fraction` and behind a tool chat with `tool_fraction`."""
    rng = random.Random(seed)
    out = []
    for f in files:
        if rng.random() < fraction:
            kind = rng.choice(["continue", "function", "function"])
            t = (_continue if kind == "continue" else _function)(rng, f)
            if t:
                out.append((t, kind))
        if rng.random() < tool_fraction:
            kind = "tool_call" if rng.random() < 0.7 else "tool_answer"
            t = (_tool_call if kind == "tool_call" else _tool_answer)(rng, f)
            if t:
                out.append((t, kind))
    return out
