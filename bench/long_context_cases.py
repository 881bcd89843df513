"""Cases for the long-context probe: a call to a name whose only earlier mention is its definition, 4-7K tokens back.

Pure Python plus a tokenizer's offsets (no JAX): `bench.long_context_probe` measures the model on these cases.

A case (one per definition at most) is built from one held-out source file of the default model's split:

- definitions come from `ast` (functions, async functions, classes, at any depth, so methods too); the
  definition's block is its lines from the first decorator to `end_lineno`;
- occurrences of a name are its whole-word matches anywhere in the text (code, strings, comments);
- the call is the first occurrence after the block that is followed by `(` (spaces allowed), and every
  earlier occurrence of the name in the file lies inside the block (so in the context the name is seen only in
  its definition: a model that completes it must have read those lines);
- distances are in tokens of the file's own tokenization: every occurrence before the call is between
  `min_dist` and `max_dist` tokens before the call's first name token;
- the target is the file's tokens from the one holding the name's first character to the one holding its
  last (at most `max_target` tokens; a token may carry a neighbouring `.`, space or `(`): the model is asked
  to produce exactly those tokens after the prompt that ends right before them.

Token positions are those of the held-out stream (`training.corpus.encode_docs`: <|bos|> + tokens + <|end|> per
file, files concatenated in split order), so a fixed-length context window may reach into earlier files; the
caller checks that the name does not occur there (`name_in`).
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    file: str  # the file's relative path
    name: str
    kind: str  # "function" | "class" (methods are functions)
    cut: int  # stream position of the first target token (the prompt is stream[:cut])
    n_target: int  # target tokens stream[cut:cut + n_target]
    block: tuple[int, int]  # stream positions [a, b) of the definition's tokens (decorators to its last line)
    distance: int  # tokens from the definition's name to the call's (cut - position of the def's name token)
    nearest: int  # tokens from the last earlier occurrence of the name to the call
    target_text: str


def word_re(name: str) -> re.Pattern:
    return re.compile(r"(?<![\w])" + re.escape(name) + r"(?![\w])")


def name_in(name: str, text: str) -> bool:
    return word_re(name).search(text) is not None


def definitions(text: str) -> list[tuple[str, str, int, int, int]]:
    """[(name, kind, block start char, block end char, char of the name in its def line)] (empty on a syntax
    error). The block runs from the first decorator's line start to the end of the definition's last line."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.end_lineno is None:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        head = lines[node.lineno - 1]
        m = re.search(r"(?:def|class)\s+" + re.escape(node.name) + r"(?![\w])", head)
        if m is None:  # e.g. a header split over lines with a continuation: skip
            continue
        name_char = starts[node.lineno - 1] + m.end() - len(node.name)
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        out.append((node.name, kind, starts[first - 1], starts[node.end_lineno], name_char))
    return out


def file_cases(rel: str, text: str, offsets: list[tuple[int, int]], base: int, *, min_dist: int = 4000,
               max_dist: int = 7000, max_target: int = 8, min_name: int = 3) -> list[Case]:
    """The cases of one file. `offsets`: the (start, end) characters of each of the file's tokens; `base`: the
    stream position of its first token (after the file's <|bos|>)."""
    starts = [o[0] for o in offsets]

    def tok_at(c: int) -> int:
        return bisect.bisect_right(starts, c) - 1

    out, seen = [], set()
    for name, kind, b0, b1, name_char in definitions(text):
        if len(name) < min_name or (name.startswith("__") and name.endswith("__")) or name in seen:
            continue
        occ = [m.start() for m in word_re(name).finditer(text)]
        inside = [c for c in occ if b0 <= c < b1]
        after = [c for c in occ if c >= b1]
        if not after or any(c < b0 for c in occ):
            continue
        call = after[0]
        if not re.match(r"\s*\(", text[call + len(name):call + len(name) + 8]):
            continue
        k, j = tok_at(call), tok_at(call + len(name) - 1)
        n_target = j - k + 1
        if n_target > max_target or k <= 0:
            continue
        dist = k - tok_at(name_char)
        nearest = k - max(tok_at(c) for c in inside)
        if not (min_dist <= nearest and dist <= max_dist):
            continue
        a, b = tok_at(b0), tok_at(b1 - 1) + 1
        seen.add(name)
        target = text[offsets[k][0]:offsets[j][1]]
        out.append(Case(rel, name, kind, base + k, n_target, (base + a, base + b), dist, nearest, target))
    return out


def spread(cases: list[Case], per_file: int) -> list[Case]:
    """At most `per_file` cases of each file, evenly spaced over its cases in call order (less clustering)."""
    by: dict[str, list[Case]] = {}
    for c in cases:
        by.setdefault(c.file, []).append(c)
    out = []
    for cs in by.values():
        cs = sorted(cs, key=lambda c: c.cut)
        if len(cs) > per_file:
            step = len(cs) / per_file
            cs = [cs[int(i * step)] for i in range(per_file)]
        out += cs
    return sorted(out, key=lambda c: c.cut)
