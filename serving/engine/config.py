"""Engine arguments (names follow vLLM's flags where the concept matches), and their command-line metadata.

Each field that is a server flag carries a `Flag` in its metadata (`cli(...)`): the flag's spellings, help,
choices and, where the server derives it, the CLI default. `python -m serving.run` builds its parser and
docs/SERVING.md's flag table from these fields (serving/run.py), so a flag is added by adding its field here.

Parallelism (docs/PARALLELISM.md): `tensor_parallel_size` N (TP over N devices) or `data_parallel_size` N
(N attention ranks, each owning its requests, pages, rings and prefix cache) with `enable_expert_parallel`
(DEP: the routed experts split over those ranks). Under DP, `max_num_seqs`, `max_num_batched_tokens`,
`num_pages` and `snapshot_slots` are per rank (as each vLLM DP rank is an engine of its own);
`max_queued_requests` is for the whole engine. `resolved()` turns the flags into `parallel` (a
dsv41_jax.sharding.Parallel, None on one device) and rejects layouts the model or the devices cannot run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsv41_jax.kv_format import pages_for
from dsv41_jax.ops import (
    AUTO_XLA_OPS,
    KERNEL_CHOICES,
    check_kernels,
    check_kernels_with_parallel,
    missing_pallas_ops,
    pallas_config_problems,
)
from dsv41_jax.sharding import A2A_CHOICES, Parallel, check_layout
from serving.engine.engram_host import OFFLOAD_THRESHOLD_GIB, EngramConfig
from serving.engine.spec_decode import SpeculativeConfig

KERNELS = ("auto", *KERNEL_CHOICES)  # --kernels
EXECUTIONS = ("compiled", "eager")  # --execution
A2A_FLAG_CHOICES = tuple(c for c in A2A_CHOICES if c != "emulated")  # --all2all-backend ("emulated": CPU tests)
# The server's sizing on a CPU where --max-num-seqs / --max-num-batched-tokens are not given: a 4-lane agentic
# session on 2 cores (serving/run.py applies it; the engine's own defaults are the fields').
CPU_SERVER_DEFAULTS = {"max_num_seqs": 4, "max_num_batched_tokens": 1024}
DEFAULT_COMPILATION_CACHE_DIR = os.path.join("~", ".cache", "dsv41-jax", "jax")  # `python -m serving.run`'s default
# The smallest shapes a CPU server compiles quickly (one prefill and one decode bucket: 4 programs). The API
# tests' shared server, their `python -m serving.run` subprocesses and the benchmarks' --cpu-smoke runs all use
# them, so each compiles its programs once into the shared compilation cache.
SMALL_ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, prefill_buckets=(128,),
                         decode_buckets=(8,))


def shared_cache_dir() -> str:
    """The persistent compilation cache shared by the tests, the notebooks, the benchmarks' smoke runs and their
    server subprocesses: $DSV41_COMPILATION_CACHE_DIR, else DEFAULT_COMPILATION_CACHE_DIR (expanded)."""
    return os.path.expanduser(os.environ.get("DSV41_COMPILATION_CACHE_DIR", DEFAULT_COMPILATION_CACHE_DIR))


FIELD_DEFAULT = object()  # Flag.default: the EngineArgs field's own default


@dataclass(frozen=True)
class Flag:
    """A command-line flag: of an EngineArgs field (in its metadata, see `cli`) or of the server (serving/run.py).

    names: the spellings, the first is the canonical one (vLLM's); () = `--` + the field name with dashes.
    default: the CLI default where it differs from the field's (None: the server derives it, `help` says how).
    shown: the default as docs/SERVING.md's table shows it (None: the default itself).
    A bool is `--[no-]NAME`, a tuple of ints a comma list, other types parse as the field's annotation."""
    help: str
    names: tuple[str, ...] = ()
    group: str = "engine"
    choices: tuple[str, ...] | None = None
    default: object = FIELD_DEFAULT
    shown: str | None = None
    action: str | None = None  # an argparse action for the server's list-valued flags ("append")
    metavar: str | None = None


def cli(help: str, **kw) -> dict:
    """Field metadata that makes an EngineArgs field a server flag (see `Flag`)."""
    return {"cli": Flag(help, **kw)}


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


_CPU = CPU_SERVER_DEFAULTS
_P = "parallelism"


@dataclass
class EngineArgs:
    max_model_len: int = field(default=1024, metadata=cli(
        "longest prompt + output in tokens (None: min(model max_seq_len, 8192)); a preset's random weights accept "
        "any length", default=None, shown="min(model max, 8192)"))
    max_num_seqs: int = field(default=8, metadata=cli(
        f"most requests running at once (None: {_CPU['max_num_seqs']} on a CPU, 8 otherwise)", default=None,
        shown=f"{_CPU['max_num_seqs']} on a CPU, else 8"))
    max_num_batched_tokens: int = field(default=256, metadata=cli(
        f"token budget of one engine step, >= the sliding window (None: {_CPU['max_num_batched_tokens']} on a CPU, "
        "256 otherwise)", default=None, shown=f"{_CPU['max_num_batched_tokens']} on a CPU, else 256"))
    long_prefill_token_threshold: int = field(default=0, metadata=cli(
        "cap on one request's prefill chunk while others wait (0: off)"))
    prefill_schedule_interval: int = field(default=1, metadata=cli(
        "while decodes run, schedule prefill chunks only every N steps (1: every step)"))
    swa_bounded_replay: bool = field(default=True, metadata=cli(
        "on a prefix-cache hit, replay only the last window of cached tokens instead of storing sliding-window "
        "snapshots (--no-swa-bounded-replay: exact mode)"))
    enable_prefix_caching: bool = field(default=True, metadata=cli(
        "reuse the global KV of shared prompt prefixes (64-token pages)"))
    num_pages: int = field(default=0, metadata=cli(
        "global-KV pages of 64 tokens (0: 1 + 2 x max_num_seqs x pages per max_model_len)"))
    snapshot_slots: int = field(default=0, metadata=cli(  # bench/agentx/snapshot_sim.py
        "exact mode: device slots for SWA snapshots (about 2.6 MiB each for medium), one per conversation whose "
        "next turn should resume without recomputing its prompt (0: 8 x max_num_seqs); LRU beyond: a warm turn "
        "whose snapshot was evicted recomputes its whole cached prefix (dsv41:swa_snapshot_misses_total)",
        names=("--swa-snapshot-slots",)))
    session_ttl_s: float = field(default=600.0, metadata=cli(
        "seconds a session's cached prefix pages (and exact-mode snapshots) stay protected from eviction after its "
        "last request (session id: the x-session-id header or session_id field; 0: no protection)",
        names=("--session-ttl-s", "--session-ttl")))
    kv_offloading_size: float = field(default=0.0, metadata=cli(
        "GiB of host memory for prefix-cache pages evicted from the device pool: copied out asynchronously, "
        "copied back on a later hit (serving/engine/host_tier.py; 0: off)"))
    max_queued_requests: int = field(default=1024, metadata=cli(
        "waiting requests beyond which new ones get 503 / RESOURCE_EXHAUSTED"))
    enable_prompt_logprobs: bool = field(default=True, metadata=cli(
        "compile the programs for prompt logprobs (echo + logprobs, lm-eval loglikelihood)"))
    execution: str = field(default="compiled", metadata=cli(
        "compiled: fixed-shape programs compiled at start-up; eager: per-op dispatch (the step under "
        "jax.disable_jit(): ~60K op dispatches per medium step, the eager day-0 baseline; its ops go to the persistent "
        "compilation cache too)", choices=EXECUTIONS))
    async_scheduling: bool = field(default=True, metadata=cli(
        "dispatch each step before collecting the previous one: a decode row takes the token still on the device "
        "(serving/engine/device_tokens.py), so the host's scheduling and kernel launches overlap the device's step; "
        "steps with a structured-output request, speculative decoding, host Engram tables and TP / DP meshes "
        "collect first (--no-async-scheduling: always)"))
    kernels: str = field(default="auto", metadata=cli(
        "auto: the Pallas kernels on a GPU where they serve the model (bf16 compute, FP8/FP4 KV, window a multiple "
        "of 64, compiled execution; under TP and DP / DEP too) except those measured slower than XLA's fusions or "
        "not yet timed (dsv41_jax.ops.AUTO_XLA_OPS), XLA's ops elsewhere (on a CPU the kernels would run "
        "interpreted); on the H200 (medium) Pallas decodes 2.3-3.1x and prefills 2.5x faster (docs/BENCHMARKS.md); "
        "pallas refuses a model it cannot serve, naming why", choices=KERNELS))
    compilation_cache_dir: str | None = field(default=None, metadata=cli(
        "JAX persistent compilation cache: a second start reuses compiled programs (none: off)",
        default=DEFAULT_COMPILATION_CACHE_DIR))
    compile_threads: int = field(default=1, metadata=cli(
        "XLA compilations (and program-cache loads) at once at start-up; the programs are traced one after "
        "another, each while the compilations of those before it run (1: one at a time, overlapping the next "
        "trace)"))
    program_cache: bool = field(default=False, metadata=cli(
        "load the programs an earlier start compiled with the same code, model, flags and devices from the "
        "compilation cache directory without tracing them (serving/engine/program_cache.py: a restart in seconds); "
        "--no-program-cache: trace every program (JAX's own cache still matches them by their lowered module). "
        "Engine() callers get it off: code that patches traced functions must not meet a stored program",
        default=True))
    prefill_buckets: tuple[int, ...] = field(default=(), metadata=cli(  # () = powers of two from 16 to max_n_b_t
        "prefill chunk sizes to compile, e.g. 64,256, each 2-3 programs (None: powers of two up to "
        "max_num_batched_tokens; on a CPU just max_num_batched_tokens)", default=None,
        shown="powers of two; on a CPU one"))
    decode_buckets: tuple[int, ...] = field(default=(), metadata=cli(  # () = powers of two up to max_num_seqs
        "decode batch sizes to compile, e.g. 1,8, each one program (None: powers of two up to max_num_seqs; on a "
        "CPU just max_num_seqs)", default=None, shown="powers of two; on a CPU one"))
    seed: int = field(default=0, metadata=cli("seed for random weights and default sampling seeds", group="model"))
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    tensor_parallel_size: int = field(default=1, metadata=cli(
        "devices of the tensor-parallel group: heads, WO-A groups and expert intermediate dims split, the latent KV "
        "replicated (low latency)", names=("--tensor-parallel-size", "-tp"), group=_P))
    data_parallel_size: int = field(default=1, metadata=cli(
        "data-parallel attention ranks, each owning its requests, pages and prefix cache; requests placed by "
        "session / cached prefix / load", names=("--data-parallel-size", "-dp"), group=_P))
    enable_expert_parallel: bool = field(default=False, metadata=cli(
        "split the routed experts across the data-parallel ranks (DEP, all-to-all dispatch)", group=_P))
    all2all_backend: str = field(default="auto", metadata=cli(
        "DEP token exchange: ragged_all_to_all (GPU), capacity-padded all_to_all (any backend); auto: ragged on "
        "GPU, padded elsewhere", choices=A2A_FLAG_CHOICES, group=_P))
    moe_capacity_factor: float = field(default=0.0, metadata=cli(
        "DEP: rows a rank may receive per step, as a multiple of its own routed rows; rows beyond it are dropped "
        "and counted (0: lossless)", group=_P))
    dp_load_cap: int = field(default=0, metadata=cli(
        "a returning session stays on its rank until that rank holds this many more requests than the least "
        "loaded one (0: max_num_seqs)", group=_P))
    engram_config: str | dict | None = field(default=None, metadata=cli(
        'Engram tables, as JSON with vLLM\'s keys: {"cpu_offload": true} keeps them in host memory (one copy per '
        "host in /dev/shm, huge pages where the OS allows), rows gathered by host threads and copied to the GPU "
        "before each step (serving/engine/engram_host.py; other keys: use_thp, dp_shared_memory, shm_dir, "
        "keep_shared, gather_threads, prefetch, pinned_staging, rows_in_call, offload_threshold_gib). Default: host "
        f"memory for tables over {OFFLOAD_THRESHOLD_GIB:g} GiB (the full model's 189 GiB), the device otherwise",
        metavar="JSON"))
    speculative_config: str | None = field(default=None, metadata=cli(
        "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2}' (prompt lookup) or '{\"method\": \"dspark\", "
        "\"num_speculative_tokens\": 5}' (V4.1's draft); k in 1..5; each decode step verifies 1 + k rows per "
        "request in one program (docs/SERVING.md, Speculative decoding). Not given: the server speculates with the "
        "model's DSpark draft on a GPU where the model directory records it as measured to help (the embedded default "
        "model does); none: off", group="speculative decoding"))
    force_mesh: bool = False  # run the sharded programs even on one device (a mesh of size 1; benchmarks)
    parallel: Parallel | None = None  # resolved from the flags above (do not set)
    engram: EngramConfig | None = None  # resolved from engram_config (do not set)
    speculative: SpeculativeConfig | None = None  # resolved from speculative_config (do not set)
    xla_ops: tuple[str, ...] = ()  # resolved: ops kept on XLA beside the Pallas kernels (auto; do not set)

    def resolved(self, cfg) -> EngineArgs:
        """Fill derived defaults and validate against the model config."""
        a = EngineArgs(**self.__dict__)
        W = cfg.window_size
        if a.max_model_len < 2 or a.max_model_len > cfg.max_seq_len:
            raise ValueError(f"max_model_len {a.max_model_len} must be in [2, {cfg.max_seq_len}]")
        if a.compile_threads < 1:
            raise ValueError(f"compile_threads must be >= 1, got {a.compile_threads}")
        if a.max_num_batched_tokens < W:
            raise ValueError(f"max_num_batched_tokens must be >= the window ({W}): the final prefill chunk "
                             "carries the decoder's last-window rows")
        if a.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if a.execution not in EXECUTIONS:
            raise ValueError(f"--execution must be compiled or eager, got {a.execution!r}")
        if a.kernels == "auto":
            a.kernels = auto_kernels(a, cfg)
            a.xla_ops = AUTO_XLA_OPS if a.kernels == "pallas" else ()
        check_kernels(a.kernels)  # names the ops without a Pallas version; never a silent fallback
        a.parallel = _layout(a, cfg)
        a.engram = EngramConfig.parse(a.engram_config).resolved(cfg)
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
        a.speculative = SpeculativeConfig.parse(a.speculative_config)
        if a.speculative is not None and a.speculative.num_speculative_tokens + 1 > W:
            raise ValueError(f"--speculative-config: 1 + num_speculative_tokens must be <= the sliding window ({W}): "
                             "the verify rows' ring slots are saved and restored within one window")
        if a.speculative is not None and a.speculative.method == "dspark":
            from serving.engine.spec_draft import check_model

            check_model(cfg, a.speculative.num_speculative_tokens)
        if a.speculative is not None and a.engram is not None and a.engram.cpu_offload:
            raise ValueError("--speculative-config with host Engram tables (--engram-config cpu_offload) is not "
                             "supported yet: the verify rows' Engram rows would be the drafts' (keep the tables on "
                             "the device)")
        if not a.snapshot_slots:  # one per conversation between turns: agentic lanes idle far longer than they run;
            a.snapshot_slots = 8 * a.max_num_seqs  # at 2 x seqs AgentX missed 11% of warm turns (snapshot_sim)
        return a


def auto_kernels(a: EngineArgs, cfg) -> str:
    """`--kernels auto`: the Pallas kernels where they are compiled for the hardware (a GPU) and serve this model
    and layout (on the H200, medium: decode ITL 2.3-3.1x, prefill and warm-turn TTFT 2.5x faster than XLA's ops;
    docs/BENCHMARKS.md), else XLA's. On a CPU they would run in the (slow) interpreter, and eager execution has no
    Pallas path; which parallel layouts they serve is ops.check_kernels_with_parallel's rule (TP and DP / DEP)."""
    import jax

    if jax.default_backend() != "gpu" or a.execution != "compiled" or missing_pallas_ops():
        return "xla"
    par = Parallel.from_flags(a.tensor_parallel_size, a.data_parallel_size, a.enable_expert_parallel, a.force_mesh)
    if pallas_config_problems(cfg):
        return "xla"
    try:
        check_kernels_with_parallel("pallas", par)
    except ValueError:
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
