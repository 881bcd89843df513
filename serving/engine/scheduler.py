"""vLLM-v1-style scheduler: continuous batching, chunked prefill, prefix caching with SWA bounded replay.

Each step gives some requests `n` new tokens to compute (no separate prefill/decode phases):
1. RUNNING requests first, in admission order: a decode gets 1 token; an unfinished prefill gets a chunk
   capped by `long_prefill_token_threshold` (when more than one request exists) and the remaining budget.
   With `prefill_schedule_interval` N > 1, prefill chunks run only every N-th step while decodes are running.
   If pages run out, the most recently admitted running request is preempted (recompute: its pages are
   released, hashed ones stay cached, and it goes back to the head of the waiting queue).
2. WAITING requests (FCFS, only if nothing was preempted this step): look up the prefix cache (hit H,
   block-aligned, at most the last full block before the final token); with bounded replay the request
   starts at s = max(H - W, 0) with its SWA clipped at s and global-KV writes from H; in exact mode it
   restores the SWA snapshot at the largest retained boundary <= H. Pages for the whole prompt are reserved
   at admission; head-of-line blocking when they do not fit.

Invariants: the token budget (`max_num_batched_tokens`) is never exceeded; a CED final chunk carries at
least min(W, rest) tokens so the decoder sees the last window; a running decode is never skipped for a
prefill (decodes are scheduled first); at most `max_num_seqs` requests run.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from serving.engine.block_hash import BLOCK, block_hashes
from serving.engine.page_pool import PagePool
from serving.engine.types import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    request_id: str
    tokens: list[int]  # prompt + generated
    n_prompt: int
    sampling: SamplingParams
    session_id: str | None = None
    cache_salt: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    callback: object = None
    status: str = WAITING
    num_computed: int = 0
    prefill_end: int = 0  # tokens to process before sampling (len(tokens) at admission)
    pages: list[int] = field(default_factory=list)
    n_hit_pages: int = 0
    slot: int | None = None
    hashes: list[bytes] = field(default_factory=list)
    enc_clip: int = 0
    dec_clip: int = 0
    write_from: int = 0
    num_cached: int = 0  # prefix-cache hit reported to the client (tokens)
    boundaries: list[int] = field(default_factory=list)  # exact mode: snapshot positions to retain
    registered: int = 0  # pages already published to the prefix cache
    counter: int = 0  # sampling step counter (per-request RNG stream)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0
    sent_ids: int = 0
    finish_reason: str | None = None
    first_token_t: float | None = None
    last_token_t: float | None = None
    admitted_once: bool = False
    restore_snapshot: int | None = None  # exact mode: snapshot slot to load before the first chunk
    prompt_lps: list = field(default_factory=list)  # prompt logprobs (echo), first entry None
    error: str | None = None  # set when the engine failed while running this request

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_end

    def refresh_hashes(self):
        self.hashes = block_hashes(self.tokens, self.cache_salt, parents=self.hashes)


@dataclass
class Scheduled:
    req: Request
    n: int  # tokens to compute this step, starting at req.num_computed
    final: bool  # reaches the end of the known tokens: sample a token afterwards


class Scheduler:
    def __init__(self, args, pool: PagePool, window: int, snapshots=None, metrics=None):
        self.args = args
        self.pool = pool
        self.W = window
        self.snapshots = snapshots  # exact mode: SnapshotIndex
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(args.max_num_seqs))[::-1]
        self.step_count = 0
        self.last_prefill_step = -(10 ** 9)
        self.preempted_this_step = False

    # ------------------------------------------------------------------ helpers
    def _pages_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // BLOCK) - len(req.pages))

    def _grow(self, req: Request, upto: int, now: float) -> bool:
        need = self._pages_needed(req, upto)
        if need == 0:
            return True
        got = self.pool.allocate(need, now)
        if got is None:
            return False
        req.pages += got
        return True

    def _chunk(self, req: Request, budget: int, thr: int) -> int:
        rest = req.prefill_end - req.num_computed
        n = min(rest, budget)
        if thr:
            n = min(n, thr)
        if n < rest and self.args.swa_bounded_replay and rest - n < self.W:
            n = rest - self.W  # the final chunk must carry the decoder's last window
        if not self.args.swa_bounded_replay:
            for b in req.boundaries:  # stop at retained snapshot boundaries
                if req.num_computed < b < req.num_computed + n:
                    n = b - req.num_computed
                    break
        return max(n, 0)

    def release(self, req: Request, now: float | None = None):
        now = time.perf_counter() if now is None else now
        self.pool.release(req.pages, req.session_id, now)
        req.pages = []
        req.n_hit_pages = 0
        req.registered = 0
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    def _preempt(self, victim: Request, now: float):
        self.running.remove(victim)
        self.release(victim, now)
        victim.status = WAITING
        victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.preempted_this_step = True
        if self.metrics:
            self.metrics.inc("preemptions")

    # ------------------------------------------------------------------ admission
    def _admit(self, req: Request, now: float) -> bool:
        """Prefix lookup, replay rewind and whole-prompt page reservation. False: does not fit now."""
        req.refresh_hashes()
        N = len(req.tokens)
        req.prefill_end = N
        use_cache = self.args.enable_prefix_caching and req.sampling.prompt_logprobs is None
        max_hit_pages = (N - 1) // BLOCK
        hits = self.pool.lookup(req.hashes[:max_hit_pages]) if use_cache else []
        H = len(hits) * BLOCK
        start, restore = 0, None
        if self.args.swa_bounded_replay:
            start = max(H - self.W, 0)
        elif hits and self.snapshots is not None:
            k, restore = self.snapshots.best(req.hashes[:len(hits)])
            start = k * BLOCK
        need = -(-N // BLOCK) - len(hits)
        self.pool.acquire(hits)
        got = self.pool.allocate(need, now)
        if got is None:
            self.pool.release(hits, None, now)
            return False
        req.pages = hits + got
        req.n_hit_pages = len(hits)
        req.registered = len(hits)
        req.num_computed = start
        req.enc_clip = start if self.args.swa_bounded_replay else 0
        req.dec_clip = req.enc_clip
        req.write_from = H
        req.restore_snapshot = restore
        req.boundaries = []
        if not self.args.swa_bounded_replay:
            ends = {b for b in (H, (N // BLOCK) * BLOCK) if start < b < N}
            req.boundaries = sorted(ends)
        req.slot = self.free_slots.pop()
        req.status = RUNNING
        if not req.admitted_once:
            req.num_cached = H
            if self.metrics:
                self.metrics.inc("prefix_cache_queries", N)
                self.metrics.inc("prefix_cache_hits", H)
        if self.metrics:
            self.metrics.inc("replayed_tokens", max(H - start, 0))
        req.admitted_once = True
        return True

    # ------------------------------------------------------------------ the step
    def schedule(self) -> list[Scheduled]:
        now = time.perf_counter()
        self.step_count += 1
        self.preempted_this_step = False
        budget = self.args.max_num_batched_tokens
        thr = self.args.long_prefill_token_threshold if (len(self.running) + len(self.waiting)) > 1 else 0
        decoding = any(not r.in_prefill for r in self.running)
        interval = self.args.prefill_schedule_interval
        defer = interval > 1 and decoding and self.step_count - self.last_prefill_step < interval
        out: list[Scheduled] = []
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RUNNING:
                continue
            if req.in_prefill:
                if defer:
                    continue
                n = self._chunk(req, budget, thr)
                if n == 0:
                    continue
            else:
                n = 1
            while not self._grow(req, req.num_computed + n, now):
                victim = self.running[-1]
                self._preempt(victim, now)
                if victim is req:
                    break
            if req.status != RUNNING:
                continue
            out.append(Scheduled(req, n, req.num_computed + n >= len(req.tokens)))
            budget -= n
        if not self.preempted_this_step and not defer:
            while self.waiting and budget > 0 and len(self.running) < self.args.max_num_seqs and self.free_slots:
                req = self.waiting[0]
                if not self._admit(req, now):
                    break
                self.waiting.popleft()
                self.running.append(req)
                n = self._chunk(req, budget, thr)
                if n == 0:
                    continue
                out.append(Scheduled(req, n, req.num_computed + n >= len(req.tokens)))
                budget -= n
        if any(s.req.in_prefill for s in out):
            self.last_prefill_step = self.step_count
        assert sum(s.n for s in out) <= self.args.max_num_batched_tokens
        return out

    def finish(self, req: Request, reason: str):
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)
        req.status = FINISHED
        req.finish_reason = reason
