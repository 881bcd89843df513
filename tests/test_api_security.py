"""Access control and transport security (issue 11): API keys (401 / UNAUTHENTICATED, open health, metrics and
reflection), mutual TLS on both servers with certificates made here, per-key cache isolation through both APIs,
per-key limits (429 with Retry-After / RESOURCE_EXHAUSTED with retry-after), cross-key Abort, the start-up
warning. One `python -m serving.run` subprocess serves all of it."""

import json
import ssl
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.api.context import ServerContext
from serving.api.protocol import ApiError
from serving.api.security import ApiKeys, KeyLimiter, LimitExceeded, Tenant, exposure_warning, keys_from
from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from serving.spawn import spawn_server
from tests.harness import small_server_args

pytestmark = pytest.mark.timeout(400)
KEY_A, KEY_B = "key-alice-0123", "key-bob-4567"
PROMPT = "A prompt long enough to fill one whole 64-token page of the prefix cache, shared by two tenants. " * 2


# ---------------------------------------------------------------------------------------------- unit
def test_keys_tenants_limits_and_warning(monkeypatch):
    keys = ApiKeys([KEY_A, KEY_B])
    assert keys.match(f"Bearer {KEY_B}") == KEY_B and keys.match(f"Bearer {KEY_A}x") is None
    assert keys.match(KEY_A) is None and keys.match(None) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert keys_from(None).keys == ["from-env"] and keys_from(["cli"]).keys == ["cli"]
    a, b = Tenant.of(KEY_A), Tenant.of(KEY_B)
    assert a.salt(None) != b.salt(None) and a.salt("s") != b.salt("s") and a.salt("s") != a.salt(None)
    assert KEY_A not in a.salt("s") and a.scoped("sess") != b.scoped("sess") and a.unscoped(a.scoped("r")) == "r"
    anon = Tenant.of(None)
    assert anon.salt("s") == "s" and anon.scoped("sess") == "sess"
    lim = KeyLimiter(max_requests=2, max_queued_tokens=100)
    t1 = lim.admit(a, {"r1": 80})
    with pytest.raises(LimitExceeded, match="queued prompt tokens"):
        lim.admit(a, {"r2": 30})
    lim.admit(b, {"r3": 90}).close()  # other keys are not affected
    t1.started("r1")  # r1 produces output: its tokens are no longer queued
    t2 = lim.admit(a, {"r2": 30})
    with pytest.raises(LimitExceeded, match="concurrent"):
        lim.admit(a, {"r4": 1})
    t1.close(), t2.close(), t2.close()
    assert lim.requests[a.id] == 0 and lim.queued[a.id] == 0
    assert exposure_warning("0.0.0.0", ApiKeys([])) and exposure_warning("::", ApiKeys([]))
    assert exposure_warning("127.0.0.1", ApiKeys([])) is None and exposure_warning("0.0.0.0", keys) is None
    ctx = ServerContext(None, None, None, "m", api_keys=keys, protect_metrics=True)
    assert ctx.authenticate("/health", None).id == "" and ctx.authenticate("/v1/models", f"Bearer {KEY_A}") == a
    for path in ("/v1/models", "/metrics", "/engine/stats"):
        with pytest.raises(ApiError) as e:
            ctx.authenticate(path, "Bearer nope")
        assert e.value.status == 401


# ---------------------------------------------------------------------------------------------- a TLS server
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("client@example.com")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server_cert.private_key_pem.write_to_path(str(d / "server.key"))
    server_cert.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(d / "client.pem"))
    return d


@pytest.fixture(scope="module")
def server(certs):
    srv = spawn_server([*small_server_args(), "--api-key", KEY_A, "--api-key", KEY_B, "--max-requests-per-key", "1",
                        "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
                        "--ssl-ca-certs", str(certs / "ca.pem")])
    yield srv
    srv.kill()


def ssl_ctx(certs, client_cert=True):
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(certs / "client.pem"))
    return ctx


def get(server, certs, path, key=None, body=None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(server.http_url + path, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60, context=ssl_ctx(certs)) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def oai(server, certs, key):
    http = openai.DefaultHttpx2Client(verify=ssl_ctx(certs), timeout=120)
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=key, max_retries=0, http_client=http)


