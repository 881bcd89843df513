"""OpenAI-compatible HTTP API (aiohttp) over the shared engine client.

Routes:
  GET  /health                 200 while serving; 503 while draining or when the engine loop is unhealthy
  GET  /v1/models              the served model
  POST /v1/completions         string / token-id / batched prompts, echo + logprobs (prompt logprobs), SSE
  POST /v1/chat/completions    chat template -> prompt, SSE with stream_options.include_usage
  GET  /metrics                Prometheus text: the engine's vLLM-compatible metrics + server metrics
  GET  /engine/stats           JSON: page pool, queues, counters (read on the engine thread)
  POST /v1/sessions/{id}/end   the end-of-session hint: the session's cached prefix is no longer protected
  GET  /version

Errors use OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 bad input, 401 missing or wrong
API key (/v1/*, /engine/*, and /metrics with --protect-metrics), 404 unknown model or route, 405 wrong method
(with `Allow`), 413 body too large, 429 a per-key limit (with `Retry-After`), 503 queue full or shutting down,
500 engine failure. vLLM extensions accepted in bodies: ignore_eos, top_k, min_p, stop_token_ids,
include_stop_str_in_output, prompt_logprobs, return_tokens_as_token_ids, return_token_ids, cache_salt,
session_id (also the X-Session-Id header, or X-Correlation-ID), end_session (also `X-Session-End: 1`: this is the
session's last turn), request_id, structured_outputs (and guided_*).

Chat tool calls: `tools` go to the chat template; with tool_choice auto (--enable-auto-tool-choice), required or
a named function the output is parsed for DSML tool calls (serving/api/dsml.py) into `tool_calls`, streamed as
deltas; required / named are enforced by the tool-call grammar. Stop strings never leak (the engine holds back
text that could still start one) and `stop_reason` carries the matched stop string or stop token id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from aiohttp import web

from serving.api import dsml
from serving.api import openai_format as fmt
from serving.api.chat_template import TemplateError
from serving.api.context import ServerContext, engine_stats
from serving.api.engine_client import EngineError, GenRequest, QueueFull, ServerDraining
from serving.api.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    bad,
    build_sampling_params,
    chat_messages,
    check_budget,
    check_ids,
    check_logprobs,
    check_n,
    check_prompt_ids,
    completion_prompts,
    parse,
    resolve_max_tokens,
    structured_outputs,
    tool_choice,
)
from serving.api.security import ANONYMOUS, LimitedStream, LimitExceeded
from serving.engine.structured import StructuredOutputs

log = logging.getLogger("serving.api.http")

TENANT = web.RequestKey("tenant", object) if hasattr(web, "RequestKey") else "tenant"  # the caller's Tenant
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, allow_nan=False).encode() + b"\n\n"


class HttpApi:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.ctx.max_request_bytes, middlewares=[self._middleware])
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/engine/stats", self.stats)
        app.router.add_post("/v1/sessions/{session_id}/end", self.end_session)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        m = self.ctx.metrics
        m.enter("http")
        code = 500
        try:
            request[TENANT] = self.ctx.authenticate(request.path, request.headers.get("Authorization"))
            resp = await handler(request)
            code = resp.status
            return resp
        except ApiError as e:
            code = e.status
            if e.status >= 500:
                log.warning("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
            return _error_response(e)
        except web.HTTPException as e:  # router errors (404, 405) as OpenAI-style JSON
            code = e.status
            headers = {}
            if isinstance(e, web.HTTPMethodNotAllowed):
                headers["Allow"] = ", ".join(sorted(e.allowed_methods))
            return _error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                                            headers=headers))
        except asyncio.CancelledError:
            code = 499  # the client went away
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not take the server down
            log.exception("unhandled error in %s %s", request.method, request.path)
            return _error_response(ApiError(500, f"internal server error: {type(e).__name__}: {e}"))
        finally:
            m.leave("http")
            m.request_done("http", endpoint, code)

    # ------------------------------------------------------------------ simple routes
    async def health(self, request):
        c = self.ctx.client
        if c.draining:
            raise ApiError(503, "the server is shutting down")
        if not c.healthy:
            raise ApiError(503, f"the engine is unhealthy: {c.loop.last_error}")
        return web.Response(status=200)

    async def version(self, request):
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("dsv41-jax")
        except PackageNotFoundError:
            v = "unknown"
        return web.json_response({"version": v})

    async def models(self, request):
        ctx = self.ctx
        card = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "dsv41-jax",
                "root": ctx.engine.cfg.name, "parent": None, "max_model_len": ctx.max_model_len, "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request):
        return web.Response(text=self.ctx.prometheus(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def stats(self, request):
        stats = await self.ctx.client.call(engine_stats)
        stats["server"] = {"draining": self.ctx.client.draining, "healthy": self.ctx.client.healthy,
                           "step_failures": self.ctx.client.loop.step_failures}
        return web.json_response(stats)

    async def end_session(self, request):
        tenant = request.get(TENANT, ANONYMOUS)
        sid = tenant.scoped(self.ctx.check_id(request.match_info["session_id"], "session_id"))
        n = await self.ctx.client.call(lambda e: e.end_session(sid))
        return web.json_response({"session_id": request.match_info["session_id"], "released": n})

    # ------------------------------------------------------------------ request plumbing
    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the request body is larger than this server's limit of "
                                f"{self.ctx.max_request_bytes} bytes (--max-request-bytes)") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad(f"the request body is not valid UTF-8 (invalid byte at offset {e.start})") from None
        if not text.strip():
            raise bad("the request body is empty: send a JSON object")
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise bad(f"malformed JSON in the request body: {e.msg} (line {e.lineno}, column {e.colno})") from None
        except RecursionError:
            raise bad("malformed JSON in the request body: nested too deeply") from None

    def _session(self, request: web.Request, req) -> str | None:
        s = req.session_id or request.headers.get("X-Session-Id") or request.headers.get("X-Correlation-ID")
        return self.ctx.check_id(s, "session_id")

    @staticmethod
    def _end_session(request: web.Request, req) -> bool:
        h = request.headers.get("X-Session-End", "").strip().lower()
        if h not in ("", "0", "1", "true", "false"):
            raise bad(f"X-Session-End must be 1 / true or 0 / false, got {h!r}", "X-Session-End")
        return bool(req.end_session) or h in ("1", "true")

    async def _submit(self, subs: list[GenRequest], tenant=ANONYMOUS) -> LimitedStream:
        """Admit against the key's limits (429), then queue in the engine (503 / 500 / 400)."""
        try:
            ticket = self.ctx.limiter.admit(tenant, {s.request_id: len(s.prompt_token_ids) for s in subs})
        except LimitExceeded as e:
            raise ApiError(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        try:
            stream = await self.ctx.client.submit(subs)
        except BaseException as e:
            ticket.close()
            if isinstance(e, QueueFull):
                raise ApiError(503, f"the server is overloaded: {e}; retry later") from None
            if isinstance(e, ServerDraining):
                raise ApiError(503, str(e)) from None
            if isinstance(e, EngineError):
                raise ApiError(500, str(e)) from None
            if isinstance(e, ValueError):
                raise bad(str(e)) from None
            raise
        return LimitedStream(stream, ticket)

    async def _constraint(self, so: StructuredOutputs | None) -> StructuredOutputs | None:
        if so is not None:
            await self.ctx.compile_grammar(so)
        return so

    def _base_id(self, req, prefix: str) -> str:
        return req.request_id or f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def _sub_ids(base: str, count: int) -> list[str]:
        return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]

    def _finished(self, c: fmt.Choice):
        self.ctx.metrics.finished(c.num_prompt, c.num_cached, c.num_output)

    async def _collect(self, stream, by_id: dict[str, fmt.Choice]):
        try:
            async for out in stream:
                c = by_id[out.request_id]
                c.update(out)
                if out.finished:
                    self._finished(c)
        except EngineError as e:
            raise ApiError(500, str(e)) from None
        finally:
            stream.abort()

    @staticmethod
    async def _sse_start(request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _sse_end(resp, error: ApiError | None = None):
        try:
            if error is not None:
                await resp.write(_sse(error.body()))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, request: web.Request):
        ctx = self.ctx
        tenant = request.get(TENANT, ANONYMOUS)
        req: CompletionRequest = parse(CompletionRequest, await self._body(request))
        ctx.check_model(req.model)
        check_ids(req)
        check_logprobs(req.logprobs, "logprobs")
        check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.suffix:
            raise bad("suffix is not supported", "suffix")
        prompts = completion_prompts(req.prompt)
        check_n(req, len(prompts))
        session = tenant.scoped(self._session(request, req))
        end = self._end_session(request, req)
        constraint = await self._constraint(structured_outputs(req))
        want_plp = req.echo and req.logprobs is not None
        plp = req.logprobs if want_plp else None
        if req.prompt_logprobs is not None:
            plp = max(plp or 0, req.prompt_logprobs)
        base = self._base_id(req, "cmpl")
        ids_all = [tenant.scoped(r) for r in self._sub_ids(base, len(prompts) * req.n)]
        subs, choices = [], []
        for i, p in enumerate(prompts):
            ids = ctx.encode(p, add_bos=req.add_special_tokens) if isinstance(p, str) else list(p)
            check_prompt_ids(ids, ctx.vocab_size)
            max_tokens = resolve_max_tokens(req.max_tokens, len(ids), ctx.max_model_len)
            sp = build_sampling_params(req, max_tokens=max_tokens, vocab_size=ctx.vocab_size,
                                       has_tokenizer=ctx.has_tokenizer, logprobs=req.logprobs, prompt_logprobs=plp)
            sp.structured = constraint
            check_budget(constraint, max_tokens)
            text = None
            if req.echo:
                text = p if isinstance(p, str) else ctx.tokenizer.decode(ids)
            for j in range(req.n):
                k = i * req.n + j
                spj = sp if j == 0 or sp.seed is None else _reseed(sp, sp.seed + j)
                subs.append(GenRequest(ids_all[k], ids, spj, session, tenant.salt(req.cache_salt), end))
                choices.append(fmt.Choice(k, ids_all[k], ids, text))
        by_id = {c.request_id: c for c in choices}
        spell = fmt.TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
        stream = await self._submit(subs, tenant)
        opts = dict(echo=req.echo, want_plp=want_plp, logprobs=req.logprobs, plp_n=plp,
                    vllm_plp=req.prompt_logprobs is not None, token_ids=req.return_token_ids)
        if not req.stream:
            await self._collect(stream, by_id)
            body = {"id": base, "object": "text_completion", "created": fmt.now(), "model": ctx.model_name,
                    "choices": [self._completion_choice(c, spell, **opts) for c in choices],
                    "usage": fmt.total_usage(choices, req.n)}
            self._add_metrics(body, choices)
            return web.json_response(body, dumps=_dumps)
        return await self._stream_completions(request, req, stream, choices, by_id, spell, base, opts)

    def _add_metrics(self, body: dict, choices: list[fmt.Choice]) -> dict:
        """vLLM's per-request `metrics` (speculative decoding, --per-request-spec-decode-metrics) when it applies."""
        m = fmt.response_metrics(choices, self.ctx.spec_metrics)
        if m is not None:
            body["metrics"] = m
        return body

    def _completion_choice(self, c: fmt.Choice, spell, *, echo, want_plp, logprobs, plp_n, vllm_plp, token_ids):
        text = (c.prompt_text or "") + c.text if echo else c.text
        lp = None
        if logprobs is not None:
            if want_plp:
                plps = c.prompt_logprobs or [None] * len(c.prompt_ids)
                lp = fmt.legacy_logprobs(spell, c.prompt_ids, plps)
                gen = fmt.legacy_logprobs(spell, c.token_ids, c.logprobs, len(c.prompt_text or ""))
                lp = fmt.merge_legacy(lp, gen)
            else:
                lp = fmt.legacy_logprobs(spell, c.token_ids, c.logprobs)
        out = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
               "stop_reason": c.stop_reason}
        if vllm_plp:
            out["prompt_logprobs"] = fmt.vllm_prompt_logprobs(spell, c.prompt_ids, c.prompt_logprobs, plp_n)
        if token_ids:
            out["prompt_token_ids"] = c.prompt_ids
            out["token_ids"] = c.token_ids
        return out

    async def _stream_completions(self, request, req, stream, choices, by_id, spell, base, opts):
        created, model = fmt.now(), self.ctx.model_name
        so = req.stream_options
        include_usage = bool(so and so.include_usage)
        continuous = bool(so and so.continuous_usage_stats)
        buffered = opts["want_plp"] or opts["vllm_plp"]  # prompt logprobs arrive with the final output

        def chunk(ch: dict, c: fmt.Choice | None = None):
            body = {"id": base, "object": "text_completion", "created": created, "model": model, "choices": [ch]}
            if continuous and c is not None:
                body["usage"] = fmt.usage(c.num_prompt, c.num_output, c.num_cached)
            return _sse(body)

        resp = await self._sse_start(request)
        error = None
        try:
            if req.echo and not buffered:
                for c in choices:
                    await resp.write(chunk({"index": c.index, "text": c.prompt_text, "logprobs": None,
                                            "finish_reason": None, "stop_reason": None}, c))
            offsets = {c.request_id: len(c.prompt_text or "") if req.echo else 0 for c in choices}
            async for out in stream:
                c = by_id[out.request_id]
                c.update(out)
                if out.finished:
                    self._finished(c)
                if buffered:
                    if out.finished:
                        await resp.write(chunk(self._completion_choice(c, spell, **opts), c))
                    continue
                if not (out.new_text or out.finished or (out.new_token_ids and (req.logprobs is not None
                                                                                or opts["token_ids"]))):
                    continue  # tokens whose text is held back (incomplete UTF-8, or a possible stop string)
                lp = None
                if req.logprobs is not None:
                    lp = fmt.legacy_logprobs(spell, out.new_token_ids, out.new_logprobs or [],
                                             offsets[out.request_id])
                    offsets[out.request_id] += sum(len(s) for s in lp["tokens"])
                ch = {"index": c.index, "text": out.new_text, "logprobs": lp,
                      "finish_reason": out.finish_reason if out.finished else None,
                      "stop_reason": out.stop_reason if out.finished else None}
                if opts["token_ids"]:
                    ch["token_ids"] = out.new_token_ids
                await resp.write(chunk(ch, c))
            if include_usage:
                await resp.write(_sse(self._add_metrics({"id": base, "object": "text_completion", "created": created,
                                                         "model": model, "choices": [],
                                                         "usage": fmt.total_usage(choices, req.n)}, choices)))
        except EngineError as e:
            error = ApiError(500, str(e))
        except ConnectionError:  # the client went away mid-stream
            return resp
        finally:
            stream.abort()
        await self._sse_end(resp, error)
        return resp

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat_completions(self, request: web.Request):
        ctx = self.ctx
        tenant = request.get(TENANT, ANONYMOUS)
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await self._body(request))
        ctx.check_model(req.model)
        check_ids(req)
        check_n(req)
        check_logprobs(req.top_logprobs, "top_logprobs")
        check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        mode, fname = tool_choice(req, ctx.auto_tools)
        messages = chat_messages(req)
        constraint = structured_outputs(req)
        if mode in ("required", "named"):
            if constraint is not None:
                raise bad(f"tool_choice {'required' if mode == 'required' else 'with a named function'} cannot be "
                          "combined with response_format or structured outputs", "tool_choice")
            constraint = StructuredOutputs(lark=dsml.tool_call_grammar(req.tools, fname,
                                                                       req.parallel_tool_calls is not False))
        constraint = await self._constraint(constraint)
        session = tenant.scoped(self._session(request, req))
        end = self._end_session(request, req)
        try:
            _, ids = ctx.chat.encode(messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message, tools=req.tools,
                                     kwargs=req.chat_template_kwargs)
        except TemplateError as e:
            raise bad(str(e), "messages") from None
        except ValueError as e:  # tokenizer errors
            raise bad(str(e), "messages") from None
        if req.add_special_tokens and getattr(ctx.tokenizer, "bos_token_id", None) is not None \
                and ids[:1] != [ctx.tokenizer.bos_token_id]:
            ids = [ctx.tokenizer.bos_token_id] + ids
        check_prompt_ids(ids, ctx.vocab_size, "rendered chat prompt")
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = resolve_max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None
                                        else req.max_tokens, len(ids), ctx.max_model_len, field)
        n_top = req.top_logprobs or 0
        sp = build_sampling_params(req, max_tokens=max_tokens, vocab_size=ctx.vocab_size,
                                   has_tokenizer=ctx.has_tokenizer, logprobs=n_top if req.logprobs else None,
                                   prompt_logprobs=req.prompt_logprobs)
        sp.structured = constraint
        check_budget(constraint, max_tokens, field)
        base = self._base_id(req, "chatcmpl")
        rids = [tenant.scoped(r) for r in self._sub_ids(base, req.n)]
        subs = [GenRequest(rids[j], ids, sp if j == 0 or sp.seed is None else _reseed(sp, sp.seed + j), session,
                           tenant.salt(req.cache_salt), end) for j in range(req.n)]
        choices = [fmt.Choice(j, rids[j], ids) for j in range(req.n)]
        by_id = {c.request_id: c for c in choices}
        spell = fmt.TokenText(ctx.tokenizer, req.return_tokens_as_token_ids)
        stream = await self._submit(subs, tenant)
        tools = req.tools if mode != "none" else None
        if not req.stream:
            await self._collect(stream, by_id)
            body = {"id": base, "object": "chat.completion", "created": fmt.now(), "model": ctx.model_name,
                    "choices": [], "usage": fmt.total_usage(choices, req.n)}
            for c in choices:
                content, calls = dsml.parse(c.text, tools) if tools else (c.text, [])
                ch = {"index": c.index, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                      "logprobs": fmt.chat_logprobs(spell, c.token_ids, c.logprobs, n_top) if req.logprobs else None,
                      "finish_reason": _chat_finish(c.finish_reason, calls, mode), "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    ch["token_ids"] = c.token_ids
                body["choices"].append(ch)
            if req.prompt_logprobs is not None:
                body["prompt_logprobs"] = fmt.vllm_prompt_logprobs(spell, ids, choices[0].prompt_logprobs,
                                                                   req.prompt_logprobs)
            if req.return_token_ids:
                body["prompt_token_ids"] = ids
            self._add_metrics(body, choices)
            return web.json_response(body, dumps=_dumps)
        parsers = {c.request_id: dsml.ToolCallStream(tools) for c in choices} if tools else None
        return await self._stream_chat(request, req, stream, choices, by_id, spell, base, n_top, parsers, mode)

    async def _stream_chat(self, request, req, stream, choices, by_id, spell, base, n_top, parsers, mode):
        created, model = fmt.now(), self.ctx.model_name
        so = req.stream_options
        include_usage = bool(so and so.include_usage)
        continuous = bool(so and so.continuous_usage_stats)

        def chunk(ch: dict, c: fmt.Choice):
            body = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [ch]}
            if continuous:
                body["usage"] = fmt.usage(c.num_prompt, c.num_output, c.num_cached)
            return _sse(body)

        resp = await self._sse_start(request)
        error = None
        try:
            for c in choices:
                await resp.write(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}, c))
            async for out in stream:
                c = by_id[out.request_id]
                c.update(out)
                if out.finished:
                    self._finished(c)
                content, calls = out.new_text, []
                if parsers is not None:  # tool calls: content before the DSML block, then call deltas
                    p = parsers[out.request_id]
                    content, calls = p.feed(out.new_text)
                    if out.finished:
                        more, calls2 = p.finish()
                        content, calls = content + more, calls + calls2
                if not (content or calls or out.finished or (out.new_token_ids and req.logprobs)):
                    continue  # text held back (incomplete UTF-8, a possible stop string or tool-call start)
                lp = None
                if req.logprobs:
                    lp = fmt.chat_logprobs(spell, out.new_token_ids, out.new_logprobs or [], n_top)
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = calls
                finish = None
                if out.finished:
                    finish = _chat_finish(out.finish_reason, parsers[out.request_id].calls if parsers else [], mode)
                ch = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                if out.finished:
                    ch["stop_reason"] = out.stop_reason
                await resp.write(chunk(ch, c))
            if include_usage:
                await resp.write(_sse(self._add_metrics({"id": base, "object": "chat.completion.chunk",
                                                         "created": created, "model": model, "choices": [],
                                                         "usage": fmt.total_usage(choices, req.n)}, choices)))
        except EngineError as e:
            error = ApiError(500, str(e))
        except ConnectionError:  # the client went away mid-stream
            return resp
        finally:
            stream.abort()
        await self._sse_end(resp, error)
        return resp


def _chat_finish(reason: str | None, calls: list, mode: str) -> str | None:
    """vLLM: "tool_calls" when auto or required produced calls; a named function keeps "stop"."""
    if calls and mode in ("auto", "required") and reason == "stop":
        return "tool_calls"
    return reason


def _reseed(sp, seed: int):
    from dataclasses import replace

    return replace(sp, seed=seed % (2 ** 63))


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)
