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

Async scheduling (--async-scheduling, the default): 2 runs before 1, so the host schedules and launches step j
while the device still runs step j-1. A decode whose last token is still in flight takes it from the device
(serving/engine/device_tokens.py: each sampling call scatters its tokens into a per-slot device vector, each
decode call patches its rows from it); its RNG counter counts the in-flight token. A stop found in 1 costs the
row that step j computed for the request (dropped, as an abort in flight). A step collects first (the order
above) while a running request has a grammar (its mask needs the token), and always with speculative decoding,
host Engram tables, a TP / DP mesh or several hosts (`_device_tokens`).

Speculative decoding (--speculative-config): in 2, the proposer drafts up to `plan.spec` tokens for each decode
from the tokens collected in 1, and the decodes run as one `verify[B]` call (a plain `decode[B]` call when no
request got a draft); in 1, each request appends its accepted drafts and the target's token, one at a time
through the same stop / grammar / length checks (tokens after a stop are dropped), and the scheduler commits the
accepted positions. Counters: vllm:spec_decode_* (metrics.py); per request: `RequestOutput.spec_decoding`.

Seeds: a request without a seed gets one drawn from a generator seeded by `--seed`, in arrival order, so the
same sequence of requests after a restart gives the same outputs (as vLLM).

Failures: a program call that raises fails only the requests it carried (their final output has `error`).
If the failure consumed the donated device pools (or left them in an error state), the runner rebuilds them,
the prefix cache and snapshots are dropped (their bytes are gone), and every other running request is
preempted and recomputed from its tokens: no later step reads poisoned state. With async scheduling a failure
can surface while the next step, dispatched on the same pools, is in flight: that step is dropped uncollected.

Parallelism (`EngineArgs.tensor_parallel_size` / `data_parallel_size` / `enable_expert_parallel`): the engine
builds the mesh from its flags (`make_mesh`). Under TP nothing changes here (the runner's programs are
sharded). Under DP / DEP the engine keeps one `Rank` (page pool, scheduler, snapshots) per data-parallel rank:
a new request is placed on a rank by `dp.Placement` (sticky sessions, cached prefix, load cap) and stays
there; each step schedules every rank and packs their work into SPMD calls (`dp.decode_rows`,
`dp.chunk_groups`); rank 0's pool / scheduler are also `self.pool` / `self.scheduler`. In a multi-host run
(serving.engine.multihost) this object lives in process 0 and the other processes replay its program calls.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.engram_rows import drop_tables
from dsv41_jax.kv_format import pages_for
from serving.engine.block_hash import BLOCK
from serving.engine.chunk_plan import ChunkPlan
from serving.engine.config import EngineArgs
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.device_tokens import DeviceTokens
from serving.engine.dp import Placement, Rank, chunk_groups, decode_rows
from serving.engine.engram_host import EngramFeeder, load_host_model, tables_to_host
from serving.engine.host_tier import HostTier
from serving.engine.metrics import Metrics
from serving.engine.page_pool import PagePool
from serving.engine.request import FINISHED, Request
from serving.engine.runner import Runner
from serving.engine.scheduler import Scheduler
from serving.engine.snapshots import SnapshotIndex
from serving.engine.spec_decode import SpecStats, make_proposer
from serving.engine.step_io import DECODE, PREFILL, VERIFY, PendingOutputs, ProgramKey, StepOutputs
from serving.engine.types import RequestOutput, SamplingParams

log = logging.getLogger("serving.engine")


class QueueFull(RuntimeError):
    """Too many queued requests (HTTP 503 / RESOURCE_EXHAUSTED)."""


def load_model(model, seed: int = 0, weight_format: str | None = None, *, mesh=None, parallel=None):
    """A preset name, a ModelConfig (random weights built on device), or a checkpoint directory (HF or orbax).
    With a mesh and its parallel layout every weight is built / read straight onto its shards."""
    import checkpoints

    if isinstance(model, ModelConfig):
        cfg = model
    elif isinstance(model, str) and not os.path.isdir(model):
        cfg = ModelConfig.preset(model, **({"weight_format": weight_format} if weight_format else {}))
    else:
        return checkpoints.load(model, weight_format=weight_format, mesh=mesh, parallel=parallel)
    return cfg, checkpoints.random_init(cfg, seed, mesh, parallel=parallel)


