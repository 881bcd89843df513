"""InferenceX / AgentX metrics from replay records (the formulas below; bench/agentx/README.md, "Metrics").

Population: profiling-phase records without an error (warm-up rows and failed requests are dropped).
Percentiles interpolate linearly between order statistics: k = (n - 1) p / 100.

- TTFT_i = first token time - request start; mean / p50 / p75 / p90 / p95 / std (population std).
- ITL_i = (E2EL_i - TTFT_i) / (OSL_i - 1) for OSL_i > 1 (AIPerf's per-request ITL; TPOT := ITL).
  Interactivity (tokens/s/user): intvty_pXX = 1 / pXX(ITL) (the slow-tail ITL, inverted).
- E2E-normalised interactivity (the North-Star x-axis): r_i = E2EL_i / OSL_i; e2e_norm_intvty_pXX =
  1 / pXX(r).
- Throughput: duration = max(end) - min(start) over kept records; input / output / total = sum(ISL) /
  sum(OSL) / sum(ISL + OSL) over duration, ISL = the server's prompt tokens (cached tokens included);
  per GPU = divided by num_gpus; TPGS = total per GPU.
- QPS: completions per 1-s window over [min start, max end): mean and percentiles.
- Cache hit: server = local_cache_hit / sum(vllm:prompt_tokens_by_source) deltas of /metrics when present,
  else vllm:prefix_cache_hits / vllm:prefix_cache_queries deltas; theoretical = sum(hit blocks) /
  sum(blocks) of the kept records (a perfect infinite cache per session tree; also in tokens, hit blocks x
  block size over the recorded ISL, the unit of the server's ratio); usage = sum(cached_tokens) / sum(ISL)
  from the responses.
- Errors: failed / all profiling requests; overflows (context-length errors) / all profiling requests; a run
  with more than 1% overflows is not a valid AgentX submission.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

PCTS = (50, 75, 90, 95, 99)
SLO = 50.0  # tok/s/user: the interactivity target the AgentX articles quote


def percentile(values, p: float) -> float | None:
    """Linear interpolation between order statistics, k = (n - 1) p / 100 (InferenceX's percentile)."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(values) -> dict:
    xs = list(values)
    if not xs:
        return {"n": 0}
    mean = sum(xs) / len(xs)
    out = {"n": len(xs), "mean": mean, "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))}
    out.update({f"p{p}": percentile(xs, p) for p in PCTS})
    return out


def _inv(x):
    return None if not x else 1.0 / x


# ---------------------------------------------------------------------------------------------- Prometheus
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, sorted label pairs): value} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict, name: str, **labels) -> float | None:
    """Sum of a metric over the label sets matching `labels` (None when the metric is absent)."""
    vals = [v for (n, lab), v in metrics.items() if n == name and all((k, w) in lab for k, w in labels.items())]
    return sum(vals) if vals else None


def counter_deltas(before: dict, after: dict) -> dict[str, float]:
    """after - before of every counter (`*_total`, label sets summed; `source` kept for prompt tokens)."""
    out: dict[str, float] = defaultdict(float)
    for (name, lab), v in after.items():
        if not name.endswith("_total"):
            continue
        src = dict(lab).get("source")
        key = f"{name}{{source={src}}}" if src else name
        out[key] += v - before.get((name, lab), 0.0)
    return dict(out)


