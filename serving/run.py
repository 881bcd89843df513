"""`python -m serving.run`: serve a model over gRPC (dsv41.v1) and OpenAI-compatible HTTP in one process.

With no arguments it serves the embedded default model (dsv41_jax/default_model: a small V4.1-architecture model
trained on the Python standard library, its BPE tokenizer and chat template, an 8K context; on a CPU sized for a
4-lane agentic session) on loopback: HTTP on 8000, gRPC on 50051, and prints both addresses when ready. Flags follow
vLLM's names where the concept is the same. See docs/SERVING.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from serving.engine.config import EngineArgs

DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "dsv41-jax", "jax")
PRESETS = ("tiny", "small", "medium", "full")
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "dsv41_jax" / "default_model")
DEFAULT_MODEL_NAME = "dsv41-stdlib-8k"
CPU_DEFAULTS = {"max_num_seqs": 4, "max_num_batched_tokens": 1024}  # a 4-lane agentic session on 2 CPU cores
_D = EngineArgs()  # engine defaults, so the help text stays in sync with the engine


def _buckets(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"buckets must be positive integers, got {text!r}")
    return vals


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving.run", description=__doc__, formatter_class=_Formatter,
        epilog="Examples:\n  python -m serving.run\n  python -m serving.run --model /ckpt/dsv41-flash --tokenizer "
               "/ckpt/dsv41-flash/tokenizer.json --max-model-len 32768 --host 0.0.0.0")
    BoolOpt = argparse.BooleanOptionalAction

    g = p.add_argument_group("model")
    g.add_argument("--model", "--checkpoint", dest="model", default=DEFAULT_MODEL,
                   help="the embedded default model (a trained small model), a preset (tiny | small | medium | full: "
                        "random weights) or a checkpoint directory "
                        "(official HF layout or orbax)")
    g.add_argument("--weight-format", default=None, help="checkpoint weight format passed to the loader "
                                                          "(None: detected)")
    g.add_argument("--tokenizer", default="auto",
                   help="byte (UTF-8 bytes; ids 256/257 are BOS/EOS), a path to an HF tokenizer.json (or its "
                        "directory), or none (token-id prompts only; text fields stay empty). auto: the checkpoint "
                        "directory's tokenizer.json if it has one, else byte")
    g.add_argument("--served-model-name", default=None,
                   help="the model name in the API (None: the preset name or the checkpoint directory name)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file or string, or dsv41 (None: the tokenizer's, else the built-in "
                        "DeepSeek-V4.1 encoding)")
    g.add_argument("--seed", type=int, default=_D.seed, help="seed for random weights and default sampling seeds")

    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (None: min(model max_seq_len, 8192)); a preset's random "
                        "weights accept any length")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most requests running at once (None: {CPU_DEFAULTS['max_num_seqs']} on a CPU, "
                        f"{_D.max_num_seqs} otherwise)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget of one engine step, >= the sliding window (None: "
                        f"{CPU_DEFAULTS['max_num_batched_tokens']} on a CPU, {_D.max_num_batched_tokens} otherwise)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=_D.long_prefill_token_threshold,
                   help="cap on one request's prefill chunk while others wait (0: off)")
    g.add_argument("--prefill-schedule-interval", type=int, default=_D.prefill_schedule_interval,
                   help="while decodes run, schedule prefill chunks only every N steps (1: every step)")
    g.add_argument("--swa-bounded-replay", action=BoolOpt, default=_D.swa_bounded_replay,
                   help="on a prefix-cache hit, replay only the last window of cached tokens instead of "
                        "storing sliding-window snapshots (--no-swa-bounded-replay: exact mode)")
    g.add_argument("--swa-snapshot-slots", type=int, default=_D.snapshot_slots,
                   help="exact mode: device slots for SWA snapshots, one per conversation whose next turn should "
                        "resume without recomputing its prompt (0: 8 x max_num_seqs; LRU beyond)")
    g.add_argument("--enable-prefix-caching", action=BoolOpt, default=_D.enable_prefix_caching,
                   help="reuse the global KV of shared prompt prefixes (64-token pages)")
    g.add_argument("--num-pages", type=int, default=_D.num_pages,
                   help="global-KV pages of 64 tokens (0: 2 x max_num_seqs x pages per max_model_len)")
    g.add_argument("--session-ttl", type=float, default=_D.session_ttl_s,
                   help="seconds a session's cached prefix is protected from eviction after its request")
    g.add_argument("--max-queued-requests", type=int, default=_D.max_queued_requests,
                   help="waiting requests beyond which new ones get 503 / RESOURCE_EXHAUSTED")
    if hasattr(_D, "enable_prompt_logprobs"):
        g.add_argument("--enable-prompt-logprobs", action=BoolOpt, default=_D.enable_prompt_logprobs,
                       help="compile the programs for prompt logprobs (echo + logprobs, lm-eval loglikelihood)")
    g.add_argument("--kernels", choices=("auto", "xla", "pallas"), default=_D.kernels,
                   help="kernels (auto: the Pallas kernels on a GPU where they serve the model, else XLA)")
    g.add_argument("--execution", choices=("compiled", "eager"), default=_D.execution,
                   help="compiled: fixed-shape programs compiled at start-up; eager: per-op dispatch")
    g = p.add_argument_group("parallelism (docs/PARALLELISM.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=_D.tensor_parallel_size,
                   help="devices of the tensor-parallel group: heads, WO-A groups and expert intermediate dims split, "
                        "the latent KV replicated (low latency)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=_D.data_parallel_size,
                   help="data-parallel attention ranks, each owning its requests, pages and prefix cache; requests "
                        "placed by session / cached prefix / load")
    g.add_argument("--enable-expert-parallel", action="store_true", default=_D.enable_expert_parallel,
                   help="split the routed experts across the data-parallel ranks (DEP, all-to-all dispatch)")
    g.add_argument("--all2all-backend", choices=("auto", "ragged", "padded"), default=_D.all2all_backend,
                   help="DEP token exchange: ragged_all_to_all (GPU), capacity-padded all_to_all (any backend); "
                        "auto: ragged on GPU, padded elsewhere")
    g.add_argument("--moe-capacity-factor", type=float, default=_D.moe_capacity_factor,
                   help="DEP: rows a rank may receive per step, as a multiple of its own routed rows; rows beyond "
                        "it are dropped and counted (0: lossless)")
    g.add_argument("--dp-load-cap", type=int, default=_D.dp_load_cap,
                   help="a returning session stays on its rank until that rank holds this many more requests "
                        "than the least loaded one (0: max_num_seqs)")
    g.add_argument("--nnodes", type=int, default=1, help="processes (hosts) of one engine, through jax.distributed")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this process's rank; 0 serves the APIs, the others replay its device calls (headless)")
    g.add_argument("--master-addr", default="127.0.0.1", help="address of the node-rank-0 coordinator")
    g.add_argument("--master-port", type=int, default=29500, help="port of the node-rank-0 coordinator")
    g.add_argument("--prefill-buckets", type=_buckets, default=None,
                   help="prefill chunk sizes to compile, e.g. 64,256 (None: powers of two up to "
                        "max_num_batched_tokens; on CPU just max_num_batched_tokens)")
    g.add_argument("--decode-buckets", type=_buckets, default=None,
                   help="decode batch sizes to compile, e.g. 1,8 (None: powers of two up to max_num_seqs; on "
                        "CPU just max_num_seqs)")
    g.add_argument("--compilation-cache-dir", default=DEFAULT_CACHE_DIR,
                   help="JAX persistent compilation cache: a second start reuses compiled programs ('none' "
                        "disables)")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one; -1: no HTTP)")
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: pick a free one; -1: no gRPC)")
    g.add_argument("--max-request-bytes", type=int, default=0,
                   help="largest accepted request body / gRPC message in bytes (0: max(1 MiB, 32 x "
                        "max_model_len))")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="logging level (logs go to stderr; the ready lines to stdout)")

    g = p.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" parse the model\'s tool calls into tool_calls (needs '
                        '--tool-call-parser); "required" and named functions work without it')
    g.add_argument("--tool-call-parser", choices=("deepseek_v41",), default=None,
                   help="the tool-call syntax to parse: deepseek_v41 (DSML <｜DSML｜ calls> blocks)")

    g = p.add_argument_group("security")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (HTTP) and 'authorization' metadata (gRPC); "
                        "repeat for several keys; each key is its own prefix-cache namespace. Default: the "
                        "VLLM_API_KEY environment variable, else no authentication")
    g.add_argument("--protect-metrics", action="store_true", help="require an API key on /metrics too")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM) for HTTP and gRPC")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM) for HTTP and gRPC")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="CA certificates (PEM): clients must present a certificate they signed (mutual TLS)")
    g.add_argument("--max-requests-per-key", type=int, default=0,
                   help="open requests per API key beyond which new ones get 429 / RESOURCE_EXHAUSTED (0: no cap)")
    g.add_argument("--max-queued-tokens-per-key", type=int, default=0,
                   help="queued (not yet running) prompt tokens per API key beyond which new requests get 429 / "
                        "RESOURCE_EXHAUSTED (0: no cap)")
    return p


def engine_args(a: argparse.Namespace, max_seq_len: int, on_cpu: bool) -> EngineArgs:
    mbt = a.max_num_batched_tokens or (CPU_DEFAULTS["max_num_batched_tokens"] if on_cpu else _D.max_num_batched_tokens)
    seqs = a.max_num_seqs or (CPU_DEFAULTS["max_num_seqs"] if on_cpu else _D.max_num_seqs)
    kw = dict(max_model_len=a.max_model_len or min(max_seq_len, 8192), max_num_seqs=seqs,
              max_num_batched_tokens=mbt, long_prefill_token_threshold=a.long_prefill_token_threshold,
              prefill_schedule_interval=a.prefill_schedule_interval, swa_bounded_replay=a.swa_bounded_replay,
              snapshot_slots=a.swa_snapshot_slots, enable_prefix_caching=a.enable_prefix_caching,
              num_pages=a.num_pages, session_ttl_s=a.session_ttl,
              max_queued_requests=a.max_queued_requests, execution=a.execution, kernels=a.kernels,
              compilation_cache_dir=cache_dir(a), prefill_buckets=a.prefill_buckets or ((mbt,) if on_cpu else ()),
              decode_buckets=a.decode_buckets or ((seqs,) if on_cpu else ()), seed=a.seed,
              tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
              enable_expert_parallel=a.enable_expert_parallel, all2all_backend=a.all2all_backend,
              moe_capacity_factor=a.moe_capacity_factor, dp_load_cap=a.dp_load_cap)
    if hasattr(a, "enable_prompt_logprobs"):
        kw["enable_prompt_logprobs"] = a.enable_prompt_logprobs
    return EngineArgs(**kw)


def cache_dir(a) -> str | None:
    d = a.compilation_cache_dir
    if not d or d.lower() == "none":
        return None
    return os.path.expanduser(d)


def _tokenizer_spec(a) -> str:
    if a.tokenizer != "auto":
        return a.tokenizer
    if os.path.isdir(a.model) and os.path.isfile(os.path.join(a.model, "tokenizer.json")):
        return os.path.join(a.model, "tokenizer.json")
    return "byte"


def build(a: argparse.Namespace):
    """Load the model and tokenizer, compile the engine; returns (engine, ServerConfig)."""
    import jax

    from dsv41_jax.config import ModelConfig
    from serving.engine.engine import Engine, load_model, make_mesh, model_config_of, use_compilation_cache
    from serving.tokenizer import load_tokenizer

    log = logging.getLogger("serving.run")
    is_preset = not os.path.isdir(a.model)
    if is_preset and a.model not in PRESETS:
        raise ValueError(f"--model {a.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    on_cpu = jax.default_backend() == "cpu"
    cache = cache_dir(a)
    if cache:  # before the weights: init/convert programs are cached too
        os.makedirs(cache, exist_ok=True)
        use_compilation_cache(cache, a.execution)
    server_config(a)  # validate the server flags before any expensive work
    if is_preset:  # validate the flags before any expensive work
        longest = max(a.max_model_len or 0, ModelConfig.preset(a.model).max_seq_len)
        preset = ModelConfig.preset(a.model, max_seq_len=longest)
        engine_args(a, preset.max_seq_len, on_cpu).resolved(preset)
    t0 = time.perf_counter()
    log.info("loading %s (backend %s)", a.model, jax.default_backend())
    kw = {"weight_format": a.weight_format} if a.weight_format else {}
    model = a.model
    if is_preset and a.max_model_len and a.max_model_len > ModelConfig.preset(a.model).max_seq_len:
        model = ModelConfig.preset(a.model, max_seq_len=a.max_model_len)  # random weights: any context length
    known = model_config_of(model, a.weight_format)  # the mesh first: weights go straight onto their shards
    mesh = layout = None
    if known is not None:
        resolved = engine_args(a, known.max_seq_len, on_cpu).resolved(known)
        mesh, layout = make_mesh(resolved), resolved.parallel
    cfg, params = load_model(model, a.seed, mesh=mesh, parallel=layout, **kw)
    args = engine_args(a, cfg.max_seq_len, on_cpu)
    spec = _tokenizer_spec(a)
    if spec == "byte" and cfg.vocab_size < 256:
        log.warning("vocabulary %d < 256: no byte tokenizer, serving token ids only", cfg.vocab_size)
        spec = "none"
    tok = load_tokenizer(spec, cfg.vocab_size)
    log.info("model loaded in %.1f s; compiling the engine's programs", time.perf_counter() - t0)
    engine = Engine(cfg, args, params=params, tokenizer=tok, progress=True)
    log.info("engine ready: %d programs in %.1f s (compilation cache: %s)", engine.runner.compile_count,
             engine.warmup_s, cache or "off")
    default_name = DEFAULT_MODEL_NAME if os.path.abspath(a.model) == DEFAULT_MODEL else \
        os.path.basename(os.path.normpath(a.model))
    name = a.served_model_name or (a.model if is_preset else default_name)
    config = server_config(a, name, {a.model, cfg.name})
    return engine, config


def server_config(a: argparse.Namespace, name: str | None = None, aliases=()):
    """The ServerConfig of the parsed flags (validated before the model loads)."""
    from serving.api.security import keys_from
    from serving.api.server import ServerConfig

    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (deepseek_v41)")
    if bool(a.ssl_certfile) != bool(a.ssl_keyfile):
        raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if a.ssl_ca_certs and not a.ssl_certfile:
        raise ValueError("--ssl-ca-certs (mutual TLS) needs --ssl-certfile and --ssl-keyfile")
    for f in (a.ssl_certfile, a.ssl_keyfile, a.ssl_ca_certs):
        if f and not os.path.isfile(f):
            raise FileNotFoundError(f"no such file: {f}")
    if a.max_requests_per_key < 0 or a.max_queued_tokens_per_key < 0:
        raise ValueError("per-key limits must be >= 0")
    return ServerConfig(host=a.host, port=a.port, grpc_port=a.grpc_port, served_model_name=name,
                        aliases=set(aliases), chat_template=a.chat_template, max_request_bytes=a.max_request_bytes,
                        shutdown_timeout=a.shutdown_timeout, enable_auto_tool_choice=a.enable_auto_tool_choice,
                        tool_call_parser=a.tool_call_parser, api_keys=keys_from(a.api_key).keys,
                        protect_metrics=a.protect_metrics, ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile,
                        ssl_ca_certs=a.ssl_ca_certs, max_requests_per_key=a.max_requests_per_key,
                        max_queued_tokens_per_key=a.max_queued_tokens_per_key)


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.log_level != "debug":
        logging.getLogger("jax").setLevel(logging.WARNING)  # backend probing (no TPU, ...) is not news
    if a.nnodes > 1:  # before JAX starts a backend
        from serving.engine import multihost

        try:
            multihost.initialize(a.master_addr, a.master_port, a.nnodes, a.node_rank)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        engine, config = build(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.node_rank > 0:  # headless: replay the driver's device calls until it stops
        logging.getLogger("serving.run").info("node %d following node 0", a.node_rank)
        engine.follow()
        return 0
    from serving.api.server import serve

    try:
        return asyncio.run(serve(engine, config))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
