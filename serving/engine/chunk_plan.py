"""The chunk plan: the one place that says, for each piece of work the scheduler hands out, which rows the
decoder band runs on, how the sliding windows are clipped, where global-KV writes start, and whether a token
is sampled afterwards. The runner picks its compiled program from the plan and the model applies the plan's
values as given; nobody re-derives them (the CED rule: docs/ARCHITECTURE.md; the model side: dsv41_jax.model).

Rules (W = the sliding window):
- decode (one generated token): decoder on that row; clips as the request left them; sample. With speculative
  decoding the plan also carries `spec`, the most draft rows the request may verify after that row (its
  budget and pages are reserved for them; the position commits only the row itself: accepted drafts are
  committed when the verification comes back, Scheduler.accepted).
- prompt logprobs: decoder and logits on every row (exact, no CED trimming); sample at the prompt's end.
- SWA bounded replay (default): a non-final prompt chunk skips the decoder band (only layer 20's global-KV
  build runs); the final chunk runs the decoder on its last W rows with the decoder's window clipped at the
  first of them (positions < pos0 + n - W are never read), then samples. The scheduler makes that chunk at
  least W long when the prompt allows (`min_final_rows`).
- exact mode (--no-swa-bounded-replay): the decoder runs on every row; sample after the final chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.engine.request import Request

DEC_NONE, DEC_WINDOW, DEC_ALL = "none", "window", "all"


@dataclass(frozen=True)
class ChunkPlan:
    req: Request
    pos0: int  # first position of the chunk (= req.sched.num_computed when planned)
    n: int  # tokens to compute: positions pos0 .. pos0 + n - 1
    decoder: str  # DEC_NONE | DEC_WINDOW | DEC_ALL
    enc_clip: int  # encoder-band SWA clip
    dec_clip: int  # decoder-band SWA clip
    write_from: int  # global-KV entries of groups starting below this are not written (cached prefix)
    sample: bool  # sample a token after this chunk
    all_logits: bool  # logits on every row (prompt logprobs), scored at the next prompt token
    is_decode: bool  # one generated token of a running request
    spec: int = 0  # decode: draft rows the request may verify after its token (speculative decoding)

    @property
    def end(self) -> int:
        return self.pos0 + self.n

    def dec_clip_after(self, window: int) -> int:
        """The request's decoder clip once this chunk ran (a trimmed decoder only holds the last W rows)."""
        if self.decoder == DEC_WINDOW:
            return max(self.end - window, self.dec_clip)
        return self.dec_clip


def decoder_rows(decoder: str, tokens: int, window: int) -> int:
    """Rows the decoder band runs on in a program of `tokens` rows: none, the last `window` (trimmed), or all."""
    return {DEC_NONE: 0, DEC_WINDOW: min(window, tokens), DEC_ALL: tokens}[decoder]


def min_final_rows(bounded_replay: bool, window: int) -> int:
    """Rows the final prompt chunk must carry so that the trimmed decoder sees the last window."""
    return window if bounded_replay else 1


def plan_chunk(req: Request, n: int, *, bounded_replay: bool, window: int, spec: int = 0) -> ChunkPlan:
    s = req.sched
    pos0 = s.num_computed
    final = pos0 + n >= len(req.tokens)
    common = dict(req=req, pos0=pos0, n=n, enc_clip=s.enc_clip, write_from=s.write_from)
    if not req.in_prefill:
        return ChunkPlan(**common, decoder=DEC_ALL, dec_clip=s.dec_clip, sample=True, all_logits=False,
                         is_decode=True, spec=spec)
    if req.sampling.prompt_logprobs is not None:
        return ChunkPlan(**common, decoder=DEC_ALL, dec_clip=s.dec_clip, sample=final, all_logits=True,
                         is_decode=False)
    if bounded_replay:
        if not final:
            return ChunkPlan(**common, decoder=DEC_NONE, dec_clip=s.dec_clip, sample=False, all_logits=False,
                             is_decode=False)
        return ChunkPlan(**common, decoder=DEC_WINDOW, dec_clip=max(s.dec_clip, pos0 + n - window), sample=True,
                         all_logits=False, is_decode=False)
    return ChunkPlan(**common, decoder=DEC_ALL, dec_clip=s.dec_clip, sample=final, all_logits=False,
                     is_decode=False)
