"""gRPC API dsv41.v1 on loopback: streaming Generate, Abort, client cancel, health, reflection, model info,
prompt logprobs, and bad input (INVALID_ARGUMENT / RESOURCE_EXHAUSTED; the server stays SERVING)."""

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from tests.harness import server_stats as stats
from tests.harness import shared_test_server, wait_idle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    return shared_test_server()


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(server.grpc_target)
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.InferenceStub(channel)



def serving(channel, service=""):
    h = health_pb2_grpc.HealthStub(channel)
    return h.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
        health_pb2.HealthCheckResponse.SERVING


def generate(stub, **kw):
    msgs = list(stub.Generate(pb.GenerateRequest(**kw), timeout=120))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    completes = [m.complete for m in msgs if m.HasField("complete")]
    assert len(completes) == 1 and msgs[-1].HasField("complete")
    return msgs, chunks, completes[0]


def sp(**kw):
    return pb.SamplingParams(**kw)


def test_generate_streams_chunks_then_complete(stub):
    msgs, chunks, done = generate(stub, request_id="g-text", text="Hello",
                                  sampling_params=sp(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert all(m.request_id == "g-text" for m in msgs)
    assert sum(len(c.token_ids) for c in chunks) == 7
    assert done.finish_reason == pb.FINISH_REASON_LENGTH
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.cached_tokens) == (5, 7, 0)
    again = generate(stub, text="Hello", sampling_params=sp(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert [t for c in again[1] for t in c.token_ids] == [t for c in chunks for t in c.token_ids]
    assert again[0][0].request_id  # the server picked an id


def test_token_ids_logprobs_and_cached_tokens(stub):
    prompt = list(range(10, 110))  # 100 tokens: one full page
    params = sp(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    _, chunks, first = generate(stub, token_ids=pb.TokenIds(ids=prompt), sampling_params=params,
                                cache_salt="grpc-cache", session_id="grpc-session")
    lps = [p for c in chunks for p in c.logprobs]
    ids = [t for c in chunks for t in c.token_ids]
    assert len(lps) == 3 and [p.token.token_id for p in lps] == ids
    assert all(p.top[0].token_id == p.token.token_id for p in lps)  # greedy
    _, _, second = generate(stub, token_ids=pb.TokenIds(ids=prompt + ids + [1, 2]), sampling_params=params,
                            cache_salt="grpc-cache", session_id="grpc-session")
    # one 64-token page hit; bounded replay recomputes the last 8 (the tiny window): 56 computations skipped
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 64 - 8


def test_prompt_logprobs_with_max_tokens_zero(stub):
    prompt = [5, 6, 7, 8]
    _, chunks, done = generate(stub, token_ids=pb.TokenIds(ids=prompt),
                               sampling_params=sp(max_tokens=0, prompt_logprobs=1))
    assert chunks == [] and done.usage.completion_tokens == 0
    plp = done.prompt_logprobs
    assert len(plp) == 4 and not plp[0].HasField("token")
    assert [p.token.token_id for p in plp[1:]] == prompt[1:]
    assert all(p.token.logprob <= 0 and 1 <= len(p.top) <= 2 for p in plp[1:])


def test_abort_rpc_ends_the_stream(server, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="to-abort", text="abort me",
                                            sampling_params=sp(max_tokens=200, ignore_eos=True)), timeout=120)
    first = next(call)
    assert first.HasField("chunk")
    assert stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).aborted
    rest = list(call)
    assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    assert rest[-1].complete.usage.completion_tokens < 200
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=10).aborted
    wait_idle(server)


def test_client_cancel_aborts_and_frees_pages(server, stub):
    before = stats(server)["metrics"]["counters"]["requests_aborted"]
    call = stub.Generate(pb.GenerateRequest(request_id="to-cancel", token_ids=pb.TokenIds(ids=list(range(50))),
                                            sampling_params=sp(max_tokens=200, ignore_eos=True)), timeout=120)
    next(call)
    s = stats(server)
    assert s["requests"]["running"] == 1 and s["pages"]["referenced"] >= 1
    call.cancel()
    after = wait_idle(server)
    assert after["metrics"]["counters"]["requests_aborted"] == before + 1


def test_concurrent_streams(stub):
    results = {}

    def run(i):
        _, chunks, done = generate(stub, text=f"concurrent {i}", sampling_params=sp(max_tokens=5, ignore_eos=True))
        results[i] = (sum(len(c.token_ids) for c in chunks), done.usage.completion_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: (5, 5) for i in range(16)}


def test_health_reflection_and_model_info(channel, stub, server):
    assert serving(channel) and serving(channel, "dsv41.v1.Inference")
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"dsv41.v1.Inference", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
        services)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model == "tiny" and info.vocab_size == 512 and info.max_model_len == 256
    assert info.page_size == 64 and info.tokenizer == "byte" and list(info.eos_token_ids) == [257]
    assert info.bos_token_id == 256 and info.max_num_seqs == 8


