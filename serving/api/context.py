"""What the HTTP and gRPC front ends share: the engine client, tokenizer, chat template, metrics, limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serving.api.chat_template import ChatTemplate
from serving.api.engine_client import EngineClient
from serving.api.metrics import ApiMetrics
from serving.api.protocol import ApiError, bad
from serving.engine.block_hash import BLOCK

MAX_ID_LEN = 512


def engine_stats(engine) -> dict:
    """Runs on the engine thread (EngineClient.call): the engine's public statistics."""
    return engine.stats()


@dataclass
class ServerContext:
    client: EngineClient
    chat: ChatTemplate
    metrics: ApiMetrics
    model_name: str  # the served model name (what /v1/models lists)
    aliases: set[str] = field(default_factory=set)  # other names accepted in the `model` field
    max_request_bytes: int = 1 << 20
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.client.engine

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return getattr(self.tokenizer, "name", "none") != "none"

    @property
    def max_model_len(self) -> int:
        return self.engine.args.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.cfg.vocab_size

    def check_model(self, name: str | None):
        if name and name != self.model_name and name not in self.aliases:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                           "model")

    @staticmethod
    def check_id(value: str | None, what: str) -> str | None:
        if value is None:
            return None
        if not value or len(value) > MAX_ID_LEN:
            raise bad(f"{what} must be a non-empty string of at most {MAX_ID_LEN} characters", what)
        return value

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_bos=add_bos)
        except ValueError as e:
            raise bad(str(e), "prompt") from None

    def prometheus(self) -> str:
        loop = self.client.loop
        return self.engine.metrics.prometheus() + self.metrics.prometheus(loop.step_failures, self.client.healthy)

    def model_info(self) -> dict:
        eng = self.engine
        info = dict(eng.model_info())
        tok = self.tokenizer
        info.update(served_model_name=self.model_name, tokenizer=getattr(tok, "name", "none"),
                    bos_token_id=getattr(tok, "bos_token_id", None), page_size=BLOCK,
                    enable_prefix_caching=eng.args.enable_prefix_caching, max_num_seqs=eng.args.max_num_seqs,
                    max_num_batched_tokens=eng.args.max_num_batched_tokens, chat_template=self.chat.origin)
        return info
