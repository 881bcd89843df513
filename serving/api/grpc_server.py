"""gRPC API `dsv41.v1.Inference` (serving/proto/inference.proto) on grpc.aio, plus health and reflection.

Handlers take the raw request bytes and parse them here, so a malformed message (including invalid UTF-8
in a string field) is answered with INVALID_ARGUMENT instead of grpc's generic deserialization error.
Status codes: INVALID_ARGUMENT (bad input), UNAUTHENTICATED (API keys on and no valid `authorization: Bearer`
metadata; health and reflection stay open), RESOURCE_EXHAUSTED (queue full or a per-key limit, with a
`retry-after` trailer), UNAVAILABLE (draining), INTERNAL (the engine failed the request). Cancelling a Generate
call aborts the request in the engine. With API keys, request and session ids, cache salts and Abort are scoped
to the caller's key (serving/api/security.py).
"""

from __future__ import annotations

import logging
import uuid

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from serving.api.context import ServerContext
from serving.api.engine_client import EngineError, GenRequest, QueueFull, ServerDraining
from serving.api.openai_format import spec_report
from serving.api.protocol import ApiError, check_budget, check_prompt_ids, check_unicode
from serving.api.security import ANONYMOUS, LimitedStream, LimitExceeded, Tenant
from serving.engine.structured import StructuredOutputs
from serving.engine.types import MAX_LOGPROBS, SamplingParams
from serving.proto import inference_pb2 as pb

log = logging.getLogger("serving.api.grpc")

SERVICE = "dsv41.v1.Inference"
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class _Invalid(Exception):
    pass


def _opt(msg, field, default):
    return getattr(msg, field) if msg.HasField(field) else default


def sampling_from_proto(p: pb.SamplingParams, vocab_size: int, has_tokenizer: bool) -> SamplingParams:
    sp = SamplingParams(
        max_tokens=_opt(p, "max_tokens", 16), temperature=_opt(p, "temperature", 1.0), top_k=_opt(p, "top_k", -1),
        top_p=_opt(p, "top_p", 1.0), min_p=_opt(p, "min_p", 0.0), seed=_opt(p, "seed", None), stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=_opt(p, "logprobs", None),
        prompt_logprobs=_opt(p, "prompt_logprobs", None), include_stop_str_in_output=p.include_stop_str_in_output)
    if sp.top_k == 0:
        sp.top_k = -1
    if p.HasField("structured_outputs"):
        sp.structured = structured_from_proto(p.structured_outputs)
    if sp.max_tokens < 0:
        raise _Invalid(f"sampling_params.max_tokens must be at least 0, got {sp.max_tokens}")
    if sp.stop and not has_tokenizer:
        raise _Invalid("stop strings need a tokenizer (this server runs with --tokenizer none): use stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(sp, name)
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise _Invalid(f"sampling_params.{name} must be in [0, {MAX_LOGPROBS}], got {v}")
    try:
        sp.validate(vocab_size)
    except ValueError as e:
        raise _Invalid(f"sampling_params: {e}") from None
    return sp


def structured_from_proto(s: pb.StructuredOutputs) -> StructuredOutputs:
    kind = s.WhichOneof("constraint")
    if kind is None:
        raise _Invalid("sampling_params.structured_outputs has no constraint set")
    if kind == "json_schema":
        import json

        try:
            return StructuredOutputs(json=json.loads(s.json_schema))
        except json.JSONDecodeError as e:
            raise _Invalid(f"structured_outputs.json_schema is not valid JSON: {e.msg}") from None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        return StructuredOutputs(choice=list(s.choice.values))
    return StructuredOutputs(**{kind: getattr(s, kind)})


def _position(tid: int, d: dict[int, float] | None, n: int) -> pb.PositionLogprobs:
    """The actual token, then exactly the n most likely ones (the engine's dict holds the top-n plus the actual
    token when it is not among them)."""
    out = pb.PositionLogprobs()
    if d is None:
        return out
    out.token.token_id = tid
    out.token.logprob = d.get(tid, float("-inf"))
    for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]:
        out.top.add(token_id=k, logprob=v)
    return out