BAD = [
    ("no prompt", dict(sampling_params=sp(max_tokens=1)), "no prompt"),
    ("empty text", dict(text=""), "empty"),
    ("empty token ids", dict(token_ids=pb.TokenIds(ids=[])), "empty"),
    ("token id out of range", dict(token_ids=pb.TokenIds(ids=[1, 512])), "512"),
    ("negative token id", dict(token_ids=pb.TokenIds(ids=[-1])), "-1"),
    ("negative max_tokens", dict(text="hi", sampling_params=sp(max_tokens=-3)), "max_tokens"),
    ("huge max_tokens", dict(text="hi", sampling_params=sp(max_tokens=2 ** 31 - 1)), "maximum context length"),
    ("prompt too long", dict(text="z" * 300), "maximum context length"),
    ("bad temperature", dict(text="hi", sampling_params=sp(temperature=-2)), "temperature"),
    ("bad top_p", dict(text="hi", sampling_params=sp(top_p=0)), "top_p"),
    ("too many logprobs", dict(text="hi", sampling_params=sp(logprobs=99)), "logprobs"),
    ("negative seed", dict(text="hi", sampling_params=sp(seed=-1)), "seed"),
    ("bad stop token", dict(text="hi", sampling_params=sp(stop_token_ids=[9999])), "stop_token_ids"),
    ("huge request id", dict(text="hi", request_id="r" * 600), "request_id"),
]


@pytest.mark.parametrize("name,kw,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument(channel, stub, name, kw, needle):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(**kw), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert needle in e.value.details()
    assert serving(channel)


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x12\x02\xff\xfe"], ids=["garbage", "invalid UTF-8 text"])
def test_malformed_messages_are_invalid_argument(channel, raw):
    call = channel.unary_stream("/dsv41.v1.Inference/Generate", request_serializer=None,
                                response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
    assert serving(channel)


def test_duplicate_running_request_id_is_rejected(server, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="dup", text="one",
                                            sampling_params=sp(max_tokens=30, ignore_eos=True)), timeout=120)
    msgs = [next(call)]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(request_id="dup", text="two"), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in e.value.details()
    msgs += list(call)  # the first request is undisturbed
    assert sum(len(m.chunk.token_ids) for m in msgs if m.HasField("chunk")) == 30
    assert msgs[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
    wait_idle(server)


def test_queue_full_is_resource_exhausted(server, stub, channel):
    eng_loop = server.server.engine_loop
    old = eng_loop.call(lambda e: e.args.max_queued_requests).result(10)
    eng_loop.call(lambda e: setattr(e.args, "max_queued_requests", 0)).result(10)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        eng_loop.call(lambda e: setattr(e.args, "max_queued_requests", old)).result(10)
    assert serving(channel)


def test_generated_code_is_up_to_date():
    pytest.importorskip("grpc_tools")
    from serving.proto import regen

    assert regen.main(["--check"]) == 0, "run: python -m serving.proto.regen"
