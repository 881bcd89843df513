"""OpenAI-compatible HTTP API on loopback: the official openai client, SSE, cached tokens, concurrency,
echo + prompt logprobs, cancellation, metrics, and bad input (the server stays healthy after each)."""

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.harness import server_stats as stats
from tests.harness import shared_test_server, wait_idle

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    return shared_test_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def http(server, path, body=None, *, method=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON or text) for any status code."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    method = method or ("POST" if data is not None else "GET")
    req = urllib.request.Request(server.http_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text



def assert_healthy(server):
    status, _ = http(server, "/health")
    assert status == 200


# ---------------------------------------------------------------------------------------------- basics
def test_health_models_version(server, client):
    assert_healthy(server)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body = http(server, "/version")
    assert status == 200 and "version" in body


def test_completion_nonstream_and_stream_agree(client):
    kw = dict(model="tiny", prompt="Hello, world", max_tokens=8, extra_body=NO_EOS, **GREEDY)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # greedy is deterministic
    assert a.choices[0].finish_reason == "length"
    assert a.usage.prompt_tokens == 1 + len(b"Hello, world") and a.usage.completion_tokens == 8  # BOS (vLLM default)
    assert a.usage.total_tokens == a.usage.prompt_tokens + 8
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == a.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_chat_nonstream_and_stream_agree(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    # distinct salts: a prefix-cache hit replays only the last window (bounded replay), which may change the output
    kw = dict(model="tiny", messages=msgs, max_tokens=6, **GREEDY)
    a = client.chat.completions.create(extra_body={"cache_salt": "chat-a", **NO_EOS}, **kw)
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 extra_body={"cache_salt": "chat-b", **NO_EOS}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == a.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(server, client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 150}],
                                       extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == server.engine.args.max_model_len


def test_second_turn_reports_cached_tokens(client):
    system = "You are a helpful assistant for the dsv41 API tests. Answer briefly and precisely, please."
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]
    extra = {"cache_salt": "second-turn", **NO_EOS}
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, extra_body=extra, **GREEDY)
    assert first.usage.prompt_tokens > 64 and first.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And the second?"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra,
                                                 **GREEDY))
    usage = chunks[-1].usage
    assert usage.prompt_tokens > first.usage.prompt_tokens
    # cached_tokens counts the tokens the hit really skipped: whole 64-token pages minus the window (8 for the
    # tiny preset) that bounded replay recomputes
    assert usage.prompt_tokens_details.cached_tokens >= 64 - 8
    assert (usage.prompt_tokens_details.cached_tokens + 8) % 64 == 0


def test_cache_salt_isolates_prefixes(client):
    prompt = "A prompt that is long enough to fill one whole 64-token page of the prefix cache. " * 2
    kw = dict(model="tiny", prompt=prompt, max_tokens=1, **GREEDY)
    client.completions.create(extra_body={"cache_salt": "alice"}, **kw)
    same = client.completions.create(extra_body={"cache_salt": "alice"}, **kw)
    other = client.completions.create(extra_body={"cache_salt": "bob"}, **kw)
    assert same.usage.prompt_tokens_details.cached_tokens >= 64 - 8  # a page hit, minus the replayed window
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_session_and_salt_reach_the_engine(server, client, monkeypatch):
    seen = []
    loop = server.server.engine_loop
    orig = loop.add
    monkeypatch.setattr(loop, "add", lambda reqs, sink: (seen.extend(reqs), orig(reqs, sink))[1])
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                   extra_headers={"X-Session-Id": "conv-7"}, extra_body={"cache_salt": "s1"})
    client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                              extra_body={"session_id": "body-wins", "cache_salt": "s2"},
                              extra_headers={"X-Session-Id": "header"})
    client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_headers={"X-Correlation-ID": "corr"})
    assert [(r.session_id, r.cache_salt) for r in seen] == [("conv-7", "s1"), ("body-wins", "s2"), ("corr", None)]


