"""The serving engine: paged global KV, prefix cache, SWA bounded replay, CED decoder trimming,
fixed-shape compiled programs, a vLLM-style scheduler and on-device sampling."""

from serving.engine.config import EngineArgs
from serving.engine.engine import Engine
from serving.engine.llm import LLM
from serving.engine.types import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["Engine", "EngineArgs", "LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
