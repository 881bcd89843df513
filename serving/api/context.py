"""What the HTTP and gRPC front ends share: the engine client, tokenizer, chat template, metrics, limits,
API keys and per-key limits, the grammar compiler for structured outputs."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from serving.api.chat_template import ChatTemplate
from serving.api.engine_client import EngineClient
from serving.api.metrics import ApiMetrics
from serving.api.protocol import ApiError, bad
from serving.api.security import ANONYMOUS, ApiKeys, KeyLimiter, Tenant
from serving.engine.block_hash import BLOCK
from serving.engine.structured import GrammarCompiler, GrammarError, StructuredOutputs

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
    auto_tools: bool = False  # --enable-auto-tool-choice with --tool-call-parser
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys([]))
    protect_metrics: bool = False  # /metrics needs a key too
    limiter: KeyLimiter = field(default_factory=KeyLimiter)
    spec_metrics: str = "none"  # --per-request-spec-decode-metrics: none | summary | detailed
    _grammars: GrammarCompiler | None = None

    # ------------------------------------------------------------------ access control
    def needs_key(self, path: str) -> bool:
        return bool(self.api_keys) and (path.startswith(("/v1", "/engine/")) or
                                        (self.protect_metrics and path == "/metrics"))

    def authenticate(self, path: str, authorization: str | None) -> Tenant:
        """The caller's tenant for an HTTP path (401 when the path needs a key and none matches)."""
        if not self.needs_key(path):
            return ANONYMOUS
        key = self.api_keys.match(authorization)
        if key is None:
            raise ApiError(401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)",
                           headers={"WWW-Authenticate": "Bearer"})
        return Tenant.of(key)

    # ------------------------------------------------------------------ structured outputs
    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.engine.model_info()["eos_token_ids"])
        return self._grammars

    async def compile_grammar(self, spec: StructuredOutputs):
        """Compile off the event loop (llguidance releases the GIL); 400 on a bad constraint."""
        if not self.has_tokenizer:
            raise bad("structured outputs need a tokenizer (this server runs with --tokenizer none)")
        try:
            await asyncio.to_thread(self.grammars.compile, spec)
        except GrammarError as e:
            raise bad(str(e)) from None

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