def channel(server, certs, client_cert=True):
    kw = {}
    if client_cert:
        pem = (certs / "client.pem").read_bytes()
        kw = dict(private_key=pem, certificate_chain=pem)
    creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes(), **kw)
    return grpc.secure_channel(server.grpc_target, creds)


def md(key):
    return (("authorization", f"Bearer {key}"),)


def test_http_api_keys_and_open_endpoints(server, certs):
    assert server.http_url.startswith("https://") and "WARNING" not in server.output()
    for key in (None, "wrong"):
        status, headers, body = get(server, certs, "/v1/models", key)
        err = json.loads(body)["error"]
        assert status == 401 and err["code"] == 401 and err["type"] == "AuthenticationError"
        assert headers.get("WWW-Authenticate") == "Bearer"
    assert get(server, certs, "/v1/models", KEY_B)[0] == 200
    assert get(server, certs, "/health")[0] == 200 and get(server, certs, "/metrics")[0] == 200
    assert get(server, certs, "/engine/stats")[0] == 401
    # mutual TLS: no client certificate, no connection
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        urllib.request.urlopen(server.http_url + "/health", timeout=30, context=ssl_ctx(certs, client_cert=False))


def test_grpc_api_keys_health_reflection_and_mtls(server, certs):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with channel(server, certs) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for meta in ((), md("wrong")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=meta, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md(KEY_A), timeout=30).model == "tiny"
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert "dsv41.v1.Inference" in ProtoReflectionDescriptorDatabase(ch).get_services()
    with channel(server, certs, client_cert=False) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cache_isolation_between_keys_through_both_apis(server, certs):
    a, b = oai(server, certs, KEY_A), oai(server, certs, KEY_B)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": "same-salt"})
    first = a.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert a.completions.create(**kw).usage.prompt_tokens_details.cached_tokens >= 64 - 8  # same key: a hit
    assert b.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0  # other key: none
    ids = [256] + list(PROMPT.encode())
    with channel(server, certs) as ch:
        stub = pb_grpc.InferenceStub(ch)

        def cached(key):
            msgs = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt="same-salt",
                                                         sampling_params=pb.SamplingParams(max_tokens=1)),
                                      metadata=md(key), timeout=60))
            return msgs[-1].complete.usage.cached_tokens

        assert cached(KEY_B) >= 64 - 8  # B's HTTP request above cached it for B only
        assert cached(KEY_A) >= 64 - 8


def test_per_key_limits_and_cross_key_abort(server, certs):
    a, b = oai(server, certs, KEY_A), oai(server, certs, KEY_B)
    started, result = threading.Event(), {}

    def long_stream():
        with a.completions.create(model="tiny", prompt="long", max_tokens=200, stream=True,
                                  extra_body={"ignore_eos": True, "request_id": "alice-long"}) as s:
            n = 0
            for _ in s:
                n += 1
                started.set()
            result["chunks"] = n

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(60)
        status, headers, body = get(server, certs, "/v1/completions", KEY_A, {"prompt": "x", "max_tokens": 1})
        assert status == 429 and headers["Retry-After"] == "1" and "concurrent" in json.loads(body)["error"]["message"]
        assert b.completions.create(model="tiny", prompt="x", max_tokens=1).choices  # key B is not limited
        with channel(server, certs) as ch:
            stub = pb_grpc.InferenceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="x"), metadata=md(KEY_A), timeout=30))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(e.value.trailing_metadata())["retry-after"] == "1"
            # B cannot abort A's request (ids are per key); A can
            assert not stub.Abort(pb.AbortRequest(request_id="alice-long"), metadata=md(KEY_B), timeout=30).aborted
            assert stub.Abort(pb.AbortRequest(request_id="alice-long"), metadata=md(KEY_A), timeout=30).aborted
    finally:
        t.join(120)
    assert 0 < result["chunks"] < 200
    assert a.completions.create(model="tiny", prompt="x", max_tokens=1).choices  # the slot was released
