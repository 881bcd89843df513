"""The step-level engine: add_request / step / abort over the scheduler, the page pool and the runner.

One thread drives `step()`; `add_request` and `abort` may be called between steps (the API servers call
them from the same thread through a queue). Bad input raises ValueError (or QueueFull) before anything
reaches the scheduler, so a bad request never disturbs the others. The API reads engine state only through
`stats()` and `inspect()`.

A step, pipelined so the host overlaps the device:
1. collect the previous step's sampled tokens (one packed device-to-host copy per program, started right after
   its dispatch): append them, check stop ids / strings / lengths (finished requests release their pages);
2. schedule the next step (chunk plans) and dispatch it: the decode batch first, then the prefill chunks, so
   preparing the chunks' inputs on the host overlaps the decode on the device;
3. while the device runs it, emit the outputs collected in 1 (incremental detokenization, callbacks).
`step()` therefore returns the outputs of the step dispatched by the previous call; `has_unfinished()` counts
a dispatched step until it is collected.

Seeds: a request without a seed gets one drawn from a generator seeded by `--seed`, in arrival order, so the
same sequence of requests after a restart gives the same outputs (as vLLM).

Failures: a program call that raises fails only the requests it carried (their final output has `error`).
If the failure consumed the donated device pools (or left them in an error state), the runner rebuilds them,
the prefix cache and snapshots are dropped (their bytes are gone), and every other running request is
preempted and recomputed from its tokens: no later step reads poisoned state.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.kv_format import pages_for
from serving.engine.block_hash import BLOCK
from serving.engine.chunk_plan import ChunkPlan
from serving.engine.config import EngineArgs
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.metrics import Metrics
from serving.engine.page_pool import PagePool
from serving.engine.request import FINISHED, Request
from serving.engine.runner import Runner
from serving.engine.scheduler import Scheduler
from serving.engine.snapshots import SnapshotIndex
from serving.engine.step_io import DECODE, PendingOutputs, ProgramKey, StepOutputs
from serving.engine.types import RequestOutput, SamplingParams

log = logging.getLogger("serving.engine")


class QueueFull(RuntimeError):
    """Too many queued requests (HTTP 503 / RESOURCE_EXHAUSTED)."""


def load_model(model, seed: int = 0, weight_format: str | None = None):
    """A preset name, a ModelConfig (random weights built on device), or a checkpoint directory (HF or orbax)."""
    import checkpoints

    if isinstance(model, ModelConfig):
        cfg = model
    elif isinstance(model, str) and not os.path.isdir(model):
        cfg = ModelConfig.preset(model)
    else:
        return checkpoints.load(model, weight_format=weight_format)
    return cfg, checkpoints.random_init(cfg, seed)


@dataclass
class _Call:
    """One dispatched program call and the plans it carried."""
    plans: list[ChunkPlan]
    pending: PendingOutputs | None


@dataclass
class _InFlight:
    calls: list[_Call] = field(default_factory=list)

    def requests(self) -> list[Request]:
        return [p.req for c in self.calls for p in c.plans]


@dataclass(frozen=True)
class EngineInspect:
    """A consistent view of the engine's queues (read on the engine thread)."""
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    step_requests: tuple[str, ...] | None  # requests of the step being built/run (None: not scheduled yet)


