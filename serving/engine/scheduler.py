"""vLLM-v1-style scheduler: continuous batching, chunked prefill, prefix caching with SWA bounded replay.

Each step gives some requests `n` new tokens to compute (no separate prefill/decode phases):
1. RUNNING requests first, in admission order: a decode gets 1 token; an unfinished prefill gets a chunk
   capped by `long_prefill_token_threshold` (when more than one request exists) and the remaining budget.
   With `prefill_schedule_interval` N > 1, prefill chunks run only every N-th step while decodes are running.
   If pages run out, the most recently admitted running request is preempted (recompute: its pages are
   released, hashed ones stay cached, and it goes back to the head of the waiting queue).
2. WAITING requests (FCFS, only if nothing was preempted this step): look up the prefix cache (hit H: device
   pages, continued by pages restored from the host tier with --kv-offloading-size; block-aligned, at most
   the last full block before the final token); with bounded replay the request starts at s = max(H - W, 0)
   with its SWA clipped at s and global-KV writes from H; in exact mode it restores the SWA snapshot at the
   largest retained boundary <= H. Pages for the whole prompt are reserved at admission; head-of-line blocking
   when they do not fit.

The scheduler owns `req.sched` (serving.engine.request) and emits one `ChunkPlan` per scheduled request:
the plan says everything the runner and the model need (serving.engine.chunk_plan).

Invariants (violations raise RuntimeError): the token budget (`max_num_batched_tokens`) is never exceeded; a
CED final chunk carries at least min(W, rest) tokens so the decoder sees the last window; a running decode is
never skipped for a prefill (decodes are scheduled first); at most `max_num_seqs` requests run.

Speculative decoding (--speculative-config): a decode also reserves budget and pages for `spec_tokens(req)` draft
rows (k, fewer near max_tokens / max_model_len, none for structured outputs, whose grammar masks only the next
token); its position advances by one at dispatch, and by the accepted drafts when the verification comes back
(`accepted`): pages are published only below accepted positions.

Async scheduling (serving.engine.device_tokens): `schedule()` may run while a request's last sampled token is
still on the device (`req.in_flight`). Its decode plan then starts at len(req.tokens), the position of that
token, and it is not scheduled when that token is its last by max_tokens or max_model_len.
"""

from __future__ import annotations

import time
from collections import deque

from dsv41_jax.kv_format import pages_for
from serving.engine.block_hash import BLOCK
from serving.engine.chunk_plan import ChunkPlan, min_final_rows, plan_chunk
from serving.engine.page_pool import PagePool
from serving.engine.request import FINISHED, RUNNING, WAITING, Request

