"""Engine arguments (names follow vLLM's flags where the concept matches)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv41_jax.kv_format import pages_for
from dsv41_jax.ops import check_kernels


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass
class EngineArgs:
    max_model_len: int = 1024
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    long_prefill_token_threshold: int = 0  # 0: off
    prefill_schedule_interval: int = 1  # >1: run prefills only every N steps while decodes are running
    swa_bounded_replay: bool = True
    enable_prefix_caching: bool = True
    num_pages: int = 0  # 0: derived from max_model_len * max_num_seqs * 2
    snapshot_slots: int = 0  # exact mode SWA snapshots (0: 2 * max_num_seqs)
    session_ttl_s: float = 600.0  # a session's cached prefix outlives anonymous pages this long
    max_queued_requests: int = 1024  # admission control for the API servers
    enable_prompt_logprobs: bool = True  # compile the every-row-logits prefill programs (echo + logprobs)
    execution: str = "compiled"  # compiled | eager
    kernels: str = "xla"  # xla | pallas
    compilation_cache_dir: str | None = None
    prefill_buckets: tuple[int, ...] = ()  # () = powers of two from 16 to max_num_batched_tokens
    decode_buckets: tuple[int, ...] = ()  # () = powers of two up to max_num_seqs
    seed: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def resolved(self, cfg) -> EngineArgs:
        """Fill derived defaults and validate against the model config."""
        a = EngineArgs(**self.__dict__)
        W = cfg.window_size
        if a.max_model_len < 2 or a.max_model_len > cfg.max_seq_len:
            raise ValueError(f"max_model_len {a.max_model_len} must be in [2, {cfg.max_seq_len}]")
        if a.max_num_batched_tokens < W:
            raise ValueError(f"max_num_batched_tokens must be >= the window ({W}): the final prefill chunk "
                             "carries the decoder's last-window rows")
        if a.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if a.execution not in ("compiled", "eager"):
            raise ValueError(f"--execution must be compiled or eager, got {a.execution!r}")
        check_kernels(a.kernels)  # names the ops without a Pallas version; never a silent fallback
        if a.tensor_parallel_size != 1 or a.data_parallel_size != 1 or a.enable_expert_parallel:
            raise ValueError("tensor/data/expert parallelism is not available in this build (single device)")
        if not a.prefill_buckets:
            a.prefill_buckets = _pow2_buckets(min(16, a.max_num_batched_tokens), a.max_num_batched_tokens)
        a.prefill_buckets = tuple(sorted(set(a.prefill_buckets)))
        if a.prefill_buckets[-1] < a.max_num_batched_tokens:
            raise ValueError("the largest prefill bucket must cover max_num_batched_tokens")
        if not a.decode_buckets:
            a.decode_buckets = _pow2_buckets(1, a.max_num_seqs)
        a.decode_buckets = tuple(sorted(set(a.decode_buckets)))
        if a.decode_buckets[-1] < a.max_num_seqs:
            raise ValueError("the largest decode bucket must cover max_num_seqs")
        pages_per_seq = pages_for(a.max_model_len)
        if not a.num_pages:
            a.num_pages = 1 + 2 * a.max_num_seqs * pages_per_seq
        if a.num_pages < 1 + pages_per_seq:
            raise ValueError(f"num_pages {a.num_pages} cannot hold one max_model_len sequence ({pages_per_seq} pages)")
        if not a.snapshot_slots:
            a.snapshot_slots = 2 * a.max_num_seqs
        return a
