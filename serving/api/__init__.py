"""The serving APIs over the engine: gRPC `dsv41.v1`, OpenAI-compatible HTTP, Prometheus metrics.

| module | concept |
|---|---|
| `engine_client` | the engine loop thread and the asyncio client both front ends share |
| `protocol` | OpenAI / vLLM request schemas and server-side validation |
| `chat_template` | chat messages (+ tools) -> prompt (the DeepSeek-V4.1 encoding, or a Jinja template) |
| `dsml` | V4.1 tool calls: render, parse (streamed and whole), the grammar that forces them |
| `security` | API keys, per-key tenancy (cache salt, scoped ids) and limits, TLS |
| `openai_format` | response bodies: choices, logprobs formats, usage |
| `http_server` | aiohttp routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics |
| `grpc_server` | grpc.aio service dsv41.v1.Inference, health, reflection |
| `metrics` | server-level Prometheus metrics |
| `context` | what the front ends share (client, tokenizer, limits, model info) |
| `server` | assembly and lifecycle (start, graceful shutdown) |

Start a server with `python -m serving.run` (see docs/SERVING.md), or as a subprocess that is waited for with
`serving.spawn.spawn_server`; the tests' in-process servers are in tests/harness.py.
"""

from serving.api.server import ApiServer, ServerConfig, serve

__all__ = ["ApiServer", "ServerConfig", "serve"]
