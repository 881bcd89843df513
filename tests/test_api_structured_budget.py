"""Budget-aware structured outputs end to end. A tiny engine whose sampler is biased towards the newline token
(a test-only hook: the runner's `sample` wrapped here, before the programs are traced) loves newlines the way the
degenerate default model did; forced tool calls (tool_choice "required" and a named function) and
response_format JSON (json_schema, json_object) still end with a valid, parseable completion within max_tokens for
several budgets down to the minimum, with the finish_reason an OpenAI client expects; a budget below the minimum
is a 400 (gRPC INVALID_ARGUMENT) before any work. Last, the real default model (CPU): tool_choice "required"
yields a valid call within 200 tokens."""

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from serving.api import dsml
from serving.engine.config import shared_cache_dir
from serving.engine.structured import StructuredOutputs
from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from tests.harness import DEFAULT_MODEL_ENGINE_ARGS, LONG_ENGINE_ARGS, BackgroundServer

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

NEWLINE = 10  # the byte tokenizer's "\n"
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the code", "parameters": {
        "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}},
]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "Show me setup.py"}]


@pytest.fixture(scope="module")
def server():
    import jax

    import serving.engine.runner as runner
    from dsv41_jax.config import ModelConfig
    from serving.api.server import ServerConfig
    from serving.engine.config import EngineArgs
    from serving.engine.engine import Engine, load_model

    real = runner.sample

    def newline_loving(logits, *args, **kw):
        return real(logits.at[:, NEWLINE].add(1e4), *args, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(runner, "sample", newline_loving)
    jax.config.update("jax_compilation_cache_dir", shared_cache_dir())
    cfg, params = load_model(ModelConfig.preset("tiny", max_seq_len=LONG_ENGINE_ARGS["max_model_len"]))
    engine = Engine(cfg, EngineArgs(**LONG_ENGINE_ARGS, compilation_cache_dir=shared_cache_dir()), params=params,
                    progress=False)
    srv = BackgroundServer(engine, ServerConfig(port=0, grpc_port=0, served_model_name="tiny", shutdown_timeout=5))
    srv.start()
    yield srv
    srv.stop()
    mp.undo()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def min_tokens(server, so: StructuredOutputs) -> int:
    return server.server.ctx.grammars.compile(so).min_tokens


def post(server, path, body):
    req = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    return e.value.code, json.loads(e.value.read())["error"]


def check_calls(calls, only=None):
    assert calls
    for c in calls:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == c.function.name)
        assert only in (None, fn["name"]) and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), fn["parameters"])


def test_the_hook_makes_the_model_love_newlines(client):
    r = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == "\n" * 12


@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_tool_calls_close_within_the_budget(server, client, mode):
    choice = "required" if mode == "required" else {"type": "function", "function": {"name": "search"}}
    only = None if mode == "required" else "search"
    m = min_tokens(server, StructuredOutputs(lark=dsml.tool_call_grammar(TOOLS, only, True)))
    budgets = (m, m + 3, m + 60, 3 * m)

    def ask(i):  # the four budgets at once: one decode batch
        return client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                              max_tokens=budgets[i], temperature=1.0, seed=i,
                                              extra_body={"cache_salt": f"{mode}-{budgets[i]}"})

    with ThreadPoolExecutor(len(budgets)) as pool:
        replies = list(pool.map(ask, range(len(budgets))))
    for budget, r in zip(budgets, replies):
        c = r.choices[0]
        assert r.usage.completion_tokens <= budget
        # OpenAI (and vLLM): "tool_calls" when the model chose to call; a named tool_choice finishes "stop"
        assert c.finish_reason == ("tool_calls" if mode == "required" else "stop"), (budget, c)
        check_calls(c.message.tool_calls, only)
        if budget > m + 30:  # the free text is the model's: newlines, as many as the budget leaves room for
            args = json.loads(c.message.tool_calls[0].function.arguments)
            assert "\n\n" in next(v for v in args.values() if isinstance(v, str))
    code, err = post(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": choice,
                                                      "max_tokens": m - 1})
    assert code == 400 and f"shortest valid completion is {m} tokens" in err["message"]
    assert err["param"] == "max_tokens"


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_response_format_json_closes_within_the_budget(server, client, kind):
    if kind == "json_schema":
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        m = min_tokens(server, StructuredOutputs(json=PERSON))
    else:
        rf = {"type": "json_object"}
        m = min_tokens(server, StructuredOutputs(json_object=True))
    msgs = [{"role": "user", "content": "A person as JSON"}]
    for i, budget in enumerate((m, m + 1, m + 12, m + 80)):
        r = client.chat.completions.create(model="tiny", messages=msgs, response_format=rf, max_tokens=budget,
                                           temperature=1.0, seed=i)
        c = r.choices[0]
        assert c.finish_reason == "stop" and r.usage.completion_tokens <= budget, (budget, c.message.content)
        value = json.loads(c.message.content)
        if kind == "json_schema":
            jsonschema.validate(value, PERSON)
        else:
            assert isinstance(value, dict)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", c.message.content))  # compact JSON
    code, err = post(server, "/v1/chat/completions", {"messages": msgs, "response_format": rf, "max_tokens": m - 1})
    assert code == 400 and "too small for this output constraint" in err["message"]


def test_grpc_budget_below_the_minimum_is_invalid_argument(server):
    m = min_tokens(server, StructuredOutputs(json=PERSON))
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        so = pb.StructuredOutputs(json_schema=json.dumps(PERSON))
        msgs = list(stub.Generate(pb.GenerateRequest(text="JSON: ", sampling_params=pb.SamplingParams(
            max_tokens=m, seed=1, structured_outputs=so)), timeout=120))
        text = "".join(x.chunk.text for x in msgs if x.HasField("chunk"))
        assert msgs[-1].complete.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), PERSON)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="JSON: ", sampling_params=pb.SamplingParams(
                max_tokens=m - 1, structured_outputs=so)), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shortest valid completion" in e.value.details()


# ---------------------------------------------------------------------------------------------- the default model
def test_default_model_required_tool_choice_yields_a_call_within_200_tokens():
    from dsv41_jax.default_model import DIR
    from serving.api.server import ServerConfig
    from serving.engine.config import EngineArgs
    from serving.engine.engine import Engine, load_model
    from serving.tokenizer import HFTokenizer

    cfg, params = load_model(str(DIR))
    # the four requests run at once (one decode batch): the steps of one request, not of four in a row; the
    # generation tests' shapes (tests/test_default_model_generation.py), so one of the two builds is a cache hit
    args = EngineArgs(**DEFAULT_MODEL_ENGINE_ARGS, compilation_cache_dir=shared_cache_dir())
    engine = Engine(cfg, args, params=params, tokenizer=HFTokenizer(str(DIR / "tokenizer.json")), progress=False)
    with BackgroundServer(engine, ServerConfig(port=0, grpc_port=-1, served_model_name="default",
                                               shutdown_timeout=5)) as srv:
        c = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(prompt, temperature):
            return c.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                             tools=TOOLS, tool_choice="required", max_tokens=200,
                                             temperature=temperature, seed=0)

        cases = [(p, t) for p in ("Read the file setup.py", "Find where parse_args is defined") for t in (0.0, 1.0)]
        with ThreadPoolExecutor(len(cases)) as pool:
            for r in pool.map(lambda case: ask(*case), cases):
                ch = r.choices[0]
                assert ch.finish_reason == "tool_calls" and r.usage.completion_tokens <= 200, ch
                check_calls(ch.message.tool_calls)
