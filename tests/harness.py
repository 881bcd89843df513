"""Test harnesses: API servers the tests share (subprocess servers: serving/spawn.py).

- `BackgroundServer(engine, config)`: the API server on its own event-loop thread in this process (the
  engine object stays reachable for white-box checks). `start()` returns once both ports listen.
- `shared_test_server()` / `shared_long_server()`: one such server per test process (tiny weights, small
  shapes; the second with a 2048-token context and tool calling), each started on first use.
- `small_server_args()`: the `python -m serving.run` flags of the shared server's shapes (compilation-cache hits).
- `EXACT_ENGINE_ARGS`: the exact-mode engine shapes that test files share (with the f32 `tiny32` config).
- `DEFAULT_MODEL_ENGINE_ARGS`: the shapes of the default model's engine in the files that generate with it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

from bench.greedy_loops import ENGINE_ARGS
from serving.api.server import ApiServer, ServerConfig
from serving.engine.config import SMALL_ENGINE_ARGS, shared_cache_dir


class BackgroundServer:
    def __init__(self, engine, config: ServerConfig | None = None):
        self.server = ApiServer(engine, config or ServerConfig(port=0, grpc_port=0))
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def http_url(self) -> str:
        return self.server.http_url

    @property
    def grpc_target(self) -> str:
        return self.server.grpc_target

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        def run():
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.server.start())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            loop.run_until_complete(self.server.wait_closed())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="api-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the API server did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the API server failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout: float = 10.0):
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.shutdown(timeout), self._loop)
        fut.result(timeout + 10)
        self._thread.join(timeout + 10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------------------------------- shared shapes
# Engines built with the same config and EngineArgs shapes compile the same programs: the second build is a
# persistent-compilation-cache hit (the cache is shared by the xdist workers and the servers' subprocesses).
# The exact-mode engine (--no-swa-bounded-replay: SWA snapshots instead of replay), f32 with every quantize-dequantize
# point off (conftest's `tiny32`): several prefill and decode buckets (bucket choice, one program per bucket).
EXACT_ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, prefill_buckets=(32, 64),
                         decode_buckets=(2, 4), swa_bounded_replay=False, enable_prompt_logprobs=False)
# The embedded default model's engine in the tests that generate with it (held-out continuations, forced tool
# calls) and in bench/greedy_loops.py, which defines it (bench may not import tests): one set of shapes, so the
# second file's build is a cache hit. 10 lanes, chat prompts with tools fit.
DEFAULT_MODEL_ENGINE_ARGS = ENGINE_ARGS


# ---------------------------------------------------------------------------------------------- shared test server
def small_server_args() -> list[str]:
    """`python -m serving.run` flags equal to SMALL_ENGINE_ARGS (same programs: compilation-cache hits)."""
    a = SMALL_ENGINE_ARGS
    return ["--model", "tiny", "--max-model-len", str(a["max_model_len"]), "--max-num-seqs", str(a["max_num_seqs"]),
            "--max-num-batched-tokens", str(a["max_num_batched_tokens"]),
            "--prefill-buckets", ",".join(map(str, a["prefill_buckets"])),
            "--decode-buckets", ",".join(map(str, a["decode_buckets"])), "--compilation-cache-dir", shared_cache_dir()]


_shared: BackgroundServer | None = None
_shared_lock = threading.Lock()


def _use_shared_cache() -> str:
    """The persistent compilation cache of the test servers, set before their weights are made (so the init
    program is cached too; JAX keeps one persistent cache per process)."""
    import jax

    cache = shared_cache_dir()
    os.makedirs(cache, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # programs, not eager ops
    return cache


def shared_test_server() -> BackgroundServer:
    """One in-process server (tiny preset, byte tokenizer) per test process, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import atexit

            from serving.engine.config import EngineArgs
            from serving.engine.engine import Engine, load_model

            cache = _use_shared_cache()
            cfg, params = load_model("tiny")
            engine = Engine(cfg, EngineArgs(**SMALL_ENGINE_ARGS, compilation_cache_dir=cache), params=params,
                            progress=False)
            _shared = BackgroundServer(engine, ServerConfig(port=0, grpc_port=0, served_model_name="tiny",
                                                            shutdown_timeout=5)).start()
            atexit.register(_shared.stop)
        return _shared


# A second in-process server for prompts longer than the shared one allows (the DeepSeek-V4.1 tool preamble is
# ~1.5k tokens with the byte tokenizer): the tiny model with a 2048-token context, tool calling on.
LONG_ENGINE_ARGS = dict(SMALL_ENGINE_ARGS, max_model_len=2048, decode_buckets=(4,), max_num_seqs=4,
                        enable_prompt_logprobs=False)
_long: BackgroundServer | None = None


def shared_long_server() -> BackgroundServer:
    """One in-process server (tiny weights, 2048-token context, byte tokenizer, auto tool choice) per process."""
    global _long
    with _shared_lock:
        if _long is None:
            import atexit

            from dsv41_jax.config import ModelConfig
            from serving.engine.config import EngineArgs
            from serving.engine.engine import Engine, load_model

            _use_shared_cache()
            cfg = ModelConfig.preset("tiny", max_seq_len=LONG_ENGINE_ARGS["max_model_len"])
            cfg, params = load_model(cfg)
            engine = Engine(cfg, EngineArgs(**LONG_ENGINE_ARGS, compilation_cache_dir=shared_cache_dir()),
                            params=params, progress=False)
            _long = BackgroundServer(engine, ServerConfig(port=0, grpc_port=-1, served_model_name="tiny",
                                                          shutdown_timeout=5, enable_auto_tool_choice=True,
                                                          tool_call_parser="deepseek_v41")).start()
            atexit.register(_long.stop)
        return _long


def server_stats(server):
    """Engine statistics of an in-process test server (read on the engine thread)."""
    from serving.api.context import engine_stats

    return server.server.client.loop.call(engine_stats).result(30)


def wait_idle(server, timeout: float = 30.0):
    """Poll the engine until nothing runs and no page is referenced."""
    deadline = time.monotonic() + timeout
    while True:
        s = server_stats(server)
        if s["requests"]["running"] == 0 and s["requests"]["waiting"] == 0 and s["pages"]["referenced"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)