def test_batched_prompts_and_n(client):
    r = client.completions.create(model="tiny", prompt=["ab", "cde"], n=2, max_tokens=3, extra_body=NO_EOS,
                                  temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 2 + 5 and r.usage.completion_tokens == 12  # a BOS per text prompt
    toks = client.completions.create(model="tiny", prompt=[[65, 66], [67]], max_tokens=2,
                                     extra_body={"return_token_ids": True, **NO_EOS})
    assert len(toks.choices) == 2 and toks.usage.prompt_tokens == 3
    c = sorted(toks.choices, key=lambda c: c.index)
    assert c[0].model_extra["prompt_token_ids"] == [65, 66] and c[1].model_extra["prompt_token_ids"] == [67]
    assert all(len(x.model_extra["token_ids"]) == 2 for x in c)


def test_stop_token_ids_and_token_id_rendering(client):
    kw = dict(model="tiny", prompt="stop here", max_tokens=6, logprobs=0, **GREEDY)
    full = client.completions.create(extra_body={"return_tokens_as_token_ids": True, **NO_EOS}, **kw)
    ids = [int(t.split(":")[1]) for t in full.choices[0].logprobs.tokens]
    assert len(ids) == 6 and all(t.startswith("token_id:") for t in full.choices[0].logprobs.tokens)
    k = ids.index(ids[2])
    cut = client.completions.create(extra_body={"stop_token_ids": [ids[2]], **NO_EOS}, **kw)
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == k + 1


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, extra_body=NO_EOS, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy: the sampled token is the top-1


# ---------------------------------------------------------------------------------------------- echo / prompt logprobs
def test_echo_logprobs_max_tokens_zero_lm_eval_style(client):
    """lm-evaluation-harness loglikelihood: token prompts, echo, logprobs, max_tokens 0."""
    prompts = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    for choice, p in zip(sorted(r.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert lp.tokens == [f"token_id:{t}" for t in p]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for t, v, top in zip(p[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert v <= 0 and top[f"token_id:{t}"] == pytest.approx(v)
            assert 1 <= len(top) <= 2 and max(top.values()) >= v
        assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 12
    text = client.completions.create(model="tiny", prompt="Hello", max_tokens=0, echo=True, logprobs=0)
    assert text.choices[0].text == "Hello" and text.choices[0].logprobs.tokens == ["<256>"] + list("Hello")
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=0, echo=True, logprobs=0,
                                      extra_body={"add_special_tokens": False})
    assert plain.choices[0].logprobs.tokens == list("Hello") and plain.usage.prompt_tokens == 5


def test_vllm_prompt_logprobs_field(client):
    r = client.completions.create(model="tiny", prompt="Hey", max_tokens=0, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4  # BOS + 3 bytes
    for t, entry in zip(b"Hey", plp[1:]):
        assert str(t) in entry and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None)[:2] == [1, 2]


def test_echo_without_logprobs_streams_the_prompt_first(client):
    kw = dict(model="tiny", prompt="Hey", max_tokens=2, echo=True, extra_body=NO_EOS, **GREEDY)
    full = client.completions.create(**kw)
    streamed = list(client.completions.create(stream=True, **kw))
    assert streamed[0].choices[0].text == "Hey"
    assert "".join(x.choices[0].text for x in streamed if x.choices) == full.choices[0].text
    assert full.choices[0].text.startswith("Hey") and full.usage.completion_tokens == 2


def test_echo_logprobs_with_generation(client):
    kw = dict(model="tiny", prompt="Hey", max_tokens=2, echo=True, logprobs=1, extra_body=NO_EOS, **GREEDY)
    r = client.completions.create(**kw)
    c = r.choices[0]
    assert c.text.startswith("Hey") and len(c.logprobs.tokens) == 1 + 3 + 2
    assert c.logprobs.token_logprobs[0] is None and all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(x.choices[0].text for x in streamed if x.choices) == c.text


# ---------------------------------------------------------------------------------------------- load and cancellation
def test_64_concurrent_streams_complete_with_exact_token_counts(server):
    n_streams, n_tok = 64, 6

    async def one(ac, i):
        stream = await ac.completions.create(model="tiny", prompt=f"stream {i}: " + "x" * (i % 7), max_tokens=n_tok,
                                             logprobs=0, stream=True, stream_options={"include_usage": True},
                                             extra_body=NO_EOS)
        got, usage, reasons = 0, None, []
        async for ch in stream:
            if ch.choices:
                got += len(ch.choices[0].logprobs.tokens) if ch.choices[0].logprobs else 0
                reasons += [ch.choices[0].finish_reason] if ch.choices[0].finish_reason else []
            if ch.usage is not None:
                usage = ch.usage
        return got, usage.completion_tokens, reasons

    async def main():
        async with openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=240) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(n_streams)))

    results = asyncio.run(main())
    assert len(results) == n_streams
    assert all(r == (n_tok, n_tok, ["length"]) for r in results), results
    wait_idle(server)


def test_client_disconnect_aborts_and_frees_pages(server, client):
    before = stats(server)["metrics"]["counters"]["requests_aborted"]
    with client.completions.create(model="tiny", prompt="p" * 40, max_tokens=200, stream=True,
                                   extra_body=NO_EOS) as stream:
        it = iter(stream)
        next(it)
        next(it)
        during = stats(server)
        assert during["requests"]["running"] == 1 and during["pages"]["referenced"] >= 1
    after = wait_idle(server)  # the disconnect aborted the request: nothing runs, no page is referenced
    assert after["metrics"]["counters"]["requests_aborted"] == before + 1
    assert_healthy(server)


def test_queue_full_gets_503(server):
    eng_loop = server.server.engine_loop
    old = eng_loop.call(lambda e: e.args.max_queued_requests).result(10)
    eng_loop.call(lambda e: setattr(e.args, "max_queued_requests", 0)).result(10)
    try:
        status, body = http(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503 and "overloaded" in body["error"]["message"]
    finally:
        eng_loop.call(lambda e: setattr(e.args, "max_queued_requests", old)).result(10)
    assert http(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_engine_step_failure_fails_only_running_requests(server):
    eng_loop = server.server.engine_loop

    def arm(eng):
        orig = eng.step

        def boom():
            eng.step = orig  # fail once
            raise RuntimeError("injected step failure")

        eng.step = boom

    eng_loop.call(arm).result(10)
    status, body = http(server, "/v1/completions", {"prompt": "doomed", "max_tokens": 4})
    assert status == 500 and "injected step failure" in body["error"]["message"]
    wait_idle(server)
    assert_healthy(server)
    status, body = http(server, "/v1/completions", {"prompt": "fine", "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_poisoned_request_fails_alone(server, client):
    """An exception while admitting one request fails that request; a running stream carries on."""
    import threading

    eng_loop = server.server.engine_loop
    result, first = {}, threading.Event()

    def innocent():
        n, reason = 0, None
        for ch in client.completions.create(model="tiny", prompt="innocent", max_tokens=40, logprobs=0,
                                            stream=True, extra_body=NO_EOS):
            n += len(ch.choices[0].logprobs.tokens) if ch.choices and ch.choices[0].logprobs else 0
            reason = (ch.choices[0].finish_reason if ch.choices else None) or reason
            first.set()
        result.update(n=n, reason=reason)

    def arm(eng):
        orig = eng.scheduler._admit

        def admit(req, now):
            if req.request_id == "poison-1":
                raise RuntimeError("poisoned admission")
            return orig(req, now)

        eng.scheduler._admit = admit
        return orig

    t = threading.Thread(target=innocent)
    t.start()
    assert first.wait(60)
    orig = eng_loop.call(arm).result(10)
    try:
        status, body = http(server, "/v1/completions", {"prompt": "poison", "max_tokens": 4,
                                                        "request_id": "poison-1"})
        assert status == 500 and "poisoned admission" in body["error"]["message"]
    finally:
        eng_loop.call(lambda e: setattr(e.scheduler, "_admit", orig)).result(10)
    t.join(60)
    assert result == {"n": 40, "reason": "length"}
    wait_idle(server)
    assert_healthy(server)


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics_prometheus_vllm_names(server, client):
    prompt = "Metrics need a prompt that spans at least one full page of sixty-four tokens, like this one. "
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": "metrics"})
    status, text = http(server, "/metrics")
    assert status == 200
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prompt_tokens_by_source", "vllm:request_prompt_tokens",
                 "dsv41:api_requests", "vllm:kv_cache_usage_perc"):
        assert name in fams, name
    hits = {s.labels["source"]: s.value for s in fams["vllm:prompt_tokens_by_source"].samples}
    assert hits["local_compute"] > 0 and hits["local_cache_hit"] >= 64 - 8  # a page hit minus the replayed window
    ttft = [s for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft[0].value > 0 and ttft[0].labels["model_name"] == "tiny"


# ---------------------------------------------------------------------------------------------- bad input
LONG = "y" * 300  # over max_model_len (256) in bytes
BAD = [
    ("malformed JSON", b'{"prompt": "hi", ', 400, "malformed JSON"),
    ("not an object", b'["prompt"]', 400, "JSON object"),
    ("empty body", b"", 400, "empty"),
    ("wrong type", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("wrong type bool list", {"prompt": [True, False]}, 400, "prompt"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be at least 0"),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10 ** 12}, 400, "maximum context length"),
    ("prompt over max_model_len", {"prompt": LONG, "max_tokens": 1}, 400, "maximum context length"),
    ("unknown token id", {"prompt": [1, 2, 99999]}, 400, "99999"),
    ("negative token id", {"prompt": [-5]}, 400, "-5"),
    ("empty prompt", {"prompt": ""}, 400, "empty"),
    ("empty token list", {"prompt": []}, 400, "empty"),
    ("no prompt", {"max_tokens": 2}, 400, "prompt is required"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("lone surrogate", b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    ("bad temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("nan top_p", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    ("too many logprobs", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("n zero", {"prompt": "hi", "n": 0}, 400, "n must be"),
    ("penalty", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("stop wrong type", {"prompt": "hi", "stop": [1, 2]}, 400, "stop"),
    ("huge seed", {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("unknown model", {"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
    ("chat no messages", {"messages": []}, 400, "at least one message"),
    ("chat bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("chat image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "only text parts"),
    ("chat messages wrong type", {"messages": "hi"}, 400, "messages"),
    ("chat top_logprobs without logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "logprobs"),
    ("chat too long", {"messages": [{"role": "user", "content": LONG}]}, 400, "maximum context length"),
]


@pytest.mark.parametrize("name,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error_and_server_stays_healthy(server, name, body, status, needle):
    path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, resp = http(server, path, raw=raw)
    assert got == status, resp
    assert resp["error"]["code"] == status and needle in resp["error"]["message"], resp
    assert_healthy(server)


def test_oversized_body_and_routing_errors(server):
    big = json.dumps({"prompt": "z" * (server.server.ctx.max_request_bytes + 10)}).encode()
    status, resp = http(server, "/v1/completions", raw=big)
    assert status == 413 and "larger than" in resp["error"]["message"]
    status, resp = http(server, "/v1/nothing-here", {"a": 1})
    assert status == 404 and resp["error"]["code"] == 404
    status, resp = http(server, "/v1/completions", method="GET")
    assert status == 405 and resp["error"]["code"] == 405
    assert_healthy(server)


def test_unknown_fields_are_ignored(server, caplog):
    with caplog.at_level("WARNING", logger="serving.api"):
        status, body = http(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    assert any("frobnicate" in r.getMessage() for r in caplog.records)