class Engine:
    def __init__(self, model="tiny", args: EngineArgs | None = None, *, params=None, tokenizer=None,
                 token_map=None, progress: bool = True, served_model_name: str | None = None, programs=None,
                 **engine_kw):
        """`programs(key) -> bool` compiles only some programs (benchmarks); the rest raise KeyError if used."""
        args = args or EngineArgs(**engine_kw)
        if args.compilation_cache_dir:  # before anything compiles, the weight init included
            jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # programs, not eager ops
        if params is None:
            cfg, params = load_model(model, args.seed)
        else:
            cfg = model if isinstance(model, ModelConfig) else ModelConfig.preset(model)
        self.cfg = cfg
        self.args = args.resolved(cfg)
        if tokenizer is None:
            from serving.tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer(cfg.vocab_size) if cfg.vocab_size >= 256 else None
        self.tokenizer = tokenizer
        eos = set(self.args.eos_token_ids)
        if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = {tokenizer.eos_token_id}
        self.eos_ids = eos
        self.metrics = Metrics(served_model_name or cfg.name)
        self.pool = PagePool(self.args.num_pages, self.args.enable_prefix_caching, self.args.session_ttl_s)
        self.snapshots = None if self.args.swa_bounded_replay else SnapshotIndex(self.args.snapshot_slots)
        self.max_pages = pages_for(self.args.max_model_len)
        self.runner = Runner(cfg, params, self.args, self.max_pages)
        self.warmup_s = self.runner.compile_all(progress, keep=programs)
        self.metrics.set("compiled_programs", self.runner.compile_count)
        self.metrics.set("snapshot_bytes", sum(v for k, v in self.runner.pool_bytes().items() if k.startswith("snap")))
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        self.scheduler = Scheduler(self.args, self.pool, cfg.window_size, self.snapshots, self.metrics)
        self.requests: dict[str, Request] = {}
        self._seeds = np.random.default_rng(self.args.seed)
        self._inflight: _InFlight | None = None
        self._step_requests: list[str] | None = None
        self._grammars = None  # structured outputs: a GrammarCompiler, made on first use
        self.host_time = {"steps": 0, "wait_s": 0.0, "step_s": 0.0}  # wall time in step() and waiting on results

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None = None, *,
                    session_id: str | None = None, cache_salt: str | None = None, callback=None):
        sp = sampling_params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        V = self.cfg.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < V:
                raise ValueError(f"token id {t!r} is not in the vocabulary [0, {V})")
        sp.validate(V)
        if sp.prompt_logprobs is not None and not self.args.enable_prompt_logprobs:
            raise ValueError("prompt_logprobs is disabled on this server (EngineArgs.enable_prompt_logprobs)")
        limit = self.args.max_model_len
        if len(ids) + max(sp.max_tokens, 1) > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens; the request has "
                             f"{len(ids)} prompt tokens and max_tokens={sp.max_tokens}")
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are already queued")
        grammar = self._grammar_state(sp) if sp.structured is not None else None  # GrammarError: ValueError
        # every accepted request draws from the seed stream (arrival order), seeded or not
        drawn = int(self._seeds.integers(0, 2 ** 32))
        seed = (sp.seed if sp.seed is not None else drawn) & 0xFFFFFFFF
        req = Request(request_id, [int(t) for t in ids], len(ids), sp, session_id, cache_salt, callback=callback,
                      seed=seed)
        req.out.grammar = grammar  # structured outputs: advanced in _append, masks the sampler in _fill_row
        special = set(sp.stop_token_ids) | (self.eos_ids if not sp.ignore_eos else set())
        req.out.detok = IncrementalDetokenizer(self.tokenizer, skip_ids=special, stop=sp.stop,
                                               include_stop=sp.include_stop_str_in_output)
        self.requests[request_id] = req
        self.metrics.inc("prompt_tokens", len(ids))
        if sp.max_tokens == 0 and sp.prompt_logprobs is None:
            self._finish(req, "length", emit=True)
            return
        self.scheduler.waiting.append(req)
        self._update_gauges()

    def _grammar_state(self, sp: SamplingParams):
        """A fresh grammar state for a structured-output request (compiled here unless the API did it)."""
        from serving.engine.structured import GrammarCompiler

        if sp.structured.compiled is None or sp.structured.compiled.vocab_size != self.cfg.vocab_size:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.eos_ids)
            self._grammars.compile(sp.structured)
        return sp.structured.compiled.new_state()

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status == FINISHED:
            return False
        self._finish(req, "abort", emit=True)
        self.metrics.inc("requests_aborted")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._inflight is not None)

    # ------------------------------------------------------------------ public state (for the API)
    def set_served_model_name(self, name: str):
        """The model name that labels the engine's Prometheus metrics."""
        self.metrics.model_name = name

    def inspect(self) -> EngineInspect:
        return EngineInspect(tuple(r.request_id for r in self.scheduler.running),
                             tuple(r.request_id for r in self.scheduler.waiting),
                             None if self._step_requests is None else tuple(self._step_requests))

    def stats(self) -> dict:
        """Page pool, queue and metric state (JSON-serialisable)."""
        pool = self.pool
        return {
            "pages": {"total": pool.num_pages - 1, "free": pool.num_free(),
                      "referenced": int((pool.ref[1:] > 0).sum()), "cached": len(pool.hash_of)},
            "requests": {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                         "tracked": len(self.requests)},
            "metrics": self.metrics.snapshot(),
        }

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Collect the step in flight, dispatch the next one, emit the collected outputs (module docstring).
        A failing program call fails only the requests it carried."""
        t0 = time.perf_counter()
        touched: list[Request] = []
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._step_requests = [r.request_id for r in inflight.requests()]
            touched += self._collect(inflight)
        self._step_requests = None  # scheduling: not known yet
        plans = self.scheduler.schedule()
        self._step_requests = [p.req.request_id for p in plans]
        if plans:
            self._inflight = self._dispatch(plans)
            touched += [p.req for p in plans if not p.sample]  # non-sampling chunks: nothing to wait for
        outs, seen = [], set()
        for req in touched:
            if req.request_id in seen:
                continue
            seen.add(req.request_id)
            o = self._emit(req)
            if o is not None:
                outs.append(o)
        self._update_gauges()
        self.host_time["steps"] += 1
        self.host_time["step_s"] += time.perf_counter() - t0
        return outs

    def _update_gauges(self):
        self.metrics.set("running", len(self.scheduler.running))
        self.metrics.set("waiting", len(self.scheduler.waiting))
        self.metrics.set("kv_usage", self.pool.usage())

    def _dispatch(self, plans: list[ChunkPlan]) -> _InFlight:
        inflight = _InFlight()
        for p in plans:
            s = p.req.sched
            if s.restore_snapshot is not None:
                self._guarded(inflight, [p], lambda s=s: self.runner.snapshot(False, s.restore_snapshot, s.slot))
                s.restore_snapshot = None
        decode = [p for p in plans if p.is_decode and p.req.status != FINISHED]
        if decode:
            self._guarded(inflight, decode, lambda: self._run_decode(decode))
        for p in plans:
            if not p.is_decode and p.req.status != FINISHED:
                self._guarded(inflight, [p], lambda p=p: self._run_chunk(p))
        return inflight

    def _guarded(self, inflight: _InFlight, plans: list[ChunkPlan], fn):
        try:
            inflight.calls.append(_Call(plans, fn()))
        except Exception as e:  # noqa: BLE001 - isolate the failure to these requests
            self._fail([p.req for p in plans], e)

    def _fail(self, reqs: list[Request], e: BaseException):
        """Fail `reqs`; if the device pools did not survive, rebuild them and recompute everyone else."""
        log.error("a program call failed for %s: %s: %s", [r.request_id for r in reqs], type(e).__name__, e)
        for r in reqs:
            if r.status != FINISHED:
                r.out.error = f"{type(e).__name__}: {e}"
                self._finish(r, "abort", emit=True)
        if self._pools_healthy():
            return
        log.error("the device pools were lost: rebuilding them; running requests are recomputed")
        self.runner.reset_pools()
        self.pool.drop_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        for r in list(self.scheduler.running):
            self.scheduler.preempt(r)

    def _pools_healthy(self) -> bool:
        if self.runner.pools_lost():
            return False
        try:
            jax.block_until_ready(self.runner.pools)
            return True
        except Exception:  # noqa: BLE001 - an asynchronous failure left the buffers in an error state
            return False

    def _collect(self, inflight: _InFlight) -> list[Request]:
        touched = []
        for call in inflight.calls:
            if call.pending is None:
                continue
            t0 = time.perf_counter()
            try:
                out = call.pending.get()
            except Exception as e:  # noqa: BLE001 - an asynchronous device failure surfaced here
                self._fail([p.req for p in call.plans], e)
                continue
            finally:
                self.host_time["wait_s"] += time.perf_counter() - t0
            for i, p in enumerate(call.plans):
                req = p.req
                touched.append(req)
                if req.status == FINISHED:  # aborted while in flight
                    continue
                if p.all_logits:
                    self._prompt_logprobs(req, p, out)
                if p.sample:
                    if req.sampling.max_tokens == 0:  # prompt logprobs only
                        self._finish(req, "length")
                    else:
                        self._append(req, out, i)
        return touched

    def _hash_ids(self, req: Request, pos0: int, toks: np.ndarray):
        if self.hasher is None:
            return None
        h = self.hasher.n - 1
        hist = np.full((1, h), -1, np.int64)
        prev = req.tokens[max(pos0 - h, 0):pos0]
        if prev:
            hist[0, h - len(prev):] = self.hasher.compress(np.asarray(prev))
        return self.hasher.hash_ids(toks, hist)

    def _fill_row(self, inp, i: int, p: ChunkPlan):
        """Row i of a program's inputs from a chunk plan."""
        req, c, sm = p.req, inp.chunk, inp.sampling
        inp.slots[i] = req.sched.slot
        pages = req.sched.pages
        inp.page_table[i, :len(pages)] = pages
        c.tokens[i, :p.n] = req.tokens[p.pos0:p.end]
        if c.engram_ids is not None:
            c.engram_ids[i] = self._hash_ids(req, p.pos0, c.tokens[i:i + 1])[0]
        c.pos0[i], c.n_valid[i] = p.pos0, p.n
        c.enc_clip[i], c.dec_clip[i], c.write_from[i] = p.enc_clip, p.dec_clip, p.write_from
        sp = req.sampling
        sm.temperature[i], sm.top_k[i], sm.top_p[i], sm.min_p[i] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        sm.seed[i], sm.counter[i] = req.seed, req.counter
        grammar = req.out.grammar
        if grammar is not None and p.sample:  # the grammar state is current: the last token was collected
            grammar.fill(sm.allowed[i])
        if sm.next_ids is not None:
            nxt = req.tokens[p.pos0 + 1:p.end + 1]
            sm.next_ids[i, :len(nxt)] = nxt

    def _advance(self, p: ChunkPlan):
        """Host-side progress once a chunk is dispatched: positions, decoder clip, prefix-cache pages."""
        s = p.req.sched
        s.num_computed = p.end
        s.dec_clip = p.dec_clip_after(self.cfg.window_size)
        self._publish(p.req)

    def _run_chunk(self, p: ChunkPlan) -> PendingOutputs | None:
        key = self.runner.program_for_chunk(p)
        inp = self.runner.inputs(key)
        self._fill_row(inp, 0, p)
        pending = self.runner.run(key, inp)
        self._advance(p)
        return pending

    def _run_decode(self, plans: list[ChunkPlan]) -> PendingOutputs | None:
        key = ProgramKey(DECODE, self.runner.bucket(DECODE, len(plans)))
        inp = self.runner.inputs(key)
        for i, p in enumerate(plans):
            self._fill_row(inp, i, p)
        pending = self.runner.run(key, inp)
        for p in plans:
            self._advance(p)
        return pending

    def _prompt_logprobs(self, req: Request, p: ChunkPlan, out: StepOutputs):
        nxt, top_ids, top_lps = out.prompt_next_logprob[0], out.prompt_top_ids[0], out.prompt_top_logprobs[0]
        lps = req.out.prompt_lps
        if not lps:
            lps.append(None)
        k = req.sampling.prompt_logprobs
        for i in range(p.n):
            pos = p.pos0 + i + 1
            if pos >= req.n_prompt or pos < len(lps):
                continue
            d = {req.tokens[pos]: float(nxt[i])}
            for j in range(k):
                d.setdefault(int(top_ids[i, j]), float(top_lps[i, j]))
            lps.append(d)

    def _publish(self, req: Request):
        """Register newly completed pages in the prefix cache; save exact-mode snapshots at boundaries."""
        s = req.sched
        full = min(s.num_computed // BLOCK, len(s.hashes), len(s.pages))
        for j in range(s.registered, full):
            self.pool.register(s.pages[j], s.hashes[j])
        s.registered = max(s.registered, full)
        if self.snapshots is not None and s.num_computed in s.boundaries:
            k = s.num_computed // BLOCK
            slot = self.snapshots.claim(s.hashes[k - 1])
            if slot is not None:
                self.runner.snapshot(True, s.slot, slot)

    def _append(self, req: Request, out: StepOutputs, i: int):
        t = int(out.tokens[i])
        now = time.perf_counter()
        o = req.out
        req.tokens.append(t)
        o.out_ids.append(t)
        req.counter += 1
        if len(req.tokens) // BLOCK > len(req.sched.hashes):
            req.refresh_hashes()
        if req.sampling.logprobs is not None:
            d = {t: float(out.token_logprob[i])}
            for j in range(req.sampling.logprobs):
                d.setdefault(int(out.top_ids[i, j]), float(out.top_logprobs[i, j]))
            o.out_logprobs.append(d)
        if o.first_token_t is None:
            o.first_token_t = now
            self.metrics.observe("ttft", now - req.arrival)
        else:
            self.metrics.observe("itl", now - o.last_token_t)
        o.last_token_t = now
        self.metrics.inc("generation_tokens")
        sp = req.sampling
        o.detok.append(t)
        grammar = o.grammar
        if grammar is not None and not grammar.advance(t):  # only a dead-end grammar lets this happen
            o.error = f"structured output: {grammar.error}"
            self._finish(req, "abort")
        elif t in sp.stop_token_ids or (t in self.eos_ids and not sp.ignore_eos):
            o.stop_reason = t if t in sp.stop_token_ids else None
            self._finish(req, "stop")
        elif o.detok.stopped is not None:
            o.stop_reason = o.detok.stopped
            self._finish(req, "stop")
        elif grammar is not None and grammar.done:  # the constrained output is complete
            self._finish(req, "stop")
        elif len(o.out_ids) >= sp.max_tokens or len(req.tokens) >= self.args.max_model_len:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str, emit: bool = False):
        """Release the request's pages and slot now; its final output is emitted by the step (or here)."""
        if req.status != FINISHED:
            self.scheduler.finish(req, reason)
        req.out.finish_reason = reason
        self.metrics.finished(reason)
        if reason != "abort":
            self.metrics.inc("requests_finished")
            if req.out.first_token_t is not None:
                self.metrics.observe("e2e", time.perf_counter() - req.arrival)
        if emit:
            self._emit(req)
            self._update_gauges()

    def _emit(self, req: Request) -> RequestOutput | None:
        o = req.out
        new_ids = o.out_ids[o.sent_ids:]
        finished = req.status == FINISHED
        if req.request_id not in self.requests:  # already emitted its final output
            return None
        if not new_ids and not finished:
            return None
        if finished and o.detok is not None:
            o.detok.flush()
        text = o.text
        upto = o.detok.releasable(finished) if o.detok is not None else len(text)
        new_text = text[o.sent_text:upto] if upto > o.sent_text else ""
        lps = o.out_logprobs[o.sent_ids:] if req.sampling.logprobs is not None else None
        o.sent_ids = len(o.out_ids)
        o.sent_text = max(o.sent_text, upto)
        out = RequestOutput(req.request_id, new_ids, new_text, lps, finished, o.finish_reason if finished else None,
                            req.n_prompt, req.sched.num_cached, len(o.out_ids),
                            prompt_logprobs=o.prompt_lps if finished and req.sampling.prompt_logprobs is not None
                            else None, error=o.error, stop_reason=o.stop_reason if finished else None)
        if finished:
            self.requests.pop(req.request_id, None)
        if req.callback is not None:
            req.callback(out)
        return out

    # ------------------------------------------------------------------ conveniences
    def run_until_done(self, max_steps: int = 100000) -> list[RequestOutput]:
        outs = []
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            outs += self.step()
        return outs

    def model_info(self) -> dict:
        return {"model": self.cfg.name, "vocab_size": self.cfg.vocab_size, "max_model_len": self.args.max_model_len,
                "eos_token_ids": sorted(self.eos_ids), "window": self.cfg.window_size,
                "swa_bounded_replay": self.args.swa_bounded_replay, "warmup_s": round(self.warmup_s, 2),
                "compiled_programs": self.runner.compile_count, "kernels": self.args.kernels}
