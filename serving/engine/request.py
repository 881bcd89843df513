"""A request inside the engine, split by owner.

- `Request` itself: identity and inputs that never change after admission to the engine (id, prompt, sampling
  parameters, session, salt, the resolved sampling seed), plus the token list (prompt + generated, appended by
  the output path), the per-request RNG counter, the count of sampled tokens still on the device (`in_flight`,
  async scheduling) and, with the DSpark draft, its latest proposal (`drafts`).
- `SchedState` (`req.sched`): what the scheduler owns: status, progress, pages, ring slot, prefix-cache and
  replay bookkeeping. Only the scheduler writes it (the engine reports a dispatched chunk, a published
  page or an appended token through `Scheduler.advance` / `publish` / `token_appended`).
- `OutputState` (`req.out`): what the output path owns: generated ids, logprobs, the incremental detokenizer
  and its stop-string state, what was already streamed, finish reason, timings, errors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serving.engine.block_hash import block_hashes
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.types import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class SchedState:
    status: str = WAITING
    num_computed: int = 0  # tokens whose KV is computed (the next chunk starts here)
    prefill_end: int = 0  # tokens to process before sampling (len(tokens) at admission)
    pages: list[int] = field(default_factory=list)
    n_hit_pages: int = 0
    slot: int | None = None  # SWA ring / compressor-state slot
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full 64-token blocks
    enc_clip: int = 0  # SWA clip of the encoder band (replay_start)
    dec_clip: int = 0  # SWA clip of the decoder band
    write_from: int = 0  # global KV below this position is cached: never rewritten
    num_cached: int = 0  # prompt tokens whose computation a prefix-cache hit really skipped (cached_tokens)
    boundaries: list[int] = field(default_factory=list)  # exact mode: snapshot positions to retain
    registered: int = 0  # pages already published to the prefix cache
    admitted_once: bool = False
    restore_snapshot: int | None = None  # exact mode: snapshot slot to load before the first chunk


@dataclass
class OutputState:
    detok: IncrementalDetokenizer | None = None
    grammar: object | None = None  # structured outputs: the request's grammar state (serving.engine.structured)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[dict[int, float]] = field(default_factory=list)
    sent_ids: int = 0  # generated ids already streamed
    sent_text: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request
    first_token_t: float | None = None
    last_token_t: float | None = None
    prompt_lps: list = field(default_factory=list)  # prompt logprobs (echo), first entry None
    error: str | None = None  # set when the engine failed while running this request
    spec: object | None = None  # speculative decoding: the request's SpecStats (serving.engine.spec_decode)

    @property
    def text(self) -> str:
        return "" if self.detok is None else self.detok.text


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
    seed: int = 0  # the sampling seed (the request's, or one drawn from the engine's --seed stream)
    counter: int = 0  # sampling step counter (per-request RNG stream)
    in_flight: int = 0  # tokens sampled by dispatched calls and not yet appended (async scheduling: at most 1)
    drafts: list[int] = field(default_factory=list)  # DSpark: the device draft's proposal after tokens[-1]
    end_session: bool = False  # the client's end-of-session hint: the session's retention ends with this request
    sched: SchedState = field(default_factory=SchedState)
    out: OutputState = field(default_factory=OutputState)

    @property
    def status(self) -> str:
        return self.sched.status

    @property
    def in_prefill(self) -> bool:
        return self.sched.num_computed < self.sched.prefill_end

    def refresh_hashes(self):
        self.sched.hashes = block_hashes(self.tokens, self.cache_salt, parents=self.sched.hashes)
