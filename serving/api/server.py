"""Server assembly and lifecycle: one process, one asyncio loop serving HTTP (aiohttp) and gRPC (grpc.aio)
over one engine thread.

    engine = Engine(...)
    asyncio.run(serve(engine, ServerConfig(port=8000, grpc_port=50051)))

Shutdown (SIGTERM / SIGINT, or `ApiServer.shutdown()`), a graceful drain: new requests get 503 / UNAVAILABLE
and health turns NOT_SERVING (`GET /health` 503) while the listeners stay open, so a router's health probe sees
the drain and stops routing here; once the engine has no unfinished request (or `shutdown_timeout` seconds
have passed) the listening sockets close, the responses still being written get the rest of the timeout
(then they are cancelled, which aborts them in the engine), and the engine thread stops.

Security (serving/api/security.py): API keys for both APIs, TLS (optionally mutual) for both listeners, per-key
limits; `start()` logs a warning when it listens on a non-loopback address without an API key.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from dataclasses import dataclass, field

from aiohttp import web

from serving.api.chat_template import ChatTemplate
from serving.api.context import ServerContext
from serving.api.engine_client import EngineClient, EngineLoop
from serving.api.grpc_server import SERVICE, GrpcApi
from serving.api.http_server import HttpApi
from serving.api.metrics import ApiMetrics
from serving.api.security import ApiKeys, KeyLimiter, exposure_warning, grpc_credentials, server_ssl_context

log = logging.getLogger("serving.api")
TOOL_PARSERS = ("deepseek_v41",)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP; 0 picks a free port, < 0 disables HTTP
    grpc_port: int = 50051  # 0 picks a free port, < 0 disables gRPC
    served_model_name: str | None = None  # default: the model config's name
    aliases: set[str] = field(default_factory=set)  # other accepted values of the `model` field
    chat_template: str | None = None  # a file or a literal Jinja template (default: tokenizer's / built-in)
    max_request_bytes: int = 0  # 0: max(1 MiB, 32 bytes per token of max_model_len)
    shutdown_timeout: float = 30.0
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses tool calls (needs tool_call_parser)
    tool_call_parser: str | None = None  # deepseek_v41
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    protect_metrics: bool = False  # /metrics needs a key too
    ssl_certfile: str | None = None  # TLS for HTTP and gRPC (with ssl_keyfile)
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # client certificates signed by this CA are required (mutual TLS)
    max_requests_per_key: int = 0  # open requests per API key (0: no cap)
    max_queued_tokens_per_key: int = 0  # queued prompt tokens per API key (0: no cap)
    per_request_spec_decode_metrics: str = "none"  # none | summary | detailed (vLLM's flag)

    @property
    def tls(self) -> bool:
        return bool(self.ssl_certfile)


def _listen(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ApiServer:
    def __init__(self, engine, config: ServerConfig | None = None):
        self.config = config = config or ServerConfig()
        self.engine_loop = EngineLoop(engine)
        self.client = EngineClient(self.engine_loop)
        name = config.served_model_name or engine.cfg.name
        engine.set_served_model_name(name)  # label the engine's metrics with the served name
        max_bytes = config.max_request_bytes or max(1 << 20, 32 * engine.args.max_model_len)
        if config.enable_auto_tool_choice and config.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)})")
        if bool(config.ssl_certfile) != bool(config.ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if config.ssl_ca_certs and not config.ssl_certfile:
            raise ValueError("--ssl-ca-certs (mutual TLS) needs --ssl-certfile and --ssl-keyfile")
        self.ctx = ServerContext(self.client, ChatTemplate(engine.tokenizer, config.chat_template),
                                 ApiMetrics(name, engine.args.max_model_len), name, set(config.aliases) - {name},
                                 max_bytes, auto_tools=config.enable_auto_tool_choice,
                                 api_keys=ApiKeys(config.api_keys), protect_metrics=config.protect_metrics,
                                 limiter=KeyLimiter(config.max_requests_per_key, config.max_queued_tokens_per_key),
                                 spec_metrics=config.per_request_spec_decode_metrics)
        self.http = HttpApi(self.ctx)
        self.grpc = GrpcApi(self.ctx)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._runner: web.AppRunner | None = None
        self._grpc_server = None
        self._closing = False
        self._stopped: asyncio.Event | None = None

    @property
    def http_url(self) -> str | None:
        if self.http_port is None:
            return None
        h = self.config.host
        return f"{'https' if self.config.tls else 'http'}://{_grpc_host(h)}:{self.http_port}"

    @property
    def grpc_target(self) -> str | None:
        return None if self.grpc_port is None else f"{_grpc_host(self.config.host)}:{self.grpc_port}"

    async def start(self):
        cfg = self.config
        self._stopped = asyncio.Event()
        warning = exposure_warning(cfg.host, self.ctx.api_keys)
        if warning:
            log.warning(warning)
            print(warning, file=sys.stderr, flush=True)
        ssl_ctx = server_ssl_context(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs) if cfg.tls else None
        self.engine_loop.start()
        try:
            if cfg.port >= 0:
                self._runner = web.AppRunner(self.http.app(), handler_cancellation=True, access_log=None,
                                             shutdown_timeout=cfg.shutdown_timeout)
                await self._runner.setup()
                try:
                    sock = _listen(cfg.host, cfg.port)
                except OSError as e:
                    raise OSError(f"cannot listen for HTTP on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
                self.http_port = sock.getsockname()[1]
                await web.SockSite(self._runner, sock, ssl_context=ssl_ctx).start()
            if cfg.grpc_port >= 0:
                self._grpc_server = self.grpc.server(self.ctx.max_request_bytes)
                addr = f"{_grpc_host(cfg.host)}:{cfg.grpc_port}"
                try:
                    if cfg.tls:
                        creds = grpc_credentials(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs)
                        self.grpc_port = self._grpc_server.add_secure_port(addr, creds)
                    else:
                        self.grpc_port = self._grpc_server.add_insecure_port(addr)
                except RuntimeError as e:
                    raise OSError(f"cannot listen for gRPC on {addr}: {e}") from None
                await self._grpc_server.start()
                await self.grpc.set_serving(True)
        except BaseException:
            await self._close(0)
            raise
        return self

    async def shutdown(self, timeout: float | None = None):
        """Stop accepting, let in-flight requests finish (bounded), stop the engine thread."""
        if self._closing:
            return
        self._closing = True
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        log.info("shutting down: draining in-flight requests (up to %.0f s)", timeout)
        self.client.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._grpc_server is not None:
            try:
                await self.grpc.set_serving(False)
            except Exception:  # noqa: BLE001
                log.exception("setting gRPC health to NOT_SERVING failed")
        while loop.time() < deadline and await self._engine_busy():
            await asyncio.sleep(0.05)
        await self._close(max(deadline - loop.time(), 0.0))

    async def _engine_busy(self) -> bool:
        """The engine still has unfinished requests (False when its loop is gone or does not answer)."""
        if not self.engine_loop.alive:
            return False
        try:
            return await asyncio.wait_for(self.client.call(lambda e: e.has_unfinished()), 5.0)
        except Exception:  # noqa: BLE001 - a dead or stuck loop: stop waiting for it
            return False

    async def _close(self, timeout: float):
        self.client.draining = True
        tasks = []
        if self._grpc_server is not None:
            try:
                await self.grpc.set_serving(False)
            except Exception:  # noqa: BLE001
                log.exception("setting gRPC health to NOT_SERVING failed")
            tasks.append(self._grpc_server.stop(timeout))
        if self._runner is not None:
            tasks.append(self._runner.cleanup())
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, BaseException):
                log.warning("error while closing a listener: %r", r)
        self.engine_loop.stop()  # joins the engine thread (it is between steps: everything is drained)
        if self._stopped is not None:
            self._stopped.set()

    async def wait_closed(self):
        await self._stopped.wait()


def ready_lines(server: ApiServer) -> list[str]:
    """The lines printed when the server is ready (tests and the notebook parse them)."""
    out = []
    if server.http_url:
        out.append(f"HTTP server listening on {server.http_url} (OpenAI API: {server.http_url}/v1)")
    if server.grpc_target:
        tls = ", TLS" if server.config.tls else ""
        out.append(f"gRPC server listening on {server.grpc_target} ({SERVICE}, health, reflection{tls})")
    return out


async def serve(engine, config: ServerConfig | None = None, *, install_signals: bool = True) -> int:
    """Run until SIGTERM / SIGINT (or shutdown()); returns the exit status."""
    server = ApiServer(engine, config)
    await server.start()
    loop = asyncio.get_running_loop()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (log.info("received %s", signal.Signals(s).name),
                                                        asyncio.ensure_future(server.shutdown())))
    for line in ready_lines(server):
        print(line, flush=True)
    sys.stdout.flush()
    await server.wait_closed()
    log.info("server stopped")
    return 0
