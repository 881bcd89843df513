"""`python -m serving.run`: serve a model over gRPC (dsv41.v1) and OpenAI-compatible HTTP in one process.

With no arguments it serves the embedded default model (dsv41_jax/default_model: a small V4.1-architecture model
trained on the Python standard library, its BPE tokenizer and chat template, an 8K context; on a CPU sized for a
4-lane agentic session) on loopback: HTTP on 8000, gRPC on 50051, and prints both addresses when ready. Flags follow
vLLM's names where the concept is the same. See docs/SERVING.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import typing
from pathlib import Path

from serving.api.openai_format import SPEC_METRICS_LEVELS
from serving.api.server import TOOL_PARSERS, ServerConfig
from serving.engine.config import CPU_SERVER_DEFAULTS, FIELD_DEFAULT, EngineArgs, Flag
from serving.engine.engram_host import EngramConfig

PRESETS = ("tiny", "small", "medium", "full")
DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "dsv41_jax" / "default_model")
DEFAULT_MODEL_NAME = "dsv41-pycode-8k"
LOG_LEVELS = ("debug", "info", "warning", "error")
GROUPS = {"model": "model", "engine": "engine", "parallelism": "parallelism (docs/PARALLELISM.md)",
          "speculative decoding": "speculative decoding", "multi-host": "multi-host", "server": "server",
          "tool calling": "tool calling", "security": "security"}
_S = ServerConfig()  # the server's defaults

# The server's own flags (every engine flag is an EngineArgs field: serving/engine/config.py). Each group's
# server flags come before its engine flags in --help and in docs/SERVING.md's table.
SERVER_FLAGS: tuple[tuple[str, Flag], ...] = (
    ("model", Flag(f"the embedded default model (a trained small model), a preset ({' | '.join(PRESETS)}: "
                   "random weights) or a checkpoint directory (official HF layout or orbax)",
                   names=("--model", "--checkpoint"), group="model", default=DEFAULT_MODEL,
                   shown="dsv41_jax/default_model")),
    ("weight_format", Flag("checkpoint weight format passed to the loader (None: detected)", group="model",
                           default=None)),
    ("tokenizer", Flag("byte (UTF-8 bytes; ids 256/257 are BOS/EOS), a path to an HF tokenizer.json (or its "
                       "directory), or none (token-id prompts only; text fields stay empty). auto: the checkpoint "
                       "directory's tokenizer.json if it has one, else byte", group="model", default="auto")),
    ("served_model_name", Flag("the model name in the API (None: the preset name or the checkpoint directory "
                               "name; the model path is accepted too)", group="model", default=None,
                               shown="preset / directory name")),
    ("chat_template", Flag("a Jinja chat template file or string, or dsv41 (None: the tokenizer's, else the "
                           "built-in DeepSeek-V4.1 encoding)", group="model", default=None,
                           shown="tokenizer's, else built-in")),
    ("per_request_spec_decode_metrics", Flag(
        "with --speculative-config: each response reports its own acceptance figures (vLLM's top-level "
        "metrics.speculative_decoding: mean acceptance length, acceptance rate and histogram, steps, drafted and "
        "accepted tokens; detailed adds each step's accepted count), HTTP (one-choice responses; the final usage "
        "chunk when streaming) and gRPC (Complete.speculative_decoding)", group="speculative decoding",
        default=_S.per_request_spec_decode_metrics, choices=SPEC_METRICS_LEVELS)),
    ("nnodes", Flag("processes (hosts) of one engine, through jax.distributed", group="multi-host", default=1)),
    ("node_rank", Flag("this process's rank; 0 serves the APIs, the others replay its device calls (headless)",
                       group="multi-host", default=0)),
    ("master_addr", Flag("address of the node-rank-0 coordinator", group="multi-host", default="127.0.0.1")),
    ("master_port", Flag("port of the node-rank-0 coordinator", group="multi-host", default=29500)),
    ("host", Flag("address to listen on (0.0.0.0: all interfaces)", group="server", default=_S.host)),
    ("port", Flag("HTTP port (0: pick a free one; -1: no HTTP)", group="server", default=_S.port)),
    ("grpc_port", Flag("gRPC port (0: pick a free one; -1: no gRPC)", group="server", default=_S.grpc_port)),
    ("max_request_bytes", Flag("largest accepted request body / gRPC message in bytes (0: max(1 MiB, 32 x "
                               "max_model_len))", group="server", default=_S.max_request_bytes)),
    ("shutdown_timeout", Flag("on SIGTERM, seconds in-flight requests may take to finish", group="server",
                              default=_S.shutdown_timeout)),
    ("log_level", Flag("logging level (logs go to stderr; the ready lines to stdout)", group="server",
                       default="info", choices=LOG_LEVELS)),
    ("enable_auto_tool_choice", Flag("let tool_choice \"auto\" parse the model's tool calls into tool_calls "
                                     "(needs --tool-call-parser; without it \"auto\", the default when tools are "
                                     "sent, is a 400); \"required\" and named functions work without it",
                                     group="tool calling", default=_S.enable_auto_tool_choice)),
    ("tool_call_parser", Flag("the tool-call syntax to parse: deepseek_v41 (DSML <｜DSML｜ calls> blocks)",
                              group="tool calling", default=_S.tool_call_parser, choices=TOOL_PARSERS)),
    ("api_key", Flag("require 'Authorization: Bearer KEY' on /v1/* and /engine/* (HTTP) and 'authorization' "
                     "metadata (gRPC); repeat for several keys; each key is its own prefix-cache namespace. "
                     "Default: the VLLM_API_KEY environment variable, else no authentication", group="security",
                     default=None, action="append", metavar="KEY", shown="$VLLM_API_KEY, else none")),
    ("protect_metrics", Flag("require an API key on /metrics too", group="security", default=_S.protect_metrics)),
    ("ssl_certfile", Flag("TLS certificate (PEM) for HTTP and gRPC", group="security", default=_S.ssl_certfile)),
    ("ssl_keyfile", Flag("TLS private key (PEM) for HTTP and gRPC", group="security", default=_S.ssl_keyfile)),
    ("ssl_ca_certs", Flag("CA certificates (PEM): clients must present a certificate they signed (mutual TLS)",
                          group="security", default=_S.ssl_ca_certs)),
    ("max_requests_per_key", Flag("open requests per API key beyond which new ones get 429 / RESOURCE_EXHAUSTED "
                                  "(0: no cap)", group="security", default=_S.max_requests_per_key)),
    ("max_queued_tokens_per_key", Flag("queued (not yet running) prompt tokens per API key beyond which new "
                                       "requests get 429 / RESOURCE_EXHAUSTED (0: no cap)", group="security",
                                       default=_S.max_queued_tokens_per_key)),
)


def _positive_ints(text: str) -> tuple[int, ...]:
    """A comma list of positive integers (sorted, unique)."""
    try:
        vals = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def engine_flags() -> list[tuple[str, Flag, object, type]]:
    """(field name, Flag, CLI default, the field's type) of every EngineArgs field that is a server flag."""
    hints = typing.get_type_hints(EngineArgs)
    out = []
    for f in dataclasses.fields(EngineArgs):
        flag = f.metadata.get("cli")
        if flag is not None:
            default = f.default if flag.default is FIELD_DEFAULT else flag.default
            out.append((f.name, flag, default, hints[f.name]))
    return out


def all_flags() -> list[tuple[str, Flag, object, type]]:
    """Every flag (dest, Flag, default, type), in --help order: by group, the server's flags first."""
    server = [(dest, fl, fl.default, type(fl.default) if fl.default is not None else str) for dest, fl in SERVER_FLAGS]
    rows = server + engine_flags()
    return sorted(rows, key=lambda r: (list(GROUPS).index(r[1].group), r not in server))


def _names(dest: str, flag: Flag) -> tuple[str, ...]:
    return flag.names or ("--" + dest.replace("_", "-"),)


def _argparse_kw(flag: Flag, default, typ) -> dict:
    kw = {"default": default, "help": flag.help.replace("%", "%%")}
    if flag.action:
        kw["action"] = flag.action
    elif typ is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(typ) is tuple:
        kw["type"] = _positive_ints
    else:
        kw["type"] = next(t for t in typing.get_args(typ) or (typ,) if t is not type(None))
    if flag.choices:
        kw["choices"] = flag.choices
    if flag.metavar or (flag.names and not flag.choices and typ is not bool):
        kw["metavar"] = flag.metavar or flag.names[0].lstrip("-").replace("-", "_").upper()
    return kw


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


class _PrintFlagTable(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(flag_table(), end="")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving.run", description=__doc__, formatter_class=_Formatter,
        epilog="Examples:\n  python -m serving.run\n  python -m serving.run --model /ckpt/dsv41-flash --tokenizer "
               "/ckpt/dsv41-flash/tokenizer.json --max-model-len 32768 --host 0.0.0.0")
    p.add_argument("--print-flag-table", action=_PrintFlagTable,
                   help="print docs/SERVING.md's flag table (markdown) and exit")
    groups = {k: p.add_argument_group(title) for k, title in GROUPS.items()}
    for dest, flag, default, typ in all_flags():
        groups[flag.group].add_argument(*_names(dest, flag), dest=dest, **_argparse_kw(flag, default, typ))
    return p


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def flag_table() -> str:
    """docs/SERVING.md's flag table, from the same flags as the parser."""
    lines = ["| flag | default | what |", "|---|---|---|"]
    for dest, flag, default, typ in all_flags():
        names = list(_names(dest, flag))
        if typ is bool and not flag.action:
            names[0] = names[0].replace("--", "--[no-]", 1)
        spell = ", ".join(f"`{n}`" for n in names)
        if flag.choices:
            spell += " " + " \\| ".join(f"`{c}`" for c in flag.choices)
        if flag.shown is not None:
            shown = flag.shown
        elif typ is bool:
            shown = "on" if default else "off"
        elif default is None:
            shown = "none"
        else:
            shown = f"`{default}`"
        lines.append(f"| {spell} | {_md(shown)} | {_md(flag.help)} |")
    return "\n".join(lines) + "\n"


def engine_args(a: argparse.Namespace, max_seq_len: int, on_cpu: bool) -> EngineArgs:
    """The EngineArgs of the parsed flags, with the server's defaults for what was not given (the model's
    context up to 8192 tokens; on a CPU CPU_SERVER_DEFAULTS and one bucket each; `none`: no compilation cache)."""
    kw = {name: getattr(a, name) for name, *_ in engine_flags()}
    sized = CPU_SERVER_DEFAULTS if on_cpu else {}
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        kw[name] = kw[name] or sized.get(name) or EngineArgs.__dataclass_fields__[name].default
    kw["max_model_len"] = kw["max_model_len"] or min(max_seq_len, 8192)
    kw["prefill_buckets"] = kw["prefill_buckets"] or ((kw["max_num_batched_tokens"],) if on_cpu else ())
    kw["decode_buckets"] = kw["decode_buckets"] or ((kw["max_num_seqs"],) if on_cpu else ())
    kw["compilation_cache_dir"] = cache_dir(a)
    return EngineArgs(**kw)


# When the server speculates without being asked: a model directory whose draft was trained and measured by
# training/train_dspark.py (its dspark.json) with a mean accepted length of at least this many tokens (of k + 1),
# on a GPU. Measured for the embedded default model (bench/results/spec_decode_dspark_default_h200.json: up to
# 4.4x tokens/s per user at batch 1, 3.7x at batch 8; on this project's 2-core CPU a verify step took 1.7x / 2.9x
# a plain step's time at batch 1 / 8, for 1.61x / 1.19x: bench/results/spec_decode_dspark_default_cpu.json,
# docs/BENCHMARKS.md). `--speculative-config none` turns it off; any explicit --speculative-config wins.
DRAFT_MIN_ACCEPTED = 2.0
DRAFT_RECORD = "dspark.json"


def with_measured_draft(args: EngineArgs, model: str, cfg, backend: str) -> EngineArgs:
    """args with DSpark speculation (k = the trained block's draft tokens) when the flag was not given and the
    model directory records a draft measured to help (see DRAFT_MIN_ACCEPTED); else args unchanged."""
    if args.speculative_config is not None or backend != "gpu" or not getattr(cfg, "has_draft", False):
        return args
    if not isinstance(model, str) or not os.path.isfile(os.path.join(model, DRAFT_RECORD)):
        return args
    if EngramConfig.parse(args.engram_config).resolved(cfg).cpu_offload:
        return args  # host Engram tables and speculation are not combined (EngineArgs.resolved says why)
    with open(os.path.join(model, DRAFT_RECORD)) as f:
        record = json.load(f)
    accepted = [e.get("mean_accepted_length", 0.0) for e in record.get("acceptance_greedy_heldout", {}).values()]
    if not accepted or min(accepted) < DRAFT_MIN_ACCEPTED:
        return args
    k = cfg.dspark_block_size
    return dataclasses.replace(args, speculative_config=json.dumps({"method": "dspark", "num_speculative_tokens": k}))


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
    """Check the flags, load the tokenizer, build the engine (it loads the model and compiles its programs);
    returns (engine, ServerConfig)."""
    import jax

    from dsv41_jax.config import ModelConfig
    from serving.engine.engine import Engine, load_model, model_config_of
    from serving.tokenizer import load_tokenizer

    log = logging.getLogger("serving.run")
    is_preset = not os.path.isdir(a.model)
    if is_preset and a.model not in PRESETS:
        raise ValueError(f"--model {a.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    server_config(a)  # the server flags, before any expensive work
    model = a.model
    if is_preset and a.max_model_len and a.max_model_len > ModelConfig.preset(a.model).max_seq_len:
        model = ModelConfig.preset(a.model, max_seq_len=a.max_model_len)  # random weights: any context length
    known = model_config_of(model, a.weight_format)  # the config without reading a weight
    if known is None:  # neither an HF nor an Orbax directory: the loader raises, naming what is missing
        load_model(model, weight_format=a.weight_format)
    args = engine_args(a, known.max_seq_len, jax.default_backend() == "cpu")
    args = with_measured_draft(args, a.model, known, jax.default_backend())
    if args.speculative_config:
        log.info("speculative decoding: %s", args.speculative_config)
    if args.compilation_cache_dir:
        os.makedirs(args.compilation_cache_dir, exist_ok=True)
    spec = _tokenizer_spec(a)
    if spec == "byte" and known.vocab_size < 256:
        log.warning("vocabulary %d < 256: no byte tokenizer, serving token ids only", known.vocab_size)
        spec = "none"
    tok = load_tokenizer(spec, known.vocab_size)
    log.info("loading %s (backend %s) and compiling the engine's programs", a.model, jax.default_backend())
    engine = Engine(model, args, tokenizer=tok, weight_format=a.weight_format, progress=True)
    log.info("engine ready: %d programs in %.1f s (compilation cache: %s; %d loaded from the program cache)",
             engine.runner.compile_count, engine.warmup_s, args.compilation_cache_dir or "off",
             engine.runner.program_cache_hits)
    default_name = DEFAULT_MODEL_NAME if os.path.abspath(a.model) == DEFAULT_MODEL else \
        os.path.basename(os.path.normpath(a.model))
    name = a.served_model_name or (a.model if is_preset else default_name)
    return engine, server_config(a, name, {a.model, engine.cfg.name})


def server_config(a: argparse.Namespace, name: str | None = None, aliases=()):
    """The ServerConfig of the parsed flags (validated before the model loads)."""
    from serving.api.security import keys_from

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
    same = {f.name for f in dataclasses.fields(ServerConfig)} & {dest for dest, _ in SERVER_FLAGS}
    kw = {k: getattr(a, k) for k in same} | {"served_model_name": name}  # the flag, resolved by build()
    return ServerConfig(**kw, aliases=set(aliases), api_keys=keys_from(a.api_key).keys)


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