__all__ = ["Scheduler", "Request", "ChunkPlan", "WAITING", "RUNNING", "FINISHED"]


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
        self.preemptions = 0

    # ------------------------------------------------------------------ helpers
    def _grow(self, req: Request, upto: int, now: float) -> bool:
        need = max(0, pages_for(upto) - len(req.sched.pages))
        if need == 0:
            return True
        got = self.pool.allocate(need, now)
        if got is None:
            return False
        req.sched.pages += got
        return True

    def _chunk(self, req: Request, budget: int, thr: int) -> int:
        s = req.sched
        rest = s.prefill_end - s.num_computed
        n = min(rest, budget)
        if thr:
            n = min(n, thr)
        tail = min_final_rows(self.args.swa_bounded_replay, self.W)
        if n < rest and rest - n < tail:
            n = rest - tail  # the final chunk must carry the decoder's last window
        if not self.args.swa_bounded_replay:
            for b in s.boundaries:  # stop at retained snapshot boundaries
                if s.num_computed < b < s.num_computed + n:
                    n = b - s.num_computed
                    break
        return max(n, 0)

    def _plan(self, req: Request, n: int, spec: int = 0) -> ChunkPlan:
        return plan_chunk(req, n, bounded_replay=self.args.swa_bounded_replay, window=self.W, spec=spec)

    def spec_tokens(self, req: Request) -> int:
        """Draft rows a decode of `req` may verify: k, capped so that every emitted token fits max_tokens and
        max_model_len (a step emits at most 1 + drafts); 0 without speculation or for structured outputs."""
        sp = self.args.speculative
        if sp is None or req.sampling.structured is not None:
            return 0
        generated = len(req.tokens) - req.n_prompt
        room = min(req.sampling.max_tokens - generated, self.args.max_model_len - len(req.tokens))
        return max(0, min(sp.num_speculative_tokens, room - 1))

    def _continues(self, req: Request) -> bool:
        """Async scheduling: whether a request whose sampled token is still in flight may decode after it (stop
        tokens and strings are only known when it arrives; the lengths are known now)."""
        n = len(req.tokens) + req.in_flight
        return n - req.n_prompt < req.sampling.max_tokens and n < self.args.max_model_len

    def release(self, req: Request, now: float | None = None):
        now = time.perf_counter() if now is None else now
        s = req.sched
        self.pool.release(s.pages, req.session_id, now)
        s.pages = []
        s.n_hit_pages = 0
        s.registered = 0
        if s.slot is not None:
            self.free_slots.append(s.slot)
            s.slot = None

    def preempt(self, victim: Request, now: float | None = None):
        """Recompute-style preemption: free the pages (hashed ones stay cached) and requeue at the head."""
        self.running.remove(victim)
        self.release(victim, now)
        victim.sched.status = WAITING
        victim.sched.num_computed = 0
        self.waiting.appendleft(victim)
        self.preempted_this_step = True
        self.preemptions += 1
        if self.metrics:
            self.metrics.inc("preemptions")

    # ------------------------------------------------------------------ admission
    def _admit(self, req: Request, now: float) -> bool:
        """Prefix lookup, replay rewind and whole-prompt page reservation. False: does not fit now."""
        req.refresh_hashes()
        s = req.sched
        N = len(req.tokens)
        s.prefill_end = N
        use_cache = self.args.enable_prefix_caching and req.sampling.prompt_logprobs is None
        max_hit_pages = (N - 1) // BLOCK
        hits = self.pool.lookup(s.hashes[:max_hit_pages]) if use_cache else []
        self.pool.acquire(hits)
        if use_cache:  # the host tier (--kv-offloading-size) continues the device hits
            hits += self.pool.restore(s.hashes[len(hits):max_hit_pages], now)
        H = len(hits) * BLOCK
        start, restore = 0, None
        if self.args.swa_bounded_replay:
            start = max(H - self.W, 0)
        elif hits and self.snapshots is not None:
            k, restore = self.snapshots.best(s.hashes[:len(hits)], req.session_id, now)
            start = k * BLOCK
            if self.metrics:  # where exact mode's time goes: a hit without a snapshot at its end recomputes
                self.metrics.inc("snapshot_restores" if restore is not None else "snapshot_misses")
                self.metrics.inc("snapshot_recomputed_tokens", H - start)
        need = pages_for(N) - len(hits)
        got = self.pool.allocate(need, now)
        if got is None:
            self.pool.release(hits, None, now)
            return False
        s.pages = hits + got
        s.n_hit_pages = len(hits)
        s.registered = len(hits)
        s.num_computed = start
        s.enc_clip = start if self.args.swa_bounded_replay else 0
        s.dec_clip = s.enc_clip
        s.write_from = H
        s.restore_snapshot = restore
        s.boundaries = []
        if not self.args.swa_bounded_replay:
            ends = {b for b in (H, (N // BLOCK) * BLOCK) if start < b < N}
            s.boundaries = sorted(ends)
        s.slot = self.free_slots.pop()
        s.status = RUNNING
        if not s.admitted_once:
            # cached tokens = tokens whose computation the hit really skips: bounded replay recomputes the last W
            # of the H hit tokens, exact mode resumes at the snapshot it restores (vLLM's hits counter stays H)
            s.num_cached = start
            if self.metrics:
                self.metrics.inc("prefix_cache_queries", N)
                self.metrics.inc("prefix_cache_hits", H)
                self.metrics.inc("prefix_cache_skipped", start)
        if self.metrics:
            self.metrics.inc("replayed_tokens", max(H - start, 0))
        s.admitted_once = True
        return True

    # ------------------------------------------------------------------ the step
    def schedule(self) -> list[ChunkPlan]:
        now = time.perf_counter()
        self.step_count += 1
        self.preempted_this_step = False
        budget = self.args.max_num_batched_tokens
        thr = self.args.long_prefill_token_threshold if (len(self.running) + len(self.waiting)) > 1 else 0
        decoding = any(not r.in_prefill for r in self.running)
        interval = self.args.prefill_schedule_interval
        defer = interval > 1 and decoding and self.step_count - self.last_prefill_step < interval
        out: list[ChunkPlan] = []
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
                spec = 0
            else:
                if req.in_flight and not self._continues(req):
                    continue  # its token on the device is its last (length): nothing more to compute
                n = 1
                spec = min(self.spec_tokens(req), budget - 1)
            while not self._grow(req, req.sched.num_computed + n + spec, now):
                victim = self.running[-1]
                self.preempt(victim, now)
                if victim is req:
                    break
            if req.status != RUNNING:
                continue
            out.append(self._plan(req, n, spec))
            budget -= n + spec
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
                out.append(self._plan(req, n))
                budget -= n
        if any(not p.is_decode for p in out):
            self.last_prefill_step = self.step_count
        if sum(p.n + p.spec for p in out) > self.args.max_num_batched_tokens:
            raise RuntimeError("scheduler invariant violated: the step exceeds max_num_batched_tokens")
        return out

    # ------------------------------------------------------------------ transitions the engine reports
    def take_restore_snapshot(self, req: Request) -> int | None:
        """Exact mode: the snapshot slot to load before the request's first chunk (handed out once)."""
        slot, req.sched.restore_snapshot = req.sched.restore_snapshot, None
        return slot

    def advance(self, plan: ChunkPlan):
        """A chunk was dispatched: its positions are computed and the decoder clip is what the plan leaves."""
        s = plan.req.sched
        s.num_computed = plan.end
        s.dec_clip = plan.dec_clip_after(self.W)

    def accepted(self, req: Request, n: int):
        """A verification accepted `n` drafts after the dispatched decode row: their positions are computed."""
        req.sched.num_computed += n

    def publish(self, req: Request):
        """Register the request's newly completed pages in the prefix cache (once each)."""
        s = req.sched
        full = min(s.num_computed // BLOCK, len(s.hashes), len(s.pages))
        for j in range(s.registered, full):
            self.pool.register(s.pages[j], s.hashes[j])
        s.registered = max(s.registered, full)

    def token_appended(self, req: Request):
        """A generated token joined req.tokens: hash the block it completed (prefix caching of the output)."""
        if len(req.tokens) // BLOCK > len(req.sched.hashes):
            req.refresh_hashes()

    def finish(self, req: Request, reason: str):
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)
        req.sched.status = FINISHED