class GrpcApi:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.health = health_aio.HealthServicer()

    # ------------------------------------------------------------------ wiring
    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=None, response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self.abort, request_deserializer=None, response_serializer=pb.AbortResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.get_model_info, request_deserializer=None,
                response_serializer=pb.ModelInfo.SerializeToString),
        })

    def server(self, max_message_bytes: int) -> grpc.aio.Server:
        opts = [("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max(max_message_bytes, 64 << 20))]
        server = grpc.aio.server(options=opts)
        server.add_generic_rpc_handlers((self.handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
        return server

    async def set_serving(self, serving: bool):
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    # ------------------------------------------------------------------ helpers
    async def _parse(self, raw: bytes, cls, context):
        try:
            return cls.FromString(raw)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"malformed {cls.__name__} (invalid protobuf or invalid UTF-8 in a string): {e}")

    def _done(self, method: str, code: grpc.StatusCode):
        self.ctx.metrics.request_done("grpc", method, code.name)

    async def _tenant(self, context, method: str) -> Tenant:
        """The caller's tenant from the `authorization` metadata (UNAUTHENTICATED without a valid key)."""
        if not self.ctx.api_keys:
            return ANONYMOUS
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        key = self.ctx.api_keys.match(auth)
        if key is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid API key is required (metadata authorization: Bearer <key>)")
        return Tenant.of(key)

    # ------------------------------------------------------------------ Generate
    def _build(self, req: pb.GenerateRequest, tenant: Tenant = ANONYMOUS) -> GenRequest:
        ctx = self.ctx
        rid = tenant.scoped(req.request_id or f"grpc-{uuid.uuid4().hex}")
        for name, v in (("request_id", req.request_id), ("session_id", req.session_id),
                        ("cache_salt", req.cache_salt)):
            if len(v) > 512:
                raise _Invalid(f"{name} must be at most 512 characters")
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise _Invalid("the request has no prompt: set text or token_ids")
        if kind == "text":
            if not ctx.has_tokenizer:
                raise _Invalid("this server has no tokenizer (--tokenizer none): send token_ids")
            if not req.text:
                raise _Invalid("the prompt is empty")
            ids = ctx.tokenizer.encode(req.text, add_bos=req.add_bos)
        else:
            ids = list(req.token_ids.ids)
        try:
            check_prompt_ids(ids, ctx.vocab_size)
            check_unicode(list(req.sampling_params.stop), "sampling_params.stop")
        except ApiError as e:
            raise _Invalid(e.message) from None
        sp = sampling_from_proto(req.sampling_params, ctx.vocab_size, ctx.has_tokenizer)
        L = ctx.max_model_len
        if len(ids) + max(sp.max_tokens, 1) > L:
            raise _Invalid(f"this model's maximum context length is {L} tokens; the request has {len(ids)} prompt "
                           f"tokens and max_tokens={sp.max_tokens}")
        return GenRequest(rid, ids, sp, tenant.scoped(req.session_id or None), tenant.salt(req.cache_salt or None),
                          end_session=req.end_session)

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        m = self.ctx.metrics
        m.enter("grpc")
        code = grpc.StatusCode.OK
        try:
            async for msg in self._generate(raw, context):
                yield msg
        except BaseException:
            code = context.code() or grpc.StatusCode.CANCELLED
            if not isinstance(code, grpc.StatusCode):
                code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            m.leave("grpc")
            self._done("Generate", code)

    async def _generate(self, raw: bytes, context):
        tenant = await self._tenant(context, "Generate")
        req = await self._parse(raw, pb.GenerateRequest, context)
        try:
            gen = self._build(req, tenant)
            if gen.params.structured is not None:
                await self.ctx.compile_grammar(gen.params.structured)
                check_budget(gen.params.structured, gen.params.max_tokens, "sampling_params.max_tokens")
        except _Invalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ApiError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        try:
            ticket = self.ctx.limiter.admit(tenant, {gen.request_id: len(gen.prompt_token_ids)})
        except LimitExceeded as e:
            context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        try:
            stream = LimitedStream(await self.ctx.client.submit([gen]), ticket)
        except BaseException as e:
            ticket.close()
            if isinstance(e, QueueFull):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the server is overloaded: {e}; retry later")
            if isinstance(e, ServerDraining):
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if isinstance(e, EngineError):
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            if isinstance(e, ValueError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise
        rid = tenant.unscoped(gen.request_id)  # what the client sent (or the id picked for it)
        n_lp, n_plp = gen.params.logprobs or 0, gen.params.prompt_logprobs or 0
        try:
            async for out in stream:
                if out.new_token_ids or out.new_text:
                    chunk = pb.Chunk(token_ids=out.new_token_ids, text=out.new_text)
                    for t, d in zip(out.new_token_ids, out.new_logprobs or []):
                        chunk.logprobs.append(_position(t, d, n_lp))
                    yield pb.GenerateResponse(request_id=rid, chunk=chunk)
                if out.finished:
                    self.ctx.metrics.finished(out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
                    done = pb.Complete(finish_reason=FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                                       usage=pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                                      completion_tokens=out.num_output_tokens,
                                                      cached_tokens=out.num_cached_tokens))
                    if isinstance(out.stop_reason, str):
                        done.stop_str = out.stop_reason
                    elif out.stop_reason is not None:
                        done.stop_token_id = out.stop_reason
                    if out.prompt_logprobs is not None:
                        for t, d in zip(gen.prompt_token_ids, out.prompt_logprobs):
                            done.prompt_logprobs.append(_position(t, d, n_plp))
                    spec = spec_report(out.spec_decoding, self.ctx.spec_metrics)
                    if spec is not None:
                        done.speculative_decoding.CopyFrom(pb.SpecDecodingMetrics(**spec))
                    yield pb.GenerateResponse(request_id=rid, complete=done)
        except EngineError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            stream.abort()  # client cancel (CancelledError) or any failure: free the request's pages

    # ------------------------------------------------------------------ unary RPCs
    async def _unary_tenant(self, context, method: str) -> Tenant:
        try:
            return await self._tenant(context, method)
        except BaseException:
            self._done(method, grpc.StatusCode.UNAUTHENTICATED)
            raise

    async def abort(self, raw: bytes, context):
        tenant = await self._unary_tenant(context, "Abort")
        req = await self._parse(raw, pb.AbortRequest, context)
        if not req.request_id:
            self._done("Abort", grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        rid = tenant.scoped(req.request_id)  # only the caller's own requests
        aborted = await self.ctx.client.call(lambda eng: eng.abort(rid))
        self._done("Abort", grpc.StatusCode.OK)
        return pb.AbortResponse(aborted=bool(aborted))

    async def get_model_info(self, raw: bytes, context):
        await self._unary_tenant(context, "GetModelInfo")
        await self._parse(raw, pb.GetModelInfoRequest, context)
        info = self.ctx.model_info()
        bos = info.get("bos_token_id")
        self._done("GetModelInfo", grpc.StatusCode.OK)
        return pb.ModelInfo(
            model=self.ctx.model_name, vocab_size=info["vocab_size"], max_model_len=info["max_model_len"],
            eos_token_ids=info["eos_token_ids"], window_size=info["window"], page_size=info["page_size"],
            swa_bounded_replay=info["swa_bounded_replay"], enable_prefix_caching=info["enable_prefix_caching"],
            max_num_seqs=info["max_num_seqs"], max_num_batched_tokens=info["max_num_batched_tokens"],
            tokenizer=info["tokenizer"], bos_token_id=-1 if bos is None else bos)