def server_hit_rate(before: dict, after: dict) -> tuple[float | None, str | None]:
    """The vLLM backend's formula: by-source counters when present, else prefix-cache hits / queries."""
    def delta(name, **labels):
        a, b = metric_sum(after, name, **labels), metric_sum(before, name, **labels)
        return None if a is None else a - (b or 0.0)

    hit = delta("vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    tot = delta("vllm:prompt_tokens_by_source_total")
    if hit is not None and tot:
        return hit / tot, "prompt_tokens_by_source"
    hit, q = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    if hit is not None and q:
        return hit / q, "prefix_cache_hits/queries"
    return None, None


# ---------------------------------------------------------------------------------------------- summary
def _get(r, k):
    return r[k] if isinstance(r, dict) else getattr(r, k)


def summarize(records, num_gpus: int = 1, metrics_before: dict | None = None,
              metrics_after: dict | None = None) -> dict:
    """The InferenceX numbers of one run (records: `replay.Record`s or their dicts)."""
    prof = [r for r in records if _get(r, "phase") == "profiling"]
    ok = [r for r in prof if _get(r, "error") is None]
    n_err = len(prof) - len(ok)
    n_ovf = sum(1 for r in prof if _get(r, "overflow"))
    out = {"requests": len(prof), "completed": len(ok), "errors": n_err, "overflows": n_ovf,
           "error_rate": n_err / len(prof) if prof else None, "overflow_rate": n_ovf / len(prof) if prof else None}
    ok = [r for r in ok if _get(r, "ttft") is not None and (_get(r, "osl") or 0) >= 1]
    if not ok:
        out["valid"] = False
        return out
    isl = [(_get(r, "isl") if _get(r, "isl") is not None else _get(r, "isl_expected")) for r in ok]
    osl = [_get(r, "osl") for r in ok]
    start = min(_get(r, "start") for r in ok)
    end = max(_get(r, "end") for r in ok)
    duration = end - start
    e2el = [_get(r, "end") - _get(r, "start") for r in ok]
    ttft = [_get(r, "ttft") for r in ok]
    itl = [(e - t) / (o - 1) for e, t, o in zip(e2el, ttft, osl) if o > 1]
    norm = [e / o for e, o in zip(e2el, osl)]
    tput = {"input_tps": sum(isl) / duration, "output_tps": sum(osl) / duration,
            "total_tps": (sum(isl) + sum(osl)) / duration} if duration > 0 else {}
    out["duration_s"] = duration
    out["throughput"] = tput
    out["per_gpu"] = {k: v / num_gpus for k, v in tput.items()}
    out["num_gpus"] = num_gpus
    out["tpgs"] = out["per_gpu"].get("total_tps")
    out["ttft_s"] = _dist(ttft)
    out["itl_s"] = _dist(itl)
    out["e2el_s"] = _dist(e2el)
    out["e2e_per_token_s"] = _dist(norm)
    out["interactivity"] = {f"p{p}": _inv(percentile(itl, p)) for p in PCTS}
    out["e2e_norm_interactivity"] = {f"p{p}": _inv(percentile(norm, p)) for p in PCTS}
    out["qps"] = _qps([_get(r, "end") for r in ok], start, end)
    out["isl"] = {"actual": _dist(isl), "expected": _dist([_get(r, "isl_expected") for r in ok])}
    out["osl"] = {"actual": _dist(osl), "expected": _dist([_get(r, "osl_expected") for r in ok])}
    blocks = sum(_get(r, "n_blocks") for r in ok)
    cached = [_get(r, "cached") for r in ok if _get(r, "cached") is not None]
    exp = sum(_get(r, "isl_expected") for r in ok)
    out["cache"] = {"theoretical_hit": sum(_get(r, "hit_blocks") for r in ok) / blocks if blocks else None,
                    "theoretical_hit_tokens": sum(_get(r, "hit_tokens") for r in ok) / exp if exp else None,
                    "usage_cached_fraction": sum(cached) / sum(isl) if cached and sum(isl) else None}
    if metrics_before is not None and metrics_after is not None:
        rate, source = server_hit_rate(metrics_before, metrics_after)
        out["cache"].update(server_hit=rate, server_hit_source=source)
        out["server_counters"] = counter_deltas(metrics_before, metrics_after)
    out["valid"] = bool(out["overflow_rate"] <= 0.01)
    return out


def _qps(ends: list[float], start: float, end: float) -> dict:
    n = max(1, math.ceil(end - start))
    counts = [0] * n
    for e in ends:
        counts[min(int(e - start), n - 1)] += 1
    return _dist(counts)


def headline(s: dict) -> dict:
    """The few numbers of the printed table and the Pareto plot."""
    g = lambda *ks: _dig(s, ks)  # noqa: E731
    return {"requests": s.get("completed"), "tpgs": s.get("tpgs"), "ttft_p50": g("ttft_s", "p50"),
            "ttft_p90": g("ttft_s", "p90"), "intvty_p90": g("interactivity", "p90"),
            "e2e_norm_intvty_p90": g("e2e_norm_interactivity", "p90"), "server_hit": g("cache", "server_hit"),
            "theoretical_hit": g("cache", "theoretical_hit"),
            "theoretical_hit_tokens": g("cache", "theoretical_hit_tokens"), "error_rate": s.get("error_rate"),
            "overflow_rate": s.get("overflow_rate")}


def _dig(d, keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def slo_targets(rows: list[dict], slo: float = SLO) -> dict:
    """Per side, the best TPGS among points whose p90 interactivity (and, separately, E2E-normalised p90
    interactivity) is at least `slo` tok/s/user; and optimised / day0 (the issue's target: >= 5x)."""
    out: dict = {}
    for key in ("intvty_p90", "e2e_norm_intvty_p90"):
        best = {}
        for r in rows:
            if (r.get(key) or 0) >= slo and r.get("tpgs"):
                best[r["side"]] = max(best.get(r["side"], 0.0), r["tpgs"])
        opt, d0 = best.get("optimised"), best.get("day0")
        out[key] = {"slo": slo, "best_tpgs": best,
                    "optimised_over_day0": (opt / d0) if opt and d0 else None,
                    "note": None if d0 else "day0 has no point at this interactivity"}
    return out
