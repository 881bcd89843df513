"""Structured outputs and tool calling end to end with the random `tiny` model: whatever it samples, the grammar
makes it schema-valid JSON / a regex match / one of the choices, and well-formed DeepSeek-V4.1 tool calls that
the server turns into OpenAI `tool_calls` (streamed deltas == the non-streamed message). Plus the 400s for
bad tools, tool_choice and constraints. JSON runs on the shared server; tools need the 2048-token one."""

import json

import grpc
import jsonschema
import openai
import pytest

from serving.api import dsml
from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from tests.harness import shared_long_server, shared_test_server

pytestmark = pytest.mark.timeout(400)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 5}}}}},
    {"type": "function", "function": {"name": "search", "description": "Web search", "parameters": {
        "type": "object", "required": ["q"], "properties": {"q": {"type": "string", "maxLength": 8}}}}},
]
ASK = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=shared_test_server().http_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tclient():
    return openai.OpenAI(base_url=shared_long_server().http_url + "/v1", api_key="unused", max_retries=0,
                         timeout=240)


# ---------------------------------------------------------------------------------------------- JSON and friends
def test_json_schema_chat_is_valid_streamed_and_not(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "A person, as JSON"}], max_tokens=120,
              temperature=1.0, seed=5, response_format=rf)
    r = client.chat.completions.create(n=3, extra_body={"cache_salt": "json-a"}, **kw)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    chunks = list(client.chat.completions.create(stream=True, extra_body={"cache_salt": "json-b"}, **kw))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == r.choices[0].message.content  # same seed: the first choice


def test_completions_regex_choice_json_object_and_guided_alias(client):
    base = dict(model="tiny", prompt="Answer: ", max_tokens=40, temperature=1.0)
    for seed in range(3):
        r = client.completions.create(seed=seed, extra_body={"structured_outputs": {"regex": r"[a-c]{3}-[0-9]{2}"}},
                                      **base)
        import re

        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = client.completions.create(seed=seed, extra_body={"guided_choice": ["yes", "no", "maybe"]}, **base)
        assert r.choices[0].text in ("yes", "no", "maybe")
    r = client.completions.create(seed=1, extra_body={"response_format": {"type": "json_object"}},
                                  **{**base, "max_tokens": 240})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def test_grpc_structured_outputs(client):
    with grpc.insecure_channel(shared_test_server().grpc_target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        so = pb.StructuredOutputs(json_schema=json.dumps(PERSON))
        msgs = list(stub.Generate(pb.GenerateRequest(text="JSON: ", sampling_params=pb.SamplingParams(
            max_tokens=120, seed=3, structured_outputs=so)), timeout=60))
        text = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
        assert msgs[-1].complete.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), PERSON)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(regex="("))), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()


BAD = [
    ("bad regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "("}}, "regex"),
    ("two constraints", "/v1/completions", {"prompt": "x", "guided_regex": "a", "response_format":
                                            {"type": "json_object"}}, "only one"),
    ("bad response_format", "/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("tool_choice without tools", "/v1/chat/completions", {"tool_choice": "required"}, "`tools` must be set"),
    ("auto without the flags", "/v1/chat/completions", {"tools": TOOLS}, "--enable-auto-tool-choice"),
    ("named unknown", "/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "nope"}}}, "not in tools"),
    ("bad tool name", "/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}],
                                               "tool_choice": "required"}, "name"),
    ("required with a schema", "/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required",
                                                        "response_format": {"type": "json_object"}}, "combined"),
]


@pytest.mark.parametrize("name,path,body,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_and_tool_choices_are_400(client, name, path, body, needle):
    import urllib.error
    import urllib.request

    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    req = urllib.request.Request(client.base_url.__str__().rstrip("/").removesuffix("/v1") + path,
                                 data=json.dumps({"max_tokens": 4, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    msg = json.loads(e.value.read())["error"]["message"]
    assert e.value.code == 400 and needle in msg, msg


# ---------------------------------------------------------------------------------------------- tool calls
def check_calls(calls, only=None):
    assert calls
    for c in calls:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == c.function.name)
        assert only in (None, fn["name"]) and c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), fn["parameters"])


def test_required_tool_choice_streamed_equals_nonstreamed(tclient):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0,
              seed=4)
    # distinct salts: a prefix-cache hit replays only the last window (bounded replay), which may change the output
    r = tclient.chat.completions.create(extra_body={"cache_salt": "req-a"}, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    check_calls(c.message.tool_calls)
    chunks = list(tclient.chat.completions.create(stream=True, extra_body={"cache_salt": "req-b"}, **kw))
    deltas = [d.model_dump(exclude_none=True) for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls
              or []]
    assert deltas[0]["function"]["arguments"] == "" and deltas[0]["id"].startswith("call_")
    merged = dsml.merge_deltas(deltas)
    assert [m["function"] for m in merged] == [t.function.model_dump() for t in c.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (ch.choices[0].delta.content or "") for ch in chunks if ch.choices)


def test_named_tool_choice_and_tool_results_in_history(tclient):
    named = {"type": "function", "function": {"name": "search"}}
    r = tclient.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200,
                                        temperature=1.0, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1  # vLLM: named keeps "stop"
    check_calls(c.message.tool_calls, "search")
    call = c.message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12 results"}]
    r2 = tclient.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=4, extra_body={"ignore_eos": True})
    assert r2.choices[0].message.tool_calls == [] and r2.choices[0].finish_reason == "length"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 50
    assert r2.usage.prompt_tokens_details.cached_tokens >= 1024  # the turn was appended: prefix-cache hit


def test_auto_tool_choice_parses_what_the_model_writes(tclient):
    """tool_choice auto only parses; a grammar in structured_outputs makes the random model write DSML."""
    grammar = dsml.tool_call_grammar(TOOLS, None, True)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=300, temperature=1.0, seed=9,
              extra_body={"structured_outputs": {"grammar": grammar}})
    r = tclient.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls)
    plain = tclient.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto",
                                            max_tokens=8, extra_body={"ignore_eos": True}, temperature=0)
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason == "length"
    assert isinstance(plain.choices[0].message.content, str)
