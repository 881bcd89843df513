"""Engine metrics with Prometheus text rendering (vLLM-compatible names where the concept matches).

`vllm:request_success_total` carries vLLM's `finished_reason` label (stop | length | abort): every finished
request is counted once under its reason. The snapshot's `requests_finished` counter keeps counting the
non-aborted ones (aborts are also in `dsv41:request_aborted_total`).

Speculative decoding (rendered only when it is on, as vLLM registers them): `vllm:spec_decode_num_drafts_total`
(verifications that carried at least one draft token), `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`
and `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}` (verifications whose draft i, counted from
0, was accepted). Mean acceptance length = 1 + accepted / drafts; per-position rate = per_pos[i] / drafts.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
FINE_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)  # sub-ms


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float):
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1


class Metrics:
    COUNTERS = {
        "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
        "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
        "prefix_cache_skipped": ("dsv41:prefix_cache_skipped_tokens",
                                 "Prompt tokens whose computation a prefix-cache hit skipped (hits minus replay)"),
        "prompt_tokens": ("vllm:prompt_tokens", "Prompt tokens received"),
        "generation_tokens": ("vllm:generation_tokens", "Tokens generated"),
        "replayed_tokens": ("dsv41:replayed_tokens", "Cached tokens recomputed by SWA bounded replay"),
        "snapshot_restores": ("dsv41:swa_snapshot_restores", "Exact mode: prefix hits resumed from an SWA snapshot"),
        "snapshot_misses": ("dsv41:swa_snapshot_misses", "Exact mode: prefix hits with no snapshot (recomputed)"),
        "snapshot_recomputed_tokens": ("dsv41:swa_snapshot_recomputed_tokens",
                                       "Exact mode: hit tokens recomputed because no snapshot was at the hit's end"),
        "preemptions": ("vllm:num_preemptions", "Requests preempted (recompute)"),
        "offload_saved_pages": ("dsv41:kv_offload_saved_pages", "Evicted prefix-cache pages copied to host memory"),
        "offload_restored_pages": ("dsv41:kv_offload_restored_pages",
                                   "Prefix-cache pages copied back from host memory on a hit"),
        "offload_dropped_pages": ("dsv41:kv_offload_dropped_pages",
                                  "Host-memory pages dropped by the --kv-offloading-size LRU bound"),
        "requests_aborted": ("dsv41:request_aborted", "Requests aborted"),
        "engram_rows": ("dsv41:engram_rows_gathered", "Host Engram tables: table rows gathered on the host"),
        "engram_prefetch_misses": ("dsv41:engram_prefetch_misses",
                                   "Host Engram tables: program rows not prefetched (gathered at dispatch)"),
    }
    HISTOGRAMS = {
        "ttft": ("vllm:time_to_first_token_seconds", "Time to first token"),
        "itl": ("vllm:inter_token_latency_seconds", "Inter-token latency"),
        "e2e": ("vllm:e2e_request_latency_seconds", "End-to-end request latency"),
        "engram_lookup": ("dsv41:engram_lookup_seconds", "Host Engram tables: host time to hash, gather and copy "
                          "one program call's rows to the device", FINE_BUCKETS),
        "engram_wait": ("dsv41:engram_wait_seconds", "Host Engram tables: time a step waited for its rows before "
                        "dispatch", FINE_BUCKETS),
    }
    GAUGES = {
        "running": ("vllm:num_requests_running", "Requests running"),
        "waiting": ("vllm:num_requests_waiting", "Requests waiting"),
        "kv_usage": ("vllm:kv_cache_usage_perc",
                     "Fraction of global-KV pages held by requests (free cached pages count as free, as in vLLM)"),
        "offload_pages": ("dsv41:kv_offload_pages", "Prefix-cache pages held in host memory"),
        "compiled_programs": ("dsv41:compiled_programs", "Compiled step programs"),
        "snapshot_bytes": ("dsv41:swa_snapshot_bytes", "Device bytes held for exact-mode SWA snapshots"),
    }

    FINISHED_REASONS = ("stop", "length", "abort")

    SPEC_COUNTERS = {
        "spec_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
        "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
        "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    }
    SPEC_PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.")

    def __init__(self, model_name: str = "dsv41", spec_tokens: int = 0):
        self.model_name = model_name
        self.spec_tokens = spec_tokens  # num_speculative_tokens (0: speculative decoding off)
        self.spec_per_pos = [0] * spec_tokens
        self.lock = threading.Lock()
        self.counters = {k: 0 for k in self.COUNTERS}
        self.counters.update({k: 0 for k in self.SPEC_COUNTERS} if spec_tokens else {})
        self.counters["requests_finished"] = 0  # non-aborted (rendered per reason as vllm:request_success_total)
        self.finished_by_reason = {r: 0 for r in self.FINISHED_REASONS}
        self.hist = {k: Histogram(*v[2:]) for k, v in self.HISTOGRAMS.items()}
        self.gauges = {k: 0.0 for k in self.GAUGES}

    def inc(self, key: str, v: float = 1):
        with self.lock:
            self.counters[key] += v

    def spec_observe(self, n_draft: int, n_accepted: int):
        """One verification of `n_draft` (>= 1) draft tokens that accepted the first `n_accepted`."""
        with self.lock:
            self.counters["spec_drafts"] += 1
            self.counters["spec_draft_tokens"] += n_draft
            self.counters["spec_accepted_tokens"] += n_accepted
            for i in range(n_accepted):
                self.spec_per_pos[i] += 1

    def finished(self, reason: str):
        """A request finished (stop | length | abort): vllm:request_success_total{finished_reason}."""
        with self.lock:
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def observe(self, key: str, v: float):
        with self.lock:
            self.hist[key].observe(v)

    def set(self, key: str, v: float):
        with self.lock:
            self.gauges[key] = v

    def snapshot(self) -> dict:
        with self.lock:
            return {"counters": dict(self.counters), "gauges": dict(self.gauges),
                    "spec_per_pos": list(self.spec_per_pos), "finished_by_reason": dict(self.finished_by_reason),
                    "histograms": {k: {"count": h.n, "sum": h.sum} for k, h in self.hist.items()}}

    def prometheus(self) -> str:
        lab = f'model_name="{self.model_name}"'
        out = []
        with self.lock:
            for k, (name, doc) in {**self.COUNTERS, **(self.SPEC_COUNTERS if self.spec_tokens else {})}.items():
                out += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
                        f"{name}_total{{{lab}}} {float(self.counters[k])}"]
            if self.spec_tokens:
                name, doc = self.SPEC_PER_POS
                out += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
                out += [f'{name}_total{{{lab},position="{i}"}} {float(v)}' for i, v in enumerate(self.spec_per_pos)]
            name = "vllm:request_success"
            out += [f"# HELP {name}_total Finished requests by finish reason", f"# TYPE {name}_total counter"]
            out += [f'{name}_total{{{lab},finished_reason="{r}"}} {float(v)}'
                    for r, v in self.finished_by_reason.items()]
            for k, (name, doc) in self.GAUGES.items():
                out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {float(self.gauges[k])}"]
            for k, (name, doc, *_) in self.HISTOGRAMS.items():
                h = self.hist[k]
                out += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
                cum = 0
                for b, c in zip(h.buckets, h.counts):
                    cum += c
                    out.append(f'{name}_bucket{{{lab},le="{b}"}} {cum}')
                out.append(f'{name}_bucket{{{lab},le="+Inf"}} {h.n}')
                out += [f"{name}_sum{{{lab}}} {h.sum}", f"{name}_count{{{lab}}} {h.n}"]
        return "\n".join(out) + "\n"
