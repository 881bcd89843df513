"""`python -m serving.run`: the flags derived from EngineArgs (their spellings, defaults and docs/SERVING.md's
table), and as a subprocess: --help, flag errors, an HF tokenizer.json with its chat template, --tokenizer none
(token ids only), and SIGTERM (stop accepting, finish in-flight requests, exit 0)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from serving import run
from serving.engine.config import EngineArgs
from serving.proto import inference_pb2 as pb
from serving.proto import inference_pb2_grpc as pb_grpc
from serving.spawn import spawn_server
from tests.harness import small_server_args

pytestmark = pytest.mark.timeout(400)
DOCS = Path(__file__).resolve().parents[1] / "docs"

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "serving.run", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_documents_the_vllm_style_flags():
    r = run_cli("--help", timeout=60)
    assert r.returncode == 0
    for flag in ("--model", "--checkpoint", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--long-prefill-token-threshold", "--prefill-schedule-interval", "--swa-bounded-replay",
                 "--no-swa-bounded-replay", "--enable-prefix-caching", "--kernels", "--execution",
                 "--tensor-parallel-size", "--data-parallel-size", "--enable-expert-parallel", "--host", "--port",
                 "--grpc-port", "--tokenizer", "--compilation-cache-dir", "--prefill-buckets", "--decode-buckets",
                 "--served-model-name", "--max-queued-requests", "--shutdown-timeout"):
        assert flag in r.stdout, flag


# ---------------------------------------------------------------------------------------------- flags
# EngineArgs fields not exposed as flags
NOT_FLAGS = {"eos_token_ids", "force_mesh", "parallel", "engram", "speculative", "xla_ops"}


def test_every_engine_arg_is_a_flag_or_named_internal():
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    flags = {name for name, *_ in run.engine_flags()}
    assert flags == names - NOT_FLAGS
    dests = [dest for dest, *_ in run.all_flags()]
    assert len(dests) == len(set(dests))  # no server flag shadows an engine field


def test_serving_md_flag_table_is_the_generated_one():
    doc = (DOCS / "SERVING.md").read_text()
    m = re.search(r"<!-- flag-table:[^\n]*-->\n(.*?)<!-- end flag-table -->", doc, re.DOTALL)
    assert m, "docs/SERVING.md lost its flag-table markers"
    assert m.group(1) == run.flag_table(), "regenerate it: python -m serving.run --print-flag-table"


def test_print_flag_table_prints_the_table_and_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        run.build_parser().parse_args(["--print-flag-table"])
    assert e.value.code in (0, None) and capsys.readouterr().out == run.flag_table()


def test_flag_spellings_map_onto_engine_args():
    argv = ["--max-model-len", "300", "--max-num-seqs", "3", "--max-num-batched-tokens", "512",
            "--long-prefill-token-threshold", "32", "--prefill-schedule-interval", "2", "--no-swa-bounded-replay",
            "--swa-snapshot-slots", "5", "--no-enable-prefix-caching", "--num-pages", "99", "--session-ttl", "7.5",
            "--max-queued-requests", "6", "--no-enable-prompt-logprobs", "--execution", "eager", "--kernels", "xla",
            "--compilation-cache-dir", "~/some/cache", "--prefill-buckets", "256,64,64", "--decode-buckets", "2,1",
            "--seed", "7", "-tp", "2", "-dp", "4", "--enable-expert-parallel", "--all2all-backend", "padded",
            "--moe-capacity-factor", "1.5", "--dp-load-cap", "3", "--compile-threads", "3", "--no-program-cache"]
    got = run.engine_args(run.build_parser().parse_args(argv), max_seq_len=4096, on_cpu=True)
    want = EngineArgs(max_model_len=300, max_num_seqs=3, max_num_batched_tokens=512, long_prefill_token_threshold=32,
                      prefill_schedule_interval=2, swa_bounded_replay=False, snapshot_slots=5,
                      enable_prefix_caching=False, num_pages=99, session_ttl_s=7.5, max_queued_requests=6,
                      enable_prompt_logprobs=False, execution="eager", kernels="xla",
                      compilation_cache_dir=os.path.expanduser("~/some/cache"), prefill_buckets=(64, 256),
                      decode_buckets=(1, 2), seed=7, tensor_parallel_size=2, data_parallel_size=4,
                      enable_expert_parallel=True, all2all_backend="padded", moe_capacity_factor=1.5, dp_load_cap=3,
                      compile_threads=3, program_cache=False)
    assert got == want
    a = run.build_parser().parse_args(["--checkpoint", "small", "--api-key", "k1", "--api-key", "k2",
                                       "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v41"])
    cfg = run.server_config(a, "name")
    assert (a.model, cfg.api_keys, cfg.enable_auto_tool_choice, cfg.served_model_name) == \
        ("small", ["k1", "k2"], True, "name")


@pytest.mark.parametrize("on_cpu", [True, False])
def test_flag_defaults_are_the_servers(on_cpu, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    a = run.build_parser().parse_args([])
    got = run.engine_args(a, max_seq_len=100_000, on_cpu=on_cpu)
    seqs, mbt = (4, 1024) if on_cpu else (8, 256)
    assert got == EngineArgs(max_model_len=8192, max_num_seqs=seqs, max_num_batched_tokens=mbt,
                             prefill_buckets=(mbt,) if on_cpu else (), decode_buckets=(seqs,) if on_cpu else (),
                             compilation_cache_dir=os.path.expanduser("~/.cache/dsv41-jax/jax"), program_cache=True)
    assert run.engine_args(a, max_seq_len=512, on_cpu=on_cpu).max_model_len == 512
    assert run.engine_args(run.build_parser().parse_args(["--compilation-cache-dir", "none"]), 512,
                           on_cpu).compilation_cache_dir is None
    assert (a.model, a.tokenizer, a.host, a.port, a.grpc_port, a.log_level) == \
        (run.DEFAULT_MODEL, "auto", "127.0.0.1", 8000, 50051, "info")
    assert run.server_config(a) == run.ServerConfig(aliases=set())


@pytest.mark.parametrize("argv", [["--prefill-buckets", "0,8"], ["--decode-buckets", "x"], ["--kernels", "cuda"],
                                  ["--all2all-backend", "emulated"], ["--execution", "lazy"]])
def test_bad_flag_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run.build_parser().parse_args(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--tensor-parallel-size", "2"], "parallelism is not available"),
    (["--data-parallel-size", "2"], "parallelism is not available"),
    (["--max-num-batched-tokens", "4"], "max_num_batched_tokens"),
    (["--model", "no-such-model"], "neither a preset"),
])
def test_bad_flags_exit_2_with_the_engine_message(args, needle, capsys):
    """In process (`run.main`, what `python -m serving.run` exits with): the checks run before any weight or
    program is built. The process itself: test_bad_flags_exit_2_as_a_process."""
    assert run.main([*args, "--compilation-cache-dir", "none"]) == 2
    assert needle in capsys.readouterr().err


def test_bad_flags_exit_2_as_a_process():
    r = run_cli("--tensor-parallel-size", "2", "--compilation-cache-dir", "none")
    assert r.returncode == 2 and "parallelism is not available" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- HF tokenizer
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world", "the quick brown fox jumps over the lazy dog", "serving models over grpc and http"] * 20
    tok.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("hf_tokenizer")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def hf_server(hf_dir):
    srv = spawn_server([*small_server_args(), "--tokenizer", str(hf_dir / "tokenizer.json"),
                        "--served-model-name", "tiny-hf", "--shutdown-timeout", "60"])
    yield srv
    srv.kill()


def test_hf_tokenizer_chat_template_and_text(hf_server, hf_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    client = openai.OpenAI(base_url=hf_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny-hf"]
    r = client.chat.completions.create(model="tiny-hf", messages=[{"role": "user", "content": "hello world"}],
                                       max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    expected = tok.encode("<s>[user] hello world\n[assistant] ", add_special_tokens=False).ids
    assert expected[0] == tok.token_to_id("<s>")
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == 4
    assert isinstance(r.choices[0].message.content, str)
    c = client.completions.create(model="tiny-hf", prompt="the quick brown fox", max_tokens=3, logprobs=1,
                                  extra_body={"ignore_eos": True})
    # completions add the BOS token by default (vLLM's add_special_tokens=True)
    assert c.usage.prompt_tokens == 1 + len(tok.encode("the quick brown fox", add_special_tokens=False).ids)
    assert len(c.choices[0].logprobs.tokens) == 3
    with grpc.insecure_channel(hf_server.grpc_target) as ch:
        info = pb_grpc.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.tokenizer == "hf" and list(info.eos_token_ids) == [tok.token_to_id("</s>")]
    assert info.bos_token_id == tok.token_to_id("<s>")


def test_sigterm_drains_in_flight_requests_and_exits_0(hf_server):
    """Runs last in this module: it stops the server."""
    url = hf_server.http_url
    result, first = {}, threading.Event()

    def stream():
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        n, reason = 0, None
        for ch in client.completions.create(model="tiny-hf", prompt="hello", max_tokens=120, logprobs=0,
                                            stream=True, extra_body={"ignore_eos": True}):
            if ch.choices:
                n += len(ch.choices[0].logprobs.tokens)
                reason = ch.choices[0].finish_reason or reason
            first.set()
        result.update(n=n, reason=reason)

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    t0 = time.monotonic()
    hf_server.proc.send_signal(15)  # SIGTERM
    refused = False
    while time.monotonic() - t0 < 30 and not refused:  # new requests are refused (or 503) while draining
        try:
            status, _ = post(url + "/v1/completions", {"prompt": "late", "max_tokens": 1})
            refused = status == 503
        except (urllib.error.URLError, ConnectionError):
            refused = True
        time.sleep(0.05)
    assert refused
    t.join(90)
    assert result == {"n": 120, "reason": "length"}  # the in-flight request finished completely
    assert hf_server.proc.wait(60) == 0
    assert "server stopped" in hf_server.output()


# ---------------------------------------------------------------------------------------------- --tokenizer none
def test_tokenizer_none_serves_token_ids_only():
    srv = spawn_server([*small_server_args(), "--tokenizer", "none"])
    try:
        url = srv.http_url
        status, body = post(url + "/v1/completions", {"prompt": "text", "max_tokens": 1})
        assert status == 400 and "no tokenizer" in body["error"]["message"]
        status, body = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "tokenizer" in body["error"]["message"]
        status, body = post(url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 0,
                                                      "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == ""
        assert all(t.startswith("token_id:") for t in body["choices"][0]["logprobs"]["tokens"])
        with grpc.insecure_channel(srv.grpc_target) as ch:
            stub = pb_grpc.InferenceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            msgs = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                                                         sampling_params=pb.SamplingParams(max_tokens=2)), timeout=60))
            assert msgs[-1].complete.usage.completion_tokens >= 1
    finally:
        assert srv.terminate() == 0
