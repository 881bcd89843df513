"""The engine loop (one dedicated thread) and the asyncio client that the HTTP and gRPC servers share.

The engine is single-threaded: only the loop thread ever touches it. The servers talk to it through a
thread-safe command queue, and the loop thread answers through per-request sinks:

    server coroutine --submit/abort/call--> command queue --> engine thread: add_request / abort / step()
    server coroutine <--RequestOutput------ asyncio.Queue <-- loop.call_soon_threadsafe (engine callbacks)

The loop blocks on the command queue while the engine is idle, and otherwise drains it between steps.

Failure isolation (nothing a client sends may kill the engine thread):
- every command runs inside try/except: an `add_request` that raises fails only that submission
  (ValueError -> bad input, QueueFull -> overload, anything else -> EngineError);
- callbacks only hand outputs to the event loop and never raise into the engine;
- if `step()` raises, the requests that step had scheduled are aborted in the engine and failed with
  EngineError (if it raised before its schedule was known, the head of the waiting queue, whose admission
  is the likely cause); every other request carries on. After `max_consecutive_failures` failing steps in
  a row the loop reports itself unhealthy (`/health` 503, gRPC NOT_SERVING).
- a RequestOutput with `error` set fails just that request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

from serving.engine.engine import QueueFull
from serving.engine.types import RequestOutput, SamplingParams

log = logging.getLogger("serving.api.engine")

__all__ = ["EngineLoop", "EngineClient", "GenRequest", "OutputStream", "EngineError", "ServerDraining",
           "QueueFull"]


class EngineError(RuntimeError):
    """The engine failed this request (HTTP 500 / INTERNAL)."""


class ServerDraining(RuntimeError):
    """The server is shutting down and accepts no new requests (HTTP 503 / UNAVAILABLE)."""


@dataclass
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    cache_salt: str | None = None
    end_session: bool = False


class _Sink:
    """Delivers one submission's admission result and outputs to an asyncio loop (thread-safe, never raises)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admitted: asyncio.Future = loop.create_future()

    def _call(self, fn, *args):
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def admit(self, exc: BaseException | None):
        def done():
            if not self.admitted.done():
                if exc is None:
                    self.admitted.set_result(None)
                else:
                    self.admitted.set_exception(exc)

        self._call(done)

    def put(self, item):  # a RequestOutput, or an EngineError for one request
        self._call(self.queue.put_nowait, item)


