"""The replayer's three wire clients; each streams one turn and times it.

- `TokenClient`: `POST /v1/completions` with a token-id prompt (token-exact: no re-tokenisation drift),
  `return_token_ids` so every generated token arrives in its own SSE chunk with its id.
- `ChatClient`: `POST /v1/chat/completions` with the message array (what AIPerf sends); `logprobs: true`
  (top 0) so every token is visible in the stream even when its text is empty or an incomplete UTF-8
  sequence (random-weight models emit those), else a token would only be counted with its neighbours.
- `GrpcClient`: `dsv41.v1.Inference/Generate` with `token_ids`, server streaming.

All send `max_tokens = recorded output`, `ignore_eos`, streaming with usage, and the conversation's session
id (HTTP: the `X-Correlation-ID` header AgentX sends, and `X-Session-Id`, which session-affine routers hash on;
gRPC: `session_id`). A `Result` carries the client-side
times (perf_counter seconds: start, first token, end), the tokens counted in the stream, the server's usage
(prompt, completion and cached tokens) and, on failure, the error text; `overflow` marks a context-length
rejection (HTTP 400 / INVALID_ARGUMENT naming the maximum context length).
"""

from __future__ import annotations

import abc
import json
import time
from dataclasses import dataclass

OVERFLOW_TEXT = "maximum context length"


@dataclass
class WireRequest:
    request_id: str
    session_id: str
    max_tokens: int
    prompt_ids: list[int] | None = None  # token clients
    messages: list[dict] | None = None  # chat client


@dataclass
class Result:
    start: float
    end: float
    first: float | None = None
    n_stream_tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    overflow: bool = False


def _is_overflow(msg: str) -> bool:
    return OVERFLOW_TEXT in msg.lower()


class _HttpClient(abc.ABC):
    kind = "tokens"
    path = "/v1/completions"

    def __init__(self, url: str, *, model: str | None = None, timeout: float = 1800.0,
                 temperature: float | None = None):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.temperature = temperature
        self.session = None

    async def start(self) -> dict:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout, sock_connect=30))
        async with self.session.get(self.url + "/v1/models") as r:
            card = (await r.json())["data"][0]
        self.model = self.model or card["id"]
        return {"model": card["id"], "max_model_len": card.get("max_model_len")}

    async def close(self):
        if self.session is not None:
            await self.session.close()
            self.session = None

    @abc.abstractmethod
    def _body(self, req: WireRequest) -> dict:
        """The endpoint's request body for `req` (prompt or messages)."""

    @abc.abstractmethod
    def _count(self, chunk: dict) -> int:
        """Tokens one streamed chunk carries."""

    async def generate(self, req: WireRequest) -> Result:
        body = self._body(req)
        body.update(model=self.model, max_tokens=req.max_tokens, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})
        if self.temperature is not None:
            body["temperature"] = self.temperature
        # the session id twice: X-Correlation-ID as AgentX sends it, X-Session-Id for session-affine routers
        headers = {"X-Correlation-ID": req.session_id, "X-Session-Id": req.session_id,
                   "Content-Type": "application/json"}
        res = Result(start=time.perf_counter(), end=0.0)
        try:
            async with self.session.post(self.url + self.path, data=json.dumps(body), headers=headers) as r:
                if r.status != 200:
                    text = await r.text()
                    try:
                        msg = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        msg = text[:300]
                    res.error = f"HTTP {r.status}: {msg}"
                    res.overflow = r.status == 400 and _is_overflow(msg)
                    return res
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                        continue
                    n = sum(self._count(c) for c in obj.get("choices") or [])
                    if n:
                        if res.first is None:
                            res.first = time.perf_counter()
                        res.n_stream_tokens += n
                    if obj.get("usage"):
                        _usage(res, obj["usage"])
        except Exception as e:  # noqa: BLE001 - any failure is this request's error (cancellation is not caught)
            res.error = f"{type(e).__name__}: {e}"
        finally:
            res.end = time.perf_counter()
        return res


def _usage(res: Result, u: dict):
    res.prompt_tokens = u.get("prompt_tokens")
    res.completion_tokens = u.get("completion_tokens")
    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")


class TokenClient(_HttpClient):
    kind = "tokens"
    path = "/v1/completions"
    name = "token"

    def _body(self, req):
        return {"prompt": req.prompt_ids, "return_token_ids": True}

    def _count(self, c):
        ids = c.get("token_ids")
        if ids is not None:
            return len(ids)
        return 1 if c.get("text") else 0


class ChatClient(_HttpClient):
    kind = "chat"
    path = "/v1/chat/completions"
    name = "chat"

    def _body(self, req):
        return {"messages": req.messages, "logprobs": True, "top_logprobs": 0}

    def _count(self, c):
        lp = c.get("logprobs")
        if lp and lp.get("content") is not None:
            return len(lp["content"])
        return 1 if (c.get("delta") or {}).get("content") else 0


class GrpcClient:
    kind = "tokens"
    name = "grpc"

    def __init__(self, target: str, *, timeout: float = 1800.0, temperature: float | None = None,
                 max_message_bytes: int = 64 << 20):
        self.target = target
        self.timeout = timeout
        self.temperature = temperature
        self.max_message_bytes = max_message_bytes
        self.channel = None
        self.stub = None

    async def start(self) -> dict:
        import grpc

        from serving.proto import inference_pb2 as pb
        from serving.proto import inference_pb2_grpc as pb_grpc

        opts = [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]
        self.channel = grpc.aio.insecure_channel(self.target, options=opts)
        self.stub = pb_grpc.InferenceStub(self.channel)
        info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        return {"model": info.model, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}

    async def close(self):
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def generate(self, req: WireRequest) -> Result:
        import grpc

        from serving.proto import inference_pb2 as pb

        sp = pb.SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        if self.temperature is not None:
            sp.temperature = self.temperature
        msg = pb.GenerateRequest(request_id=req.request_id, token_ids=pb.TokenIds(ids=req.prompt_ids),
                                 sampling_params=sp, session_id=req.session_id)
        res = Result(start=time.perf_counter(), end=0.0)
        try:
            async for out in self.stub.Generate(msg, timeout=self.timeout):
                kind = out.WhichOneof("response")
                if kind == "chunk":
                    n = len(out.chunk.token_ids)
                    if n:
                        if res.first is None:
                            res.first = time.perf_counter()
                        res.n_stream_tokens += n
                elif kind == "complete":
                    u = out.complete.usage
                    res.prompt_tokens, res.completion_tokens = u.prompt_tokens, u.completion_tokens
                    res.cached_tokens = u.cached_tokens
                    if out.complete.finish_reason == pb.FINISH_REASON_ABORT:
                        res.error = "aborted"
        except grpc.aio.AioRpcError as e:
            res.error = f"gRPC {e.code().name}: {e.details()}"
            res.overflow = e.code() == grpc.StatusCode.INVALID_ARGUMENT and _is_overflow(e.details() or "")
        except Exception as e:  # noqa: BLE001
            res.error = f"{type(e).__name__}: {e}"
        finally:
            res.end = time.perf_counter()
        return res


def make_client(kind: str, *, url: str | None = None, grpc_target: str | None = None, **kw):
    if kind == "token":
        return TokenClient(url, **kw)
    if kind == "chat":
        return ChatClient(url, **kw)
    if kind == "grpc":
        if not grpc_target:
            raise ValueError("the grpc client needs a gRPC target (host:port)")
        return GrpcClient(grpc_target, **kw)
    raise ValueError(f"unknown client {kind!r} (token | chat | grpc)")
