"""Server-side pieces without a server: request parsing, chat templates, response formatting, metrics."""

import math

import pytest

from serving.api import openai_format as fmt
from serving.api.chat_template import ChatTemplate, TemplateError
from serving.api.metrics import ApiMetrics, token_buckets
from serving.api.protocol import ApiError, CompletionRequest, completion_prompts, parse, resolve_max_tokens
from serving.tokenizer import ByteTokenizer, NoTokenizer


def test_completion_prompt_shapes():
    assert completion_prompts("a") == ["a"]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([1, 2]) == [[1, 2]]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (None, [], "", [[]], [1, "a"], [[1, "a"]], {"a": 1}, [True]):
        with pytest.raises(ApiError):
            completion_prompts(bad)


def test_max_tokens_resolution():
    assert resolve_max_tokens(None, 10, 256) == 246
    assert resolve_max_tokens(0, 10, 256) == 0
    for v, n in ((-1, 10), (247, 10), (None, 256), (1, 256)):
        with pytest.raises(ApiError):
            resolve_max_tokens(v, n, 256)


def test_parse_reports_field_and_value():
    with pytest.raises(ApiError) as e:
        parse(CompletionRequest, {"prompt": "x", "temperature": "hot"})
    assert "temperature" in e.value.message and "'hot'" in e.value.message and e.value.status == 400


def test_builtin_chat_template_is_dsv41_and_append_only():
    chat = ChatTemplate(ByteTokenizer(512))
    assert chat.origin == "dsv41"
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"}]
    text1, ids1 = chat.encode(turn1)
    assert text1 == "<｜System｜>sys<｜User｜>héllo<｜Assistant｜></think>" and ids1[0] == 256
    assert ids1[1:] == list(text1.encode())
    turn2 = turn1 + [{"role": "assistant", "content": "reply"}, {"role": "user", "content": "more"}]
    text2, ids2 = chat.encode(turn2)
    assert ids2[:len(ids1)] == ids1
    assert text2.endswith("</think>reply<｜end▁of▁sentence｜><｜User｜>more<｜Assistant｜></think>")
    text, _ = chat.encode(turn2[:3], add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("</think>reply")
    think, _ = chat.encode(turn1, kwargs={"thinking": True, "reasoning_effort": "max"})
    assert think.startswith("<｜System｜>Reasoning Effort: 100 (range 1-100")
    assert think.endswith("<｜Assistant｜><think>")


def test_custom_template_helpers_and_errors():
    tok = ByteTokenizer(512)
    tok.chat_template = ("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                         "{{ messages | tojson }}")
    chat = ChatTemplate(tok)
    assert chat.origin == "tokenizer"
    text, ids = chat.encode([{"role": "user", "content": "é"}])
    assert '"é"' in text and ids[0] != 256  # a tokenizer template brings its own BOS (none here)
    with pytest.raises(TemplateError, match="first must be user"):
        chat.encode([{"role": "system", "content": "x"}])
    with pytest.raises(TemplateError, match="tokenizer"):
        ChatTemplate(NoTokenizer(512)).encode([{"role": "user", "content": "x"}])


def test_logprob_formats():
    spell = fmt.TokenText(ByteTokenizer(512), as_ids=False)
    lp = fmt.legacy_logprobs(spell, [65, 66], [None, {66: -1.0, 67: -0.5, 68: -math.inf}])
    assert lp["tokens"] == ["A", "B"] and lp["token_logprobs"] == [None, -1.0] and lp["text_offset"] == [0, 1]
    assert list(lp["top_logprobs"][1]) == ["C", "B", "D"] and lp["top_logprobs"][1]["D"] == fmt.FLOOR
    ids = fmt.TokenText(ByteTokenizer(512), as_ids=True)
    chat = fmt.chat_logprobs(ids, [66], [{66: -1.0, 67: -0.5}], 1)
    assert chat["content"][0]["token"] == "token_id:66" and chat["content"][0]["top_logprobs"][0]["logprob"] == -0.5
    assert chat["content"][0]["bytes"] == [66]
    plp = fmt.vllm_prompt_logprobs(spell, [65, 66, 67], [None, {66: -2.0, 70: -0.1}, {67: -0.3}], 1)
    assert plp[0] is None
    assert plp[1]["66"]["rank"] is None and plp[1]["70"]["rank"] == 1  # actual token outside the top-1
    assert plp[2]["67"]["rank"] == 1


def test_metrics_rendering():
    assert token_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    m = ApiMetrics('we"ird', 256)
    m.finished(100, 64, 5)
    m.request_done("http", "/v1/completions", 200)
    text = m.prometheus()
    assert 'vllm:prompt_tokens_by_source_total{model_name="we\\"ird",source="local_cache_hit"} 64.0' in text
    assert 'vllm:prompt_tokens_by_source_total{model_name="we\\"ird",source="local_compute"} 36.0' in text
    assert "dsv41:engine_healthy" in text