class EngineLoop:
    """Owns the engine and runs it on one dedicated thread."""

    def __init__(self, engine, *, max_consecutive_failures: int = 3):
        self.engine = engine
        self.max_consecutive_failures = max_consecutive_failures
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # request id -> sink (loop thread only)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.consecutive_failures = 0
        self.step_failures = 0
        self.steps = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle (any thread)
    def start(self):
        self._thread.start()

    def stop(self, timeout: float = 10.0):
        self._stop.set()
        self._cmds.put(None)  # wake the loop
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.alive and self.consecutive_failures < self.max_consecutive_failures

    # ------------------------------------------------------------------ commands (any thread)
    def post(self, fn):
        """Run fn() on the loop thread (exceptions are logged, never raised there)."""
        self._cmds.put(fn)

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the loop thread; the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cmd():
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self.post(cmd)
        return fut

    def add(self, reqs: list[GenRequest], sink: _Sink):
        self.post(lambda: self._add(reqs, sink))

    def abort(self, request_ids):
        ids = list(request_ids)
        self.post(lambda: [self._abort(r) for r in ids])

    # ------------------------------------------------------------------ the loop (engine thread)
    def _run(self):
        eng = self.engine
        while not self._stop.is_set():
            busy = eng.has_unfinished()
            try:
                cmd = self._cmds.get_nowait() if busy else self._cmds.get()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._exec(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stop.is_set():
                break
            if eng.has_unfinished():
                self._step()
        # shutting down: fail whatever is still open so no client waits forever
        for rid in list(self._sinks):
            self._fail(rid, EngineError("the server shut down before this request finished"))

    def _exec(self, cmd):
        try:
            cmd()
        except Exception:  # noqa: BLE001 - a command must never kill the loop
            log.exception("engine command failed")

    def _add(self, reqs: list[GenRequest], sink: _Sink):
        added = []
        for r in reqs:
            try:
                if r.request_id in self._sinks:  # never steal a running request's sink
                    raise ValueError(f"request_id {r.request_id!r} is already in use")
                self._sinks[r.request_id] = sink  # before add_request: max_tokens=0 emits from inside it
                self.engine.add_request(r.request_id, r.prompt_token_ids, r.params, session_id=r.session_id,
                                        cache_salt=r.cache_salt, callback=self._deliver,
                                        end_session=r.end_session)
            except Exception as e:  # noqa: BLE001
                if self._sinks.get(r.request_id) is sink:
                    del self._sinks[r.request_id]
                for rid in added:  # all or nothing: undo the ones already queued
                    self._sinks.pop(rid, None)
                    self._safe_abort(rid)
                if not isinstance(e, (ValueError, QueueFull)):
                    log.exception("add_request failed unexpectedly for %s", r.request_id)
                    e = EngineError(f"the engine could not accept the request: {type(e).__name__}: {e}")
                sink.admit(e)
                return
            added.append(r.request_id)
        sink.admit(None)

    def _deliver(self, out: RequestOutput):
        try:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                return
            if out.finished:
                del self._sinks[out.request_id]
            if out.error:
                self._sinks.pop(out.request_id, None)
                self._safe_abort(out.request_id)
                sink.put(EngineError(f"request {out.request_id} failed: {out.error}"))
                return
            sink.put(out)
        except Exception:  # noqa: BLE001 - never raise into the engine
            log.exception("delivering an output failed")

    def _safe_abort(self, rid: str):
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001
            log.exception("engine.abort(%s) failed", rid)

    def _abort(self, rid: str):
        self._safe_abort(rid)  # emits the final 'abort' output through the callback

    def _fail(self, rid: str, err: EngineError):
        sink = self._sinks.pop(rid, None)
        self._safe_abort(rid)
        if sink is not None:
            sink.put(err)

    def _victims(self) -> list[str]:
        view = self.engine.inspect()
        if view.step_requests:  # the failure came while running (or collecting) these
            return list(view.step_requests)
        if view.step_requests is None and view.waiting:  # raised while scheduling: most likely admitting the head
            return [view.waiting[0]]
        return list(view.running) or list(self._sinks)

    def _step(self):
        try:
            self.engine.step()
            self.steps += 1
            self.consecutive_failures = 0
        except Exception as e:  # noqa: BLE001 - isolate: fail the culprits, keep serving the others
            self.step_failures += 1
            self.consecutive_failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("engine step failed (%d in a row)", self.consecutive_failures)
            victims = self._victims()
            err = EngineError(f"the engine failed while running this request: {self.last_error}")
            for rid in victims:
                self._fail(rid, err)
            if not victims:
                time.sleep(0.1)  # nothing to blame: do not spin


class OutputStream:
    """Async iterator over the RequestOutputs of one submission (one or more engine requests)."""

    def __init__(self, client: EngineClient, ids: list[str], sink: _Sink):
        self._client = client
        self.request_ids = ids
        self._sink = sink
        self._open = set(ids)

    @property
    def finished(self) -> bool:
        return not self._open

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return item

    def abort(self):
        """Abort the unfinished requests (idempotent; call it in a finally block)."""
        if self._open:
            self._client.loop.abort(self._open)
            self._open = set()


class EngineClient:
    """What the servers use: async submit, abort, engine calls, draining state and in-flight count."""

    def __init__(self, engine_loop: EngineLoop):
        self.loop = engine_loop
        self.engine = engine_loop.engine
        self.draining = False
        self.in_flight = 0  # open submissions (event-loop thread only)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def healthy(self) -> bool:
        return self.loop.healthy and not self.draining

    async def submit(self, reqs: list[GenRequest]) -> OutputStream:
        """Queue the requests (all or none). Raises ValueError, QueueFull, ServerDraining or EngineError."""
        if self.draining:
            raise ServerDraining("the server is shutting down")
        if not self.loop.alive:
            raise EngineError("the engine loop is not running")
        sink = _Sink(asyncio.get_running_loop())
        self.loop.add(reqs, sink)
        try:
            await sink.admitted
        except asyncio.CancelledError:  # the client went away while we waited: undo
            self.loop.abort([r.request_id for r in reqs])
            raise
        return OutputStream(self, [r.request_id for r in reqs], sink)

    def abort(self, request_id: str):
        self.loop.abort([request_id])

    async def call(self, fn):
        """Run fn(engine) on the engine thread and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))
