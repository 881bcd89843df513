"""Offline API for notebooks and scripts: `LLM(model, **engine_args).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from serving.engine.config import EngineArgs
from serving.engine.engine import Engine
from serving.engine.types import CompletionOutput, SamplingParams


@dataclass
class GenerateOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int


class LLM:
    def __init__(self, model="tiny", *, tokenizer=None, progress: bool = True, **engine_args):
        from serving.tokenizer import load_tokenizer

        self.engine = Engine(model, EngineArgs(**engine_args), tokenizer=None, progress=progress)
        if tokenizer is not None:
            self.engine.tokenizer = load_tokenizer(tokenizer, self.engine.cfg.vocab_size)
        self._n = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, session_id: str | None = None) -> list[GenerateOutput]:
        """Prompts are strings (tokenized) or lists of token ids; returns outputs in prompt order."""
        if isinstance(prompts, (str,)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(
            prompts)
        ids, results = [], {}
        for p, sp in zip(prompts, sps):
            toks = self.tokenizer.encode(p, add_bos=True) if isinstance(p, str) else list(p)  # as vLLM: specials
            rid = f"llm-{self._n}"
            self._n += 1
            results[rid] = {"prompt": toks, "ids": [], "lps": [], "text": "", "reason": None, "cached": 0}
            self.engine.add_request(rid, toks, sp, session_id=session_id)
            ids.append(rid)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for o in self.engine.step():
                r = results[o.request_id]
                r["ids"] += o.new_token_ids
                r["text"] += o.new_text
                r["lps"] += o.new_logprobs or []
                r["cached"] = o.num_cached_tokens
                if o.finished:
                    r["reason"] = o.finish_reason
                    bar.update(1)
        bar.close()
        out = []
        for rid, sp in zip(ids, sps):
            r = results[rid]
            lps = r["lps"] if sp.logprobs is not None else None
            out.append(GenerateOutput(rid, r["prompt"], [CompletionOutput(r["ids"], r["text"], lps, r["reason"])],
                                      r["cached"]))
        return out
