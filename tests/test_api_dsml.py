"""DSML tool calls and grammars without a server: rendering round trips, streamed parsing == whole parsing on
random splits, the tool-call grammar (random walks through llguidance masks always parse back into calls that
match the schemas), and the grammar compiler's bitmask layout."""

import json

import numpy as np
import pytest

from serving.api import dsml
from serving.api.chat_template import ChatTemplate
from serving.engine.structured import GrammarCompiler, GrammarError, StructuredOutputs, mask_tokens
from serving.tokenizer import ByteTokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(ByteTokenizer(512), 512, {257})


def split_feed(text: str, rng) -> tuple[str, list[dict]]:
    s = dsml.ToolCallStream(TOOLS)
    content, deltas, i = "", [], 0
    while i < len(text):
        j = i + int(rng.integers(1, 9))
        c, d = s.feed(text[i:j])
        content, deltas, i = content + c, deltas + d, j
    c, d = s.finish()
    return content + c, deltas + d


def test_render_then_parse_round_trip_streamed_and_whole():
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Zürich <b>", "days": 3})}},
             {"id": "b", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]
    text = "Let me check." + dsml.render_tool_calls(calls) + "trailing text is dropped"
    content, parsed = dsml.parse(text, TOOLS)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == \
        [("get_weather", {"city": "Zürich <b>", "days": 3}), ("ping", {})]
    rng = np.random.default_rng(0)
    for _ in range(20):  # any split of the text streams the same content and calls
        streamed, deltas = split_feed(text, rng)
        assert streamed == "Let me check."
        merged = dsml.merge_deltas(deltas)
        assert [m["function"] for m in merged] == [p["function"] for p in parsed]
        assert all(d.get("id") and d["function"]["arguments"] == "" for d in deltas if "name" in d["function"])


def test_plain_text_and_partial_markup_are_content():
    rng = np.random.default_rng(1)
    for text in ["no tools here", "ends with a half tag \n\n<｜DSML｜ ca", "a < b and \n\n done"]:
        content, calls = dsml.parse(text, TOOLS)
        assert content == text and calls == []
        assert split_feed(text, rng) == (text, [])
    # an unfinished call (output cut off) yields no call and no markup in the content
    content, calls = dsml.parse('x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="ping">\n', TOOLS)
    assert (content, calls) == ("x", [])


def test_history_with_tool_calls_renders_dsml_and_tool_results():
    chat = ChatTemplate(ByteTokenizer(512))
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
                {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "tool", "tool_call_id": "c2", "content": "pong"}]
    text, _ = chat.encode(msgs, tools=TOOLS)
    assert text.startswith("<｜System｜>\n\n## Tools\n") and '"name": "get_weather"' in text
    assert ('<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Oslo'
            '</｜DSML｜ parameter>\n<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
            '</｜DSML｜ invoke>') in text
    # tool results in the order of the calls they answer (c2 first), in one user turn
    assert text.endswith("<｜User｜><tool_result>pong</tool_result>\n\n<tool_result>rain</tool_result>"
                         "<｜Assistant｜></think>")
    with pytest.raises(ValueError, match="valid JSON"):
        chat.encode([{"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "ping", "arguments": "{oops"}}]}])


@pytest.mark.parametrize("only,parallel", [(None, True), ("get_weather", False), ("ping", False)])
def test_tool_grammar_random_walks_parse_into_valid_calls(compiler, only, parallel):
    import jsonschema

    grammar = compiler.compile(StructuredOutputs(lark=dsml.tool_call_grammar(TOOLS, only, parallel)))
    rng = np.random.default_rng(7)
    row = np.full(16, 0xDEADBEEF, np.uint32)  # poisoned: every word must be written by the mask
    names = set()
    for _ in range(12):
        st, out = grammar.new_state(), []
        for _ in range(3000):
            st.fill(row)
            t = int(rng.choice(mask_tokens(row, 512)))
            assert st.advance(t)
            if t == 257 or st.done:
                break
            out.append(t)
        assert st.done
        content, calls = dsml.parse(bytes(out).decode(), TOOLS)
        assert content is None and calls and (parallel or len(calls) == 1)
        for c in calls:
            fn = next(t["function"] for t in TOOLS if t["function"]["name"] == c["function"]["name"])
            assert only in (None, fn["name"])
            jsonschema.validate(json.loads(c["function"]["arguments"]), fn["parameters"])
            names.add(fn["name"])
    assert only is None or names == {only}


def test_json_schema_mask_and_errors(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    st = compiler.compile(StructuredOutputs(json=schema)).new_state()
    row = np.zeros(16, np.uint32)
    st.fill(row)
    assert mask_tokens(row, 512) == [ord("{")]  # compact JSON: no leading whitespace
    for b in b'{"n":42}':
        assert st.advance(b)
    assert st.done
    st.fill(row)
    assert mask_tokens(row, 512) == [257]  # only EOS once complete
    st2 = compiler.compile(StructuredOutputs(choice=["yes", "no"])).new_state()
    assert not st2.advance(ord("x")) and st2.error
    for bad in (StructuredOutputs(regex="("), StructuredOutputs(grammar="start: nothing_defined"),
                StructuredOutputs(json={"type": 5})):
        with pytest.raises(GrammarError):
            compiler.compile(bad)
    with pytest.raises(GrammarError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"]).kind()