def use_compilation_cache(path: str, execution: str = "compiled"):
    """Point JAX's persistent compilation cache at `path`. Compiled execution caches its programs (compiles
    over 0.5 s); eager execution caches every op it compiles too (thousands of small executables, 0.03-0.1 s
    each to build): a restarted eager server then skips most of its first-step compilations (CPU, tiny: the
    first eager step 40.5 s -> 8.0 s, bench/results/eager_ops_tiny_cache_*_cpu.json)."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0 if execution == "eager" else 0.5)


def make_mesh(args: EngineArgs):
    """The mesh of resolved engine args (None: one device, no mesh)."""
    return None if args.parallel is None else args.parallel.mesh()


def model_config_of(model, weight_format: str | None = None) -> ModelConfig | None:
    """The config of a preset, a ModelConfig or a checkpoint directory, without reading any weight (None: not
    a directory the loader knows; it will say why)."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str) and not os.path.isdir(model):
        return ModelConfig.preset(model)
    from checkpoints.hf_config import read_hf_config
    from checkpoints.hf_manifest import is_hf_dir
    from checkpoints.orbax_io import is_orbax_dir, read_config

    if is_hf_dir(model):
        cfg = read_hf_config(model)[0]
    elif is_orbax_dir(model):
        cfg = read_config(model)
    else:
        return None
    return cfg if weight_format is None else cfg.replace(weight_format=weight_format)


