"""Budget-aware structured outputs without a server: the shortest completion matches an exhaustive search on small
grammars, and a sampler that always prefers newlines (or picks tokens at random) ends every constraint with a
valid, parseable completion within max_tokens, from the minimum budget up; a budget below the minimum is refused.
Byte tokenizer and the default model's BPE tokenizer."""

import json
import re

import jsonschema
import numpy as np
import pytest

from dsv41_jax.default_model import DIR
from serving.api import dsml
from serving.engine.structured import GrammarCompiler, GrammarError, StructuredOutputs, mask_tokens
from serving.tokenizer import ByteTokenizer, HFTokenizer

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1},
                       "mode": {"enum": ["text", "binary"]}}}}},
    {"type": "function", "function": {"name": "grep", "parameters": {
        "type": "object", "required": ["pattern", "paths"],
        "properties": {"pattern": {"type": "string", "minLength": 2},
                       "paths": {"type": "array", "items": {"type": "string"}, "minItems": 1}}}}},
]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "email": {"type": "string", "minLength": 3}, "ok": {"type": "boolean"}}}


class Tok:
    def __init__(self, name):
        if name == "byte":
            self.tok, self.V, self.eos = ByteTokenizer(512), 512, 257
        else:
            self.tok = HFTokenizer(str(DIR / "tokenizer.json"))
            self.V, self.eos = 8192, self.tok.eos_token_id
        self.compiler = GrammarCompiler(self.tok, self.V, {self.eos})
        self.nl = self.tok.encode("\n")[0]

    def text(self, ids):
        return self.tok.decode([t for t in ids if t != self.eos])


@pytest.fixture(scope="module", params=["byte", "bpe"])
def tk(request):
    return Tok(request.param)


def run(grammar, tk, budget, pick):
    """Generate with `pick(allowed, step)` until the grammar is done, the end-of-sequence token or the budget."""
    st = grammar.new_state(budget)
    row = np.full((tk.V + 31) // 32, 0xDEADBEEF, np.uint32)
    out = []
    while len(out) < budget:
        st.fill(row)
        allowed = mask_tokens(row, tk.V)
        t = pick(allowed, len(out))
        assert t in allowed and st.advance(t), st.error
        out.append(t)
        if t == tk.eos or st.done:
            return out, True
    return out, st.done


def newline_lover(rng):
    """The degenerate default model: a newline whenever allowed, otherwise any allowed token."""
    return lambda allowed, i: next((t for t in allowed if t == NL[0]), int(rng.choice(allowed)))


NL = [None]


def check_calls(text, only=None, parallel=True):
    content, calls = dsml.parse(text, TOOLS)
    assert content is None and calls and (parallel or len(calls) == 1), text
    for c in calls:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == c["function"]["name"])
        assert only in (None, fn["name"])
        jsonschema.validate(json.loads(c["function"]["arguments"]), fn["parameters"])


CASES = {
    "required": (StructuredOutputs(lark=dsml.tool_call_grammar(TOOLS, None, True)), lambda s: check_calls(s)),
    "named": (StructuredOutputs(lark=dsml.tool_call_grammar(TOOLS, "grep", False)),
              lambda s: check_calls(s, "grep", False)),
    "json_schema": (StructuredOutputs(json=PERSON), lambda s: jsonschema.validate(json.loads(s), PERSON)),
    "json_object": (StructuredOutputs(json_object=True), lambda s: isinstance(json.loads(s), dict) or 1 / 0),
    "regex": (StructuredOutputs(regex=r"[a-c]{3}-[0-9]{2,}"),
              lambda s: re.fullmatch(r"[a-c]{3}-[0-9]{2,}", s) or 1 / 0),
    "grammar": (StructuredOutputs(grammar='start: "[" item ("," item)* "]"\nitem: /[0-9]+/ | "\\n"'),
                lambda s: re.fullmatch(r"\[([0-9]+|\n)(,([0-9]+|\n))*\]", s) or 1 / 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_newline_lover_closes_within_every_budget(tk, case):
    so, check = CASES[case]
    g = tk.compiler.compile(StructuredOutputs(**{k: v for k, v in vars(so).items() if k != "compiled"}))
    NL[0] = tk.nl
    m = g.min_tokens
    assert m >= 1
    with pytest.raises(GrammarError, match=f"shortest valid completion is {m} tokens"):
        g.new_state(m - 1)
    rng = np.random.default_rng(0)
    for budget in (m, m + 1, m + 3, m + 17, 2 * m + 40):
        out, done = run(g, tk, budget, newline_lover(rng))
        assert done and len(out) <= budget, (budget, tk.text(out))
        check(tk.text(out))
    text = tk.text(run(g, tk, 2 * m + 40, newline_lover(rng))[0])
    if case in ("required", "named"):  # the free text was the model's: newlines (the parameter is not empty)
        assert "\n\n\n" in text.split('string="true">', 1)[1]


@pytest.mark.parametrize("case", ["required", "json_schema", "grammar"])
def test_random_tokens_close_within_budget(tk, case):
    """Any allowed token at any step (a random model): still complete and valid at every budget."""
    so, check = CASES[case]
    g = tk.compiler.compile(StructuredOutputs(**{k: v for k, v in vars(so).items() if k != "compiled"}))
    rng = np.random.default_rng(1)
    for seed in range(4):
        budget = g.min_tokens + [0, 2, 9, 30][seed]
        out, done = run(g, tk, budget, lambda allowed, i: int(rng.choice(allowed)))
        assert done and len(out) <= budget
        check(tk.text(out))


def _bfs_min(grammar, tk, depth):
    """Exhaustive fewest-token completion (every allowed token at every step) up to `depth` tokens."""
    row = np.zeros((tk.V + 31) // 32, np.uint32)
    frontier = [grammar._proto.deep_copy()]
    for d in range(depth + 1):
        nxt = []
        for m in frontier:
            if m.is_stopped():
                return d
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            for t in mask_tokens(row, tk.V):
                c = m.deep_copy()
                assert c.consume_token(t)
                nxt.append(c)
        frontier = nxt
        assert len(frontier) < 200_000
    return None


SMALL = [StructuredOutputs(choice=["abcdef", "xy", "xyz"]), StructuredOutputs(regex=r"(ab|c)d{2,3}(e|fg)?"),
         StructuredOutputs(json={"enum": ["north", "south", 7, True]}),
         StructuredOutputs(json={"type": "object", "required": ["a"], "additionalProperties": False,
                                 "properties": {"a": {"type": "boolean"}}}),
         StructuredOutputs(lark='start: "x" ("yy" | "z"+) "!"?')]


@pytest.mark.parametrize("i", range(len(SMALL)))
def test_min_tokens_equals_exhaustive_search(tk, i):
    g = tk.compiler.compile(SMALL[i])
    assert g.min_tokens == _bfs_min(g, tk, g.min_tokens + 1)
