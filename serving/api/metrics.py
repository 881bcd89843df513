"""Server-level Prometheus metrics, rendered after the engine's own (`engine.metrics.prometheus()`).

The engine already exports vLLM's names for prefix-cache hits/queries, token counters, queue gauges and
the latency histograms (TTFT, inter-token, end-to-end). The server adds what only it sees:

- `vllm:prompt_tokens_by_source_total{source}` (counter): prompt tokens of finished requests by source,
  `local_cache_hit` or `local_compute` (AgentX's hit-rate formula prefers this one);
- `vllm:request_prompt_tokens`, `vllm:request_generation_tokens` (histograms): per finished request;
- `dsv41:api_requests_total{api,endpoint,code}` (counter): calls by protocol, endpoint and status (HTTP code
  or gRPC status name); `dsv41:api_requests_in_flight{api}` (gauge): open calls;
- `dsv41:engine_step_failures_total` (counter): engine steps that raised (their running requests failed);
- `dsv41:engine_healthy` (gauge): 1 while the engine loop is alive and healthy.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from serving.engine.metrics import Histogram


def token_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    out, e = [], 1
    while True:
        for m in (1, 2, 5):
            if m * e > max_len:
                return tuple(out)
            out.append(m * e)
        e *= 10


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ApiMetrics:
    def __init__(self, model_name: str, max_model_len: int):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.by_source = {"local_cache_hit": 0, "local_compute": 0}
        self.prompt_hist = Histogram(token_buckets(max_model_len))
        self.gen_hist = Histogram(token_buckets(max_model_len))
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.in_flight: dict[str, int] = defaultdict(int)

    def request_done(self, api: str, endpoint: str, code):
        with self.lock:
            self.requests[(api, endpoint, str(code))] += 1

    def enter(self, api: str):
        with self.lock:
            self.in_flight[api] += 1

    def leave(self, api: str):
        with self.lock:
            self.in_flight[api] -= 1

    def finished(self, num_prompt: int, num_cached: int, num_output: int):
        with self.lock:
            self.by_source["local_cache_hit"] += num_cached
            self.by_source["local_compute"] += max(num_prompt - num_cached, 0)
            self.prompt_hist.observe(num_prompt)
            self.gen_hist.observe(num_output)

    def prometheus(self, step_failures: int = 0, healthy: bool = True) -> str:
        m = f'model_name="{_esc(self.model_name)}"'
        out = []
        with self.lock:
            name = "vllm:prompt_tokens_by_source_total"
            out += [f"# HELP {name} Prompt tokens of finished requests by source",
                    f"# TYPE {name} counter"]
            out += [f'{name}{{{m},source="{s}"}} {float(v)}' for s, v in self.by_source.items()]
            for name, h, doc in (("vllm:request_prompt_tokens", self.prompt_hist, "Prompt tokens per request"),
                                 ("vllm:request_generation_tokens", self.gen_hist, "Generated tokens per request")):
                out += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
                cum = 0
                for b, c in zip(h.buckets, h.counts):
                    cum += c
                    out.append(f'{name}_bucket{{{m},le="{float(b)}"}} {cum}')
                out.append(f'{name}_bucket{{{m},le="+Inf"}} {h.n}')
                out += [f"{name}_sum{{{m}}} {float(h.sum)}", f"{name}_count{{{m}}} {h.n}"]
            name = "dsv41:api_requests_total"
            out += [f"# HELP {name} API calls by protocol, endpoint and status", f"# TYPE {name} counter"]
            for (api, ep, code), v in sorted(self.requests.items()):
                out.append(f'{name}{{{m},api="{_esc(api)}",endpoint="{_esc(ep)}",code="{_esc(code)}"}} {float(v)}')
            name = "dsv41:api_requests_in_flight"
            out += [f"# HELP {name} Open API calls", f"# TYPE {name} gauge"]
            for api in ("http", "grpc"):
                out.append(f'{name}{{{m},api="{api}"}} {float(self.in_flight.get(api, 0))}')
        out += ["# HELP dsv41:engine_step_failures_total Engine steps that raised",
                "# TYPE dsv41:engine_step_failures_total counter",
                f"dsv41:engine_step_failures_total{{{m}}} {float(step_failures)}",
                "# HELP dsv41:engine_healthy 1 while the engine loop is alive and healthy",
                "# TYPE dsv41:engine_healthy gauge", f"dsv41:engine_healthy{{{m}}} {1.0 if healthy else 0.0}"]
        return "\n".join(out) + "\n"