@dataclass
class _Call:
    """One dispatched program call, the plans it carried and their output rows (None: plan i at row i)."""
    plans: list[ChunkPlan]
    pending: PendingOutputs | None
    rows: list[int] | None = None
    drafts: list[int] | None = None  # verify calls: draft tokens of each plan

    def row(self, i: int) -> int:
        return i if self.rows is None else self.rows[i]


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
                 weight_format: str | None = None, engram_tables=None, proposer=None, **engine_kw):
        """`programs(key) -> bool` compiles only some programs (benchmarks); the rest raise KeyError if used.
        `weight_format` goes to the checkpoint loader (None: as stored). `engram_tables`: host Engram tables
        already built (checkpoints.host_tables.HostTables; with `params` that hold none). `proposer`: a
        spec_decode.Proposer that replaces the one --speculative-config names (tests; needs --speculative-config
        for k)."""
        args = args or EngineArgs(**engine_kw)
        if args.compilation_cache_dir:  # before anything compiles, the weight init included
            use_compilation_cache(args.compilation_cache_dir, args.execution)
        known = model_config_of(model, weight_format)
        mesh = None
        if known is not None:  # flags checked and the mesh built before any weight is made
            args = args.resolved(known)
            mesh = make_mesh(args)
        host_eng = known is not None and args.engram.cpu_offload  # host Engram tables (engram_host.py)
        if host_eng and jax.process_count() > 1:
            raise ValueError("--engram-config cpu_offload is not supported in a multi-host run")
        if params is None and host_eng:
            cfg, params, engram_tables = load_host_model(model, args.seed, weight_format, mesh, args.parallel,
                                                         args.engram)
        elif params is None:
            cfg, params = load_model(model, args.seed, weight_format, mesh=mesh, parallel=args.parallel)
        else:
            cfg = model if isinstance(model, ModelConfig) else ModelConfig.preset(model)
            if host_eng and engram_tables is None:
                params, engram_tables = tables_to_host(cfg, params, args.engram)
            elif host_eng:
                params = drop_tables(params)
        self.cfg = cfg
        self.args = args if known is not None else args.resolved(cfg)  # known: cfg read without its weights
        if mesh is None:
            mesh = make_mesh(self.args)
        if tokenizer is None:  # the checkpoint's own tokenizer when it has one (as vLLM), else bytes
            from serving.tokenizer import ByteTokenizer, load_tokenizer

            has_own = isinstance(model, (str, os.PathLike)) and (Path(model) / "tokenizer.json").is_file()
            tokenizer = load_tokenizer(str(model), cfg.vocab_size) if has_own else \
                ByteTokenizer(cfg.vocab_size) if cfg.vocab_size >= 256 else None
        self.tokenizer = tokenizer
        eos = set(self.args.eos_token_ids)
        if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = {tokenizer.eos_token_id}
        self.eos_ids = eos
        spec = self.args.speculative
        self.metrics = Metrics(served_model_name or cfg.name, spec_tokens=spec.num_speculative_tokens if spec else 0)
        if proposer is not None and spec is None:
            raise ValueError("a proposer needs --speculative-config (num_speculative_tokens)")
        self.proposer = proposer if proposer is not None else make_proposer(spec)
        self.max_pages = pages_for(self.args.max_model_len)
        self.runner = Runner(cfg, params, self.args, self.max_pages, mesh)
        self.warmup_s = self.runner.compile_all(progress, keep=programs)
        self.metrics.set("compiled_programs", self.runner.compile_count)
        self.metrics.set("snapshot_bytes", sum(v for k, v in self.runner.pool_bytes().items() if k.startswith("snap")))
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        self.engram = None  # host Engram tables: the row feeder
        if self.runner.engram_row_bytes:
            e = self.args.engram
            self.engram = EngramFeeder(cfg, engram_tables, self.hasher, self.runner.put_engram_rows, self.metrics,
                                       gather_threads=e.gather_threads, prefetch=e.prefetch, eager=not self.runner.dp,
                                       pinned=e.pinned_staging, in_call=e.rows_in_call,
                                       max_spans=4 * self.args.max_num_seqs * self.runner.n_ranks + 16)
        self.device_tokens = self._device_tokens()
        self.host_tier = self._host_tier()
        self.ranks = [self._new_rank(i) for i in range(self.runner.n_ranks)]
        self.pool, self.scheduler, self.snapshots = self.ranks[0].pool, self.ranks[0].scheduler, self.ranks[0].snapshots
        self.placement = Placement(self.args.dp_load_cap, self.args.enable_prefix_caching)
        self._rank: dict[str, int] = {}  # request id -> its data-parallel rank
        self.requests: dict[str, Request] = {}
        self._seeds = np.random.default_rng(self.args.seed)
        self._inflight: _InFlight | None = None
        self._step_requests: list[str] | None = None
        self._grammars = None  # structured outputs: a GrammarCompiler, made on first use
        self.host_time = {"steps": 0, "wait_s": 0.0, "step_s": 0.0}  # wall time in step() and waiting on results

    def _device_tokens(self) -> DeviceTokens | None:
        """Async scheduling's token feedback (module docstring); None where every step collects before it
        schedules."""
        a, r = self.args, self.runner
        if not a.async_scheduling or r.mesh is not None or a.speculative is not None or self.engram is not None \
                or jax.process_count() > 1:
            return None
        try:
            dt = DeviceTokens(r.S + 1, self.hasher)
        except ValueError as e:  # Engram primes beyond the device hash's range
            log.warning("async scheduling off: %s", e)
            return None
        dt.warm(r)  # its small programs compiled now, not mid-serving
        return dt

    def _async_step(self) -> bool:
        """Dispatch before collecting (module docstring): no running request needs its last token on the host."""
        return self.device_tokens is not None and not any(
            r.out.grammar is not None for rank in self.ranks for r in rank.scheduler.running)

    def _host_tier(self) -> HostTier | None:
        a = self.args
        if a.kv_offloading_size <= 0 or not a.enable_prefix_caching:
            return None
        if jax.process_count() > 1:
            raise ValueError("--kv-offloading-size is not supported in a multi-host run")
        tier = HostTier(a.kv_offloading_size * 2 ** 30, int(self.runner.pools["pages"].shape[1]),
                        self.runner.read_pages, self.runner.write_pages, self.metrics)
        tier.warm_up(self.max_pages)  # one request's pages per batch compiled before serving
        return tier

    def _new_rank(self, i: int) -> Rank:
        a = self.args
        pool = PagePool(a.num_pages, a.enable_prefix_caching, a.session_ttl_s)
        if self.host_tier is not None:
            pool.attach_tier(self.host_tier, i * a.num_pages)
        snaps = None if a.swa_bounded_replay else SnapshotIndex(a.snapshot_slots, a.session_ttl_s)
        return Rank(i, pool, Scheduler(a, pool, self.cfg.window_size, snaps, self.metrics), snaps)

    def _rank_of(self, req: Request) -> Rank:
        return self.ranks[self._rank.get(req.request_id, 0)]

    def _rank_index(self, req: Request) -> int:
        return self._rank.get(req.request_id, 0)

    def _n_waiting(self) -> int:
        return sum(len(r.scheduler.waiting) for r in self.ranks)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None = None, *,
                    session_id: str | None = None, cache_salt: str | None = None, callback=None,
                    end_session: bool = False):
        """Queue a request. `end_session`: the session's last turn (its retention ends when this request does)."""
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
        if self._n_waiting() >= self.args.max_queued_requests:
            raise QueueFull(f"{self._n_waiting()} requests are already queued")
        grammar = self._grammar_state(sp) if sp.structured is not None else None  # GrammarError: ValueError
        # every accepted request draws from the seed stream (arrival order), seeded or not
        drawn = int(self._seeds.integers(0, 2 ** 32))
        seed = (sp.seed if sp.seed is not None else drawn) & 0xFFFFFFFF
        req = Request(request_id, [int(t) for t in ids], len(ids), sp, session_id, cache_salt, callback=callback,
                      seed=seed, end_session=end_session and session_id is not None)
        req.out.grammar = grammar  # structured outputs: advanced in _append, masks the sampler in _fill_row
        if self.args.speculative is not None:
            req.out.spec = SpecStats(self.args.speculative.num_speculative_tokens)
        special = set(sp.stop_token_ids) | (self.eos_ids if not sp.ignore_eos else set())
        req.out.detok = IncrementalDetokenizer(self.tokenizer, skip_ids=special, stop=sp.stop,
                                               include_stop=sp.include_stop_str_in_output)
        self.requests[request_id] = req
        self.metrics.inc("prompt_tokens", len(ids))
        if sp.max_tokens == 0 and sp.prompt_logprobs is None:
            self._finish(req, "length", emit=True)
            return
        rank = self.placement.place(self.ranks, req.tokens, session_id, cache_salt,
                                    use_cache=sp.prompt_logprobs is None)
        self._rank[request_id] = rank
        self.ranks[rank].scheduler.waiting.append(req)
        if self.engram is not None and len(self.ranks[rank].scheduler.waiting) == 1:  # next in line: its first
            self._prefetch_first_chunk(req, self.ranks[rank])  # chunk's Engram rows, gathered during the step
        self._update_gauges()

    def _prefetch_first_chunk(self, req: Request, rank: Rank):
        """A guess of the first chunk the scheduler will give `req` (its prefix-cache hit as of now, the whole
        token budget); a wrong guess costs a gather, never a wrong row (engram_host.py)."""
        a, N = self.args, len(req.tokens)
        start = 0
        if a.enable_prefix_caching and req.sampling.prompt_logprobs is None:
            req.refresh_hashes()  # the scheduler's admission reuses them
            H = len(rank.pool.lookup(req.sched.hashes[:(N - 1) // BLOCK])) * BLOCK
            if H and not a.swa_bounded_replay:  # exact mode: the restart depends on the snapshots; no guess
                return
            start = max(H - self.cfg.window_size, 0)
        n = min(N - start, a.max_num_batched_tokens)
        self.engram.prefetch(req, start, n, self.runner.bucket(PREFILL, n))

    def _grammar_state(self, sp: SamplingParams):
        """A fresh grammar state for a structured-output request (compiled here unless the API did it)."""
        from serving.engine.structured import GrammarCompiler

        if sp.structured.compiled is None or sp.structured.compiled.vocab_size != self.cfg.vocab_size:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.eos_ids)
            self._grammars.compile(sp.structured)
        return sp.structured.compiled.new_state(sp.max_tokens)  # budget-aware: closes within max_tokens

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status == FINISHED:
            return False
        self._finish(req, "abort", emit=True)
        self.metrics.inc("requests_aborted")
        return True

    def end_session(self, session_id: str) -> int:
        """The end-of-session hint: lift the retention of the session's cached pages and snapshots (they stay
        cached as ordinary LRU entries, first in line for eviction) and forget its data-parallel rank. Returns
        the number of pages and snapshots unprotected."""
        n = 0
        for rank in self.ranks:
            n += rank.pool.end_session(session_id)
            if rank.snapshots is not None:
                n += rank.snapshots.end_session(session_id)
        self.placement.sessions.pop(session_id, None)
        return n

    def has_unfinished(self) -> bool:
        return self._inflight is not None or any(r.scheduler.running or r.scheduler.waiting for r in self.ranks)

    # ------------------------------------------------------------------ public state (for the API)
    def set_served_model_name(self, name: str):
        """The model name that labels the engine's Prometheus metrics."""
        self.metrics.model_name = name

    def inspect(self) -> EngineInspect:
        return EngineInspect(tuple(r.request_id for k in self.ranks for r in k.scheduler.running),
                             tuple(r.request_id for k in self.ranks for r in k.scheduler.waiting),
                             None if self._step_requests is None else tuple(self._step_requests))

    @staticmethod
    def _pages(pool: PagePool) -> dict:
        return {"total": pool.num_pages - 1, "free": pool.num_free(), "referenced": int((pool.ref[1:] > 0).sum()),
                "cached": len(pool.hash_of), "session_protected": pool.num_protected()}

    def stats(self) -> dict:
        """Page pool, queue and metric state (JSON-serialisable); per-rank detail under "parallel"."""
        per = [self._pages(r.pool) for r in self.ranks]
        out = {
            "pages": {k: sum(p[k] for p in per) for k in per[0]},
            "requests": {"running": sum(len(r.scheduler.running) for r in self.ranks), "waiting": self._n_waiting(),
                         "tracked": len(self.requests)},
            "metrics": self.metrics.snapshot(),
        }
        if self.engram is not None:
            out["engram_host_tables"] = self.engram.tables.describe()
        par = self.args.parallel
        if par is not None:
            out["parallel"] = {
                "layout": par.describe(), "devices": par.size,
                "ranks": [{"pages": p, "running": len(r.scheduler.running), "waiting": len(r.scheduler.waiting)}
                          for p, r in zip(per, self.ranks)],
                "placements": dict(self.placement.counts), "moe_dropped_rows": self.runner.moe_dropped()}
        return out

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Collect the step in flight, dispatch the next one, emit the collected outputs (module docstring).
        A failing program call fails only the requests it carried."""
        t0 = time.perf_counter()
        touched: list[Request] = []
        previous, self._inflight = self._inflight, None
        if previous is not None and not self._async_step():
            self._step_requests = [r.request_id for r in previous.requests()]
            touched += self._collect(previous)
            previous = None
        self._step_requests = None  # scheduling: not known yet
        try:
            plans = [p for r in self.ranks for p in r.scheduler.schedule()]
            self._step_requests = [p.req.request_id for p in plans]
            if plans:
                self._inflight = self._dispatch(plans)
        except BaseException:
            if previous is not None:  # async: still to collect; the next step does (its requests carry on)
                self._inflight = previous
            raise
        if plans:
            touched += [p.req for p in plans if not p.sample]  # non-sampling chunks: nothing to wait for
        if previous is not None:  # async scheduling: step j-1's tokens, while step j runs
            touched += self._collect(previous)
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
        self.metrics.set("running", sum(len(r.scheduler.running) for r in self.ranks))
        self.metrics.set("waiting", self._n_waiting())
        self.metrics.set("kv_usage", sum(r.pool.usage() for r in self.ranks) / len(self.ranks))
        if self.host_tier is not None:
            self.metrics.set("offload_pages", self.host_tier.num_pages())

    def _dispatch(self, plans: list[ChunkPlan]) -> _InFlight:
        inflight = _InFlight()
        if self.engram is not None:  # prompt chunks' Engram rows: gathered while the decode call is dispatched
            for p in plans:
                if not p.is_decode:
                    self.engram.prefetch(p.req, p.pos0, p.n, self.runner.bucket(PREFILL, p.n))
        if self.host_tier is not None:  # pages restored from host memory, before any program reads them
            self._guarded(inflight, [], self.host_tier.flush)  # a failure: the pools are checked (rebuilt)
        for p in plans:
            snap = self._rank_of(p.req).scheduler.take_restore_snapshot(p.req)
            if snap is not None:
                rank = self._rank_index(p.req)
                self._guarded(inflight, [p], lambda n=snap, s=p.req.sched, r=rank: self.runner.snapshot(
                    False, n, s.slot, r))
        decode = [p for p in plans if p.is_decode and p.req.status != FINISHED]
        if decode:
            B, rows = decode_rows(decode, self._rank_index)
            Bk = self.runner.bucket(DECODE, B)  # each rank's block of the call has the bucket's rows
            rows = [r // B * Bk + r % B for r in rows]
            drafts = self._propose(decode)
            if drafts is None:
                self._guarded(inflight, decode, lambda: self._run_decode(decode, Bk, rows), rows)
            else:
                self._guarded(inflight, decode, lambda: self._run_decode(decode, Bk, rows, drafts), rows,
                              [len(d) for d in drafts])
        chunks = [p for p in plans if not p.is_decode and p.req.status != FINISHED]
        if len(self.ranks) == 1:
            groups = [([p], [0]) for p in chunks]
        else:
            groups = chunk_groups(chunks, self._rank_index)
        for group, rows in groups:
            self._guarded(inflight, group, lambda g=group, r=rows: self._run_chunks(g, r), rows)
        return inflight

    def _propose(self, plans: list[ChunkPlan]) -> list[list[int]] | None:
        """Drafts for a step's decodes (None: speculation off, or no request got a draft: a plain decode call)."""
        if self.proposer is None or not any(p.spec for p in plans):
            return None
        drafts = [self.proposer.propose(p.req, p.spec)[:p.spec] if p.spec else [] for p in plans]
        return drafts if any(drafts) else None

    def _guarded(self, inflight: _InFlight, plans: list[ChunkPlan], fn, rows: list[int] | None = None,
                 drafts: list[int] | None = None):
        try:
            inflight.calls.append(_Call(plans, fn(), rows, drafts))
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
        if self._inflight is not None:  # async: dispatched after the failed call, it read the lost pools: dropped
            for p in (p for c in self._inflight.calls if c.pending is not None for p in c.plans if p.sample):
                p.req.in_flight -= 1  # its requests are recomputed below
            self._inflight = None
        for rank in self.ranks:
            rank.pool.drop_cache()
            if rank.snapshots is not None:
                rank.snapshots.clear()
            for r in list(rank.scheduler.running):
                rank.scheduler.preempt(r)

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
            for p in call.plans:
                if p.sample:  # its token leaves the device now (or never: a failure)
                    p.req.in_flight -= 1
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
                    self._prompt_logprobs(req, p, out, call.row(i))
                if p.sample:
                    if req.sampling.max_tokens == 0:  # prompt logprobs only
                        self._finish(req, "length")
                    elif out.n_accepted is not None:
                        self._accept(req, out, call.row(i), call.drafts[i])
                    else:
                        r = call.row(i)
                        self._append(req, out.tokens[r], out.token_logprob[r], out.top_ids[r], out.top_logprobs[r])
                    if out.drafts is not None:  # the device draft's next proposal (DSpark)
                        req.drafts = out.drafts[call.row(i)].tolist()
            if self.engram is not None:  # the next decode rows' Engram rows, gathered while this step goes on
                self.engram.prefetch_decode([p.req for p in call.plans if p.sample and p.req.status != FINISHED])
        return touched

    def _accept(self, req: Request, out: StepOutputs, row: int, n_draft: int):
        """A verified decode: commit the accepted positions, count, then append the emitted tokens in order."""
        a = int(out.n_accepted[row])
        self._rank_of(req).scheduler.accepted(req, a)
        if n_draft:
            self.metrics.spec_observe(n_draft, a)
            req.out.spec.observe(n_draft, a)
        for j in range(a + 1):
            if req.status == FINISHED:  # a stop (or the length) inside the accepted tokens: the rest is dropped
                break
            self._append(req, out.tokens[row, j], out.token_logprob[row, j], out.top_ids[row, j],
                         out.top_logprobs[row, j])
        if req.status != FINISHED:
            self._publish(req)  # the pages the accepted tokens completed (their block hashes now exist)

    def _history(self, req: Request, pos0: int) -> np.ndarray:
        """[1, n-1] compressed ids of the Engram lookbacks before position pos0 (-1: before the start)."""
        h = self.hasher.n - 1
        hist = np.full((1, h), -1, np.int64)
        prev = req.tokens[max(pos0 - h, 0):pos0]
        if prev:
            hist[0, h - len(prev):] = self.hasher.compress(np.asarray(prev))
        return hist

    def _hash_ids(self, req: Request, pos0: int, toks: np.ndarray):
        if self.hasher is None:
            return None
        return self.hasher.hash_ids(toks, self._history(req, pos0))

    def _fill_row(self, inp, i: int, p: ChunkPlan, drafts: list[int] | None = None) -> bool:
        """Row i of a program's inputs from a chunk plan (verify rows: the drafts after the plan's token).
        True: a decode row whose token is still on the device (async scheduling: DeviceTokens.patch fills it)."""
        req, c, sm = p.req, inp.chunk, inp.sampling
        inp.slots[i] = req.sched.slot
        pages = req.sched.pages
        inp.page_table[i, :len(pages)] = pages
        on_device = p.is_decode and p.pos0 >= len(req.tokens)
        if not on_device:
            c.tokens[i, :p.n] = req.tokens[p.pos0:p.end]
        if drafts:
            c.tokens[i, p.n:p.n + len(drafts)] = drafts
        if c.engram_ids is not None and not on_device:  # the drafts' rows hashed as the continuation they propose
            c.engram_ids[i] = self._hash_ids(req, p.pos0, c.tokens[i:i + 1])[0]
        c.pos0[i], c.n_valid[i] = p.pos0, p.n + len(drafts or ())
        c.enc_clip[i], c.dec_clip[i], c.write_from[i] = p.enc_clip, p.dec_clip, p.write_from
        sp = req.sampling
        sm.temperature[i], sm.top_k[i], sm.top_p[i], sm.min_p[i] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        sm.seed[i], sm.counter[i] = req.seed, req.counter + req.in_flight
        grammar = req.out.grammar
        if grammar is not None and p.sample:  # the grammar state is current: the last token was collected
            grammar.fill(sm.allowed[i])
        if sm.next_ids is not None:
            nxt = req.tokens[p.pos0 + 1:p.end + 1]
            sm.next_ids[i, :len(nxt)] = nxt
        return on_device

    def _sampled(self, pending: PendingOutputs | None, inp, plans: list[ChunkPlan]):
        """After a call's dispatch: its sampled tokens are in flight (and, async, recorded on the device)."""
        if pending is None:
            return
        for p in plans:
            if p.sample:
                p.req.in_flight += 1
        if self.device_tokens is not None:
            self.device_tokens.record(pending, inp.slots)

    def _advance(self, p: ChunkPlan):
        """Host-side progress once a chunk is dispatched: positions, decoder clip, prefix-cache pages."""
        self._rank_of(p.req).scheduler.advance(p)
        self._publish(p.req)
        if self.engram is not None and not p.is_decode and p.end < len(p.req.tokens):  # the next chunk's rows
            n = min(p.n, len(p.req.tokens) - p.end)
            self.engram.prefetch(p.req, p.end, n, self.runner.bucket(PREFILL, n))

    def _run_chunks(self, plans: list[ChunkPlan], rows: list[int]) -> PendingOutputs | None:
        """One prefill call: at most one chunk per rank (row = rank), all of one program kind."""
        key = self.runner.program_for_chunk(max(plans, key=lambda p: p.n))
        inp = self.runner.inputs(key)
        for row, p in zip(rows, plans):
            self._fill_row(inp, row, p)
        pending = self.runner.run(key, self._engram_rows(inp, rows, plans))
        self._sampled(pending, inp, plans)
        for p in plans:
            self._advance(p)
        return pending

    def _engram_rows(self, inp, rows: list[int], plans: list[ChunkPlan]):
        """Host Engram tables: the call's rows gathered and on the device (no-op with device tables)."""
        if self.engram is None:
            return inp
        return self.engram.inputs(inp, [(row, p.req, p.pos0, p.n) for row, p in zip(rows, plans)])

    def _run_decode(self, plans: list[ChunkPlan], bucket: int, rows: list[int],
                    drafts: list[list[int]] | None = None) -> PendingOutputs | None:
        if drafts is None:
            key = ProgramKey(DECODE, bucket)
        else:
            key = ProgramKey(VERIFY, bucket, spec=self.args.speculative.num_speculative_tokens)
        inp = self.runner.inputs(key)
        on_device = [row for j, (row, p) in enumerate(zip(rows, plans))
                     if self._fill_row(inp, row, p, None if drafts is None else drafts[j])]
        if on_device:
            hist = None if self.hasher is None else np.concatenate(
                [self._history(p.req, p.pos0) for row, p in zip(rows, plans) if row in on_device])
            inp = self.device_tokens.patch(inp, on_device, hist)
        pending = self.runner.run(key, self._engram_rows(inp, rows, plans))
        self._sampled(pending, inp, plans)
        for p in plans:
            self._advance(p)
        return pending

    def _prompt_logprobs(self, req: Request, p: ChunkPlan, out: StepOutputs, row: int = 0):
        nxt, top_ids, top_lps = out.prompt_next_logprob[row], out.prompt_top_ids[row], out.prompt_top_logprobs[row]
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
        rank = self._rank_of(req)
        rank.scheduler.publish(req)
        if rank.snapshots is not None and s.num_computed in s.boundaries:
            k = s.num_computed // BLOCK
            slot = rank.snapshots.claim(s.hashes[k - 1], req.session_id, time.perf_counter())
            if slot is not None:
                self.runner.snapshot(True, s.slot, slot, rank.index)

    def _append(self, req: Request, t, t_lp, top_ids, top_lps):
        """Append one sampled token (with its logprob and the top-n of its row); check stops and lengths."""
        t = int(t)
        now = time.perf_counter()
        o = req.out
        req.tokens.append(t)
        o.out_ids.append(t)
        req.counter += 1
        self._rank_of(req).scheduler.token_appended(req)
        if req.sampling.logprobs is not None:
            d = {t: float(t_lp)}
            for j in range(req.sampling.logprobs):
                d.setdefault(int(top_ids[j]), float(top_lps[j]))
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
            self._rank_of(req).scheduler.finish(req, reason)
            if req.end_session:
                self.end_session(req.session_id)
            if self.engram is not None:
                self.engram.forget(req.request_id)
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
                            else None, error=o.error, stop_reason=o.stop_reason if finished else None,
                            spec_decoding=o.spec.report(detailed=True) if finished and o.spec is not None else None)
        if finished:
            self.requests.pop(req.request_id, None)
            self._rank.pop(req.request_id, None)
        if req.callback is not None:
            req.callback(out)
        return out

    # ------------------------------------------------------------------ multi-host
    def follow(self):
        """Multi-host follower processes: replay the driver's device calls until `shutdown` (multihost.py)."""
        self.runner.follow()

    def shutdown(self):
        """Multi-host driver: release the followers (a no-op on one host)."""
        self.runner.stop_followers()

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
                "compiled_programs": self.runner.compile_count, "kernels": self.args.kernels,
                "parallel": None if self.args.parallel is None else self.args.parallel.describe()}
