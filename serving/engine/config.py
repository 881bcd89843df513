"""Engine arguments (names follow vLLM's flags where the concept matches).

Parallelism (docs/PARALLELISM.md): `tensor_parallel_size` N (TP over N devices) or `data_parallel_size` N
(N attention ranks, each owning its requests, pages, rings and prefix cache) with `enable_expert_parallel`
(DEP: the routed experts split over those ranks). Under DP, `max_num_seqs`, `max_num_batched_tokens`,
`num_pages` and `snapshot_slots` are per rank (as each vLLM DP rank is an engine of its own);
`max_queued_requests` is for the whole engine. `resolved()` turns the flags into `parallel` (a
dsv41_jax.sharding.Parallel, None on one device) and rejects layouts the model or the devices cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv41_jax.kv_format import pages_for
from dsv41_jax.ops import check_kernels, check_kernels_with_parallel, missing_pallas_ops, pallas_config_problems
from dsv41_jax.sharding import Parallel, check_layout


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
    snapshot_slots: int = 0  # exact mode SWA snapshots (0: 8 * max_num_seqs; bench/agentx/snapshot_sim.py)
    session_ttl_s: float = 600.0  # a session's cached prefix outlives anonymous pages this long
    max_queued_requests: int = 1024  # admission control for the API servers
    enable_prompt_logprobs: bool = True  # compile the every-row-logits prefill programs (echo + logprobs)
    execution: str = "compiled"  # compiled | eager
    kernels: str = "auto"  # auto (pallas on a GPU where the kernels serve the model, else xla) | xla | pallas
    compilation_cache_dir: str | None = None
    prefill_buckets: tuple[int, ...] = ()  # () = powers of two from 16 to max_num_batched_tokens
    decode_buckets: tuple[int, ...] = ()  # () = powers of two up to max_num_seqs
    seed: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "auto"  # DEP token exchange: auto | ragged (GPU) | padded | emulated (CPU tests)
    moe_capacity_factor: float = 0.0  # DEP: rows a rank may receive per call / its own routed rows (0: lossless)
    dp_load_cap: int = 0  # DEP/DP: a session leaves its rank once that rank holds this many more requests
    #                       than the least loaded one (0: max_num_seqs)
    force_mesh: bool = False  # run the sharded programs even on one device (a mesh of size 1; benchmarks)
    parallel: Parallel | None = None  # resolved from the flags above (do not set)

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
        if a.kernels == "auto":
            a.kernels = auto_kernels(a, cfg)
        check_kernels(a.kernels)  # names the ops without a Pallas version; never a silent fallback
        a.parallel = _layout(a, cfg)
        if a.dp_load_cap < 0:
            raise ValueError("dp_load_cap must be >= 0")
        if not a.dp_load_cap:
            a.dp_load_cap = a.max_num_seqs
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
        if not a.snapshot_slots:  # one per conversation between turns: agentic lanes idle far longer than they run;
            a.snapshot_slots = 8 * a.max_num_seqs  # at 2 x seqs AgentX missed 11% of warm turns (snapshot_sim)
        return a


def auto_kernels(a: EngineArgs, cfg) -> str:
    """`--kernels auto`: the Pallas kernels where they are compiled for the hardware (a GPU) and serve this model
    and layout (on the H200, medium: decode ITL 2.3-3.1x, prefill and warm-turn TTFT 2.5x faster than XLA's ops;
    docs/BENCHMARKS.md), else XLA's. On a CPU they would run in the (slow) interpreter, and eager execution and
    tensor parallelism have no Pallas path yet."""
    import jax

    if jax.default_backend() != "gpu" or a.execution != "compiled" or missing_pallas_ops():
        return "xla"
    par = Parallel.from_flags(a.tensor_parallel_size, a.data_parallel_size, a.enable_expert_parallel, a.force_mesh)
    if (par is not None and par.mode == "tp") or pallas_config_problems(cfg):
        return "xla"
    return "pallas"


def _layout(a: EngineArgs, cfg) -> Parallel | None:
    """The parallel layout of the flags, checked against the model and the visible devices."""
    import jax

    par = Parallel.from_flags(a.tensor_parallel_size, a.data_parallel_size, a.enable_expert_parallel,
                              a.force_mesh, a2a=a.all2all_backend, capacity_factor=a.moe_capacity_factor)
    if par is None:
        return None
    n = jax.device_count()
    if par.size > n:
        kind = "tensor" if par.mode == "tp" else "data"
        flag = "--tensor-parallel-size" if par.mode == "tp" else "--data-parallel-size"
        raise ValueError(f"{kind} parallelism is not available with {n} device(s): {flag} {par.size} needs "
                         f"{par.size} devices")
    check_layout(cfg, par, n, jax.process_count())
    if a.execution == "eager":
        raise ValueError("--execution eager runs on one device only (parallel layouts need compiled programs)")
    check_kernels_with_parallel(a.kernels, par)
    return par.resolved(jax.default_backend())
