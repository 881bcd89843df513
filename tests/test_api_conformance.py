"""vLLM conformance of the shared test server (issue 10): stop strings never leak (HTTP streamed and not, gRPC)
and `stop_reason` is vLLM's; gauges on abort; `finished_reason` labels; `Allow` on 405; `stream_options`
without `stream`; gRPC `top` of exactly n; `add_special_tokens` defaults."""

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from serving.engine.types import SamplingParams
from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from tests.harness import shared_test_server

pytestmark = pytest.mark.timeout(300)
PROMPT = "The stop-string test prompt: "
KW = dict(model="tiny", prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    return shared_test_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pb_grpc.InferenceStub(ch)


def raw(server, path, body=None, method=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.http_url + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


@pytest.fixture(scope="module")
def greedy_text(client):
    """The greedy continuation of PROMPT and a two-character stop string inside it (not at the start)."""
    text = client.completions.create(max_tokens=40, **KW).choices[0].text
    for i in range(3, len(text) - 2):
        s = text[i:i + 2]
        if "\ufffd" not in s and text.find(s) >= 2:
            return text, s, text.find(s)
    pytest.fail(f"no usable stop string in {text!r}")


def stream_text(client, **kw):
    chunks = list(client.completions.create(stream=True, **kw))
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(c.choices[0].text for c in chunks if c.choices), finals[-1]


def test_stop_string_never_leaks_http(client, greedy_text):
    text, s, k = greedy_text
    r = client.completions.create(max_tokens=40, stop=[s], **KW).choices[0]
    assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (text[:k], "stop", s)
    streamed, final = stream_text(client, max_tokens=40, stop=[s], **KW)
    assert streamed == text[:k]  # no chunk ever carried the beginning of the stop string
    assert final.finish_reason == "stop" and final.model_extra["stop_reason"] == s
    kept = client.completions.create(max_tokens=40, stop=[s], **{**KW, "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0]
    assert kept.text == text[:k + 2]
    # a stop string whose first character appears but which never completes: the held-back text is released
    never = text[k] + "\u2603\u2603"
    streamed, final = stream_text(client, max_tokens=40, stop=[never], **KW)
    assert streamed == text and final.finish_reason == "length" and final.model_extra["stop_reason"] is None


def test_stop_string_and_stop_token_over_grpc(stub, greedy_text):
    text, s, k = greedy_text
    msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPT, add_bos=True, sampling_params=pb.SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=[s])), timeout=60))
    assert "".join(m.chunk.text for m in msgs if m.HasField("chunk")) == text[:k]
    done = msgs[-1].complete
    assert done.finish_reason == pb.FINISH_REASON_STOP and done.WhichOneof("stop_reason") == "stop_str"
    assert done.stop_str == s
    ids = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
    msgs = list(stub.Generate(pb.GenerateRequest(text=PROMPT, add_bos=True, sampling_params=pb.SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[ids[1]])), timeout=60))
    done = msgs[-1].complete
    assert done.WhichOneof("stop_reason") == "stop_token_id" and done.stop_token_id == ids[1]


def test_stop_reason_for_stop_token_ids_http(client):
    ids = client.completions.create(max_tokens=6, logprobs=0, **{**KW, "extra_body": {
        "ignore_eos": True, "return_token_ids": True}}).choices[0].model_extra["token_ids"]
    r = client.completions.create(max_tokens=6, **{**KW, "extra_body": {"ignore_eos": True,
                                                                         "stop_token_ids": [ids[2]]}}).choices[0]
    assert r.finish_reason == "stop" and r.model_extra["stop_reason"] == ids[2]


def test_grpc_top_logprobs_has_exactly_n(stub):
    msgs = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]), sampling_params=pb.
                                                 SamplingParams(max_tokens=16, temperature=3.0, seed=11,
                                                                ignore_eos=True, logprobs=2, prompt_logprobs=1)),
                              timeout=60))
    lps = [p for m in msgs if m.HasField("chunk") for p in m.chunk.logprobs]
    assert len(lps) == 16 and all(len(p.top) == 2 for p in lps)
    assert all(p.top[0].logprob >= p.top[1].logprob for p in lps)
    outside = [p for p in lps if p.token.token_id not in {t.token_id for t in p.top}]
    assert outside, "temperature 3 should sample some token outside the top-2"
    assert all(p.token.logprob <= p.top[1].logprob for p in outside)
    plp = msgs[-1].complete.prompt_logprobs
    assert len(plp) == 4 and all(len(p.top) == 1 for p in plp[1:])


def test_gauges_drop_on_abort_without_another_step(server):
    def run(eng):
        eng.add_request("gauge-abort", list(range(1, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(3):
            eng.step()
        running = eng.metrics.gauges["running"]
        eng.abort("gauge-abort")
        return running, eng.metrics.gauges["running"]

    assert server.server.engine_loop.call(run).result(60) == (1, 0)


def test_request_success_has_finished_reason_labels(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    def counts():
        fams = {f.name: f for f in text_string_to_metric_families(raw(server, "/metrics")[2])}
        return {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples
                if s.name.endswith("_total")}

    before = counts()
    assert set(before) >= {"stop", "length", "abort"}
    client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body={"stop_token_ids": list(range(512))})
    after = counts()
    assert after["length"] == before["length"] + 1 and after["stop"] == before["stop"] + 1


def test_405_has_allow_and_stream_options_need_stream(server):
    status, headers, body = raw(server, "/v1/chat/completions", method="GET")
    assert status == 405 and headers["Allow"] == "POST" and json.loads(body)["error"]["code"] == 405
    status, _, body = raw(server, "/v1/models", {"x": 1})
    assert status == 405 and "GET" in _["Allow"]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, _, text = raw(server, path, {**body, "max_tokens": 1, "stream_options": {"include_usage": True}})
        assert status == 400 and "stream=True" in json.loads(text)["error"]["message"]


def test_add_special_tokens_defaults(client):
    def prompt_ids(**kw):
        r = client.completions.create(model="tiny", prompt="Hi", max_tokens=1, **kw)
        return r.choices[0].model_extra["prompt_token_ids"]

    assert prompt_ids(extra_body={"return_token_ids": True}) == [256, 72, 105]  # completions: BOS, as vLLM
    assert prompt_ids(extra_body={"return_token_ids": True, "add_special_tokens": False}) == [72, 105]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"return_token_ids": True})
    ids = chat.model_extra["prompt_token_ids"]
    assert ids[0] == 256 and ids[1] != 256  # chat: the template's single BOS
