"""Engram tables in host memory vs on the device (issue 26), and the host lookup at the full model's table size.

    python -m bench.engram_host --skip part2 --budget 330 --out /root/out/engram_host_medium_h200.json  # H200
    python -m bench.engram_host --smoke --out /tmp/engram_host_smoke.json                # CPU, tiny

Part 1 (one process, one set of weights): two engines over the same parameters, one with the Engram tables as
device parameters, one with `--engram-config '{"cpu_offload": true}'` (the tables copied to host memory, rows
gathered by the feeder and copied in before each call). The cases:
- decode ITL at batch 1, 8, 32 (requests injected at `--context` tokens with random well-formed KV bytes, as
  bench.decode_itl; the wall time of each Engine.step() after `--warmup` steps, `--steps` per round);
- prefill: TTFT of fresh `--chunk`-token prompts (one chunk each, `--prefill-reps` per round; the Engram rows
  gathered from when the request is added: the least overlap) and TTFT / 4 of `4 x --chunk`-token prompts (four
  chunks, `--prefill-reps-long` per round: the next chunk's rows gathered while this one runs), prefix caching off;
- the feeder's own figures: lookup and wait histograms (mean ms per call), prefetch misses.
A discarded warm-up pass runs every case once on both engines; then `--rounds` rounds run every case on both,
one engine after the other (which goes first alternates by round), so drift of the machine hits both sides.
Per case: the median over all samples of all rounds, its p90, each round's median and each round's overhead.
overhead = host / device - 1 (the issue's targets: decode <= 3%, prefill <= 5%).

Part 2 (a subprocess, so that running out of host memory cannot lose part 1): host tables of the full model's
row count, as many as this host's available memory allows (the full model needs 2 x 94.4 GiB; with 128 GiB one
table of the full 384,006,168 rows fits, and the second layer's ids are looked up in the same table, modulo its
rows, so every lookup spans the full table). Filled with a byte pattern (anonymous memory, MADV_HUGEPAGE), then
the feeder's hash + gather for decode batches 1/8/32 and a `--chunk`-token prefill chunk, with 1, 2, 4 and 8
gather threads: ms per call and achieved gather bandwidth (gathered bytes / time), the huge-page bytes the kernel
gave, and the host-to-device copy bandwidth of the gathered rows.

Every case that fails prints an error row and the run goes on; the JSON is rewritten after each case. A short
table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

GIB = 2 ** 30


# ----------------------------------------------------------------------------- part 1: engines
def _engines(a, cfg):
    import checkpoints
    from dsv41_jax.kv_format import pages_for
    from serving.engine import Engine, EngineArgs
    from serving.engine.config import shared_cache_dir

    mml = pages_for(max(a.context + a.steps + a.warmup + 64, 4 * a.chunk + 64)) * 64
    B = max(a.batches)
    args = dict(max_model_len=mml, max_num_seqs=B, max_num_batched_tokens=a.chunk, prefill_buckets=(a.chunk,),
                decode_buckets=tuple(a.batches), enable_prompt_logprobs=False, enable_prefix_caching=False,
                num_pages=1 + B * pages_for(a.context + a.steps + a.warmup + 64) + 2 * pages_for(mml),
                compilation_cache_dir=shared_cache_dir())
    t0 = time.perf_counter()
    params = checkpoints.random_init(cfg, 0)
    init_s = time.perf_counter() - t0
    keep = lambda k: k.kind == "decode" or k.decoder in ("none", "window")  # noqa: E731
    out = {}
    for side, extra in (("device", {"engram_config": {"cpu_offload": False}}),
                        ("host", {"engram_config": {"cpu_offload": True, "gather_threads": a.threads,
                                                    **json.loads(a.host_config or "{}")}})):
        t0 = time.perf_counter()
        out[side] = Engine(cfg, EngineArgs(**args, **extra), params=params, progress=not a.smoke, programs=keep)
        out[side + "_build_s"] = round(time.perf_counter() - t0, 1)
        print(f"[{side}] engine built in {out[side + '_build_s']} s", file=sys.stderr, flush=True)
    out["init_s"] = round(init_s, 1)
    f = out["host"].engram
    out["host_staging"] = {"registered": f.staging.mapped, "alias": f.alias, "rows_in_call": f.in_call}
    return out


def _ttft(eng, prompt_len: int, reps: int, rng) -> list[float]:
    from serving.engine import SamplingParams

    ts = []
    for i in range(reps):
        rid = f"pf-{prompt_len}-{i}-{rng.integers(1 << 30)}"
        toks = rng.integers(0, eng.cfg.vocab_size, prompt_len).tolist()
        t0 = time.perf_counter()
        eng.add_request(rid, toks, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        done = False
        while not done:
            for o in eng.step():
                done = done or (o.request_id == rid and o.finished)
        ts.append(time.perf_counter() - t0)
        while eng.has_unfinished():
            eng.step()
    return ts


def _feeder_snapshot(eng) -> dict:
    """The feeder's cumulative figures (lookup / wait sums and counts, prefetch misses)."""
    if eng.engram is None:
        return {}
    m = eng.metrics.snapshot()
    h = m["histograms"]
    return {"lookup_s": h["engram_lookup"]["sum"], "wait_s": h["engram_wait"]["sum"],
            "calls": h["engram_lookup"]["count"], "misses": m["counters"]["engram_prefetch_misses"]}


def _feeder_delta(eng, before: dict, acc: dict):
    after = _feeder_snapshot(eng)
    for k, v in after.items():
        acc[k] = acc.get(k, 0) + v - before[k]


def part1(a, cfg, rows: list, save):
    """Every case on both engines, alternately, over `--rounds` rounds (the side that goes first alternates too);
    a discarded warm-up pass first. Per case: the median over all samples and each round's overhead."""
    from bench.decode_itl import fill_pools, measure

    e = _engines(a, cfg)
    meta = {k: v for k, v in e.items() if k not in ("device", "host")}
    rows.append({"case": "build", **meta})
    for side in ("device", "host"):
        fill_pools(e[side])
    rng = np.random.default_rng(0)
    cases = [("decode", B) for B in a.batches] + [("prefill", 1), ("prefill", 4)]
    acc = {(c, k, side): {"samples": [], "rounds": [], "host_ms": [], "feeder": {}}
           for c, k in cases for side in ("device", "host")}
    errors = {}

    def run(case, k, side, record: bool):
        eng = e[side]
        before = _feeder_snapshot(eng)
        if case == "decode":
            ts, host_ms = measure(eng, k, a.context, a.steps, a.warmup, rng)
        else:
            ts = _ttft(eng, k * a.chunk, a.prefill_reps if k == 1 else a.prefill_reps_long, rng)
            ts, host_ms = [t / k for t in ts], None  # per chunk
        if record:
            r = acc[(case, k, side)]
            r["samples"] += ts
            r["rounds"].append(statistics.median(ts))
            if host_ms is not None:
                r["host_ms"].append(host_ms)
            _feeder_delta(eng, before, r["feeder"])

    for rnd in range(-1, a.rounds):  # -1: warm-up (every program, transfer shape and feeder path once)
        for case, k in cases:
            for side in (("device", "host") if rnd % 2 == 0 else ("host", "device")):
                if (case, k, side) in errors:
                    continue
                if a.budget and time.perf_counter() - a.t_start > a.budget:
                    errors.setdefault((case, k, side), f"budget exhausted in round {rnd}")
                    continue
                try:
                    if rnd < 0:
                        run(case, k, side, False) if case == "prefill" else \
                            measure(e[side], k, a.context, 2, 1, rng)
                    else:
                        run(case, k, side, True)
                except Exception as ex:  # noqa: BLE001 - an error row, the run goes on
                    errors[(case, k, side)] = f"{type(ex).__name__}: {ex}"
        print(f"round {rnd} done at {time.perf_counter() - a.t_start:.0f} s", file=sys.stderr, flush=True)
    for case, k in cases:
        for side in ("device", "host"):
            r = acc[(case, k, side)]
            key = "batch" if case == "decode" else "chunks"
            row = {"case": case, "side": side, key: k}
            if case == "decode":
                row["context"] = a.context
            else:
                row["chunk"] = a.chunk
            if (case, k, side) in errors:
                row["error"] = errors[(case, k, side)]
            if r["samples"]:
                ts = r["samples"]
                name = "itl_ms" if case == "decode" else "ms_per_chunk"
                row.update({name: round(1000 * statistics.median(ts), 3),
                            name + "_p90": round(1000 * float(np.percentile(ts, 90)), 3), "samples": len(ts),
                            "rounds_ms": [round(1000 * t, 3) for t in r["rounds"]]})
                if r["host_ms"]:
                    row["host_ms_per_step"] = round(statistics.mean(r["host_ms"]), 3)
                f = r["feeder"]
                if f.get("calls"):
                    row.update({"lookup_ms_mean": round(1000 * f["lookup_s"] / f["calls"], 4),
                                "wait_ms_mean": round(1000 * f["wait_s"] / f["calls"], 4), "calls": f["calls"],
                                "prefetch_misses": f["misses"]})
            rows.append(row)
        dev, host = rows[-2], rows[-1]
        name = "itl_ms" if case == "decode" else "ms_per_chunk"
        if name in dev and name in host:
            host["overhead"] = round(host[name] / dev[name] - 1, 4)
            host["overhead_per_round"] = [round(h / d - 1, 4) for h, d in zip(host["rounds_ms"], dev["rounds_ms"])]
        print(rows[-2], rows[-1], sep="\n", file=sys.stderr, flush=True)
        save()
    if e["host"].engram is not None:
        rows.append({"case": "host_tables", **e["host"].engram.tables.describe(),
                     "gather_threads": e["host"].engram.threads})
    for side in ("device", "host"):
        if e[side].engram is not None:
            e[side].engram.close()
    e.clear()  # the engines go before part 2


# ----------------------------------------------------------------------------- part 2: full-size lookup
def _mem_available() -> int:
    """MemAvailable, capped by this cgroup's memory limit (a container's limit is below the host's memory)."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(used) as g:
                text = f.read().strip()
                if text != "max":
                    avail = min(avail, int(text) - int(g.read().strip()))
            break
        except (OSError, ValueError):
            continue
    return max(avail, 0)


def part2(a) -> dict:
    """Runs in its own process (--part lookup)."""
    import jax

    from checkpoints import host_tables
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.engram_hash import EngramHasher
    from dsv41_jax.engram_rows import row_format
    from serving.engine.engram_host import EngramFeeder

    full = ModelConfig.preset("full")
    fmt = row_format(full)
    want = full.engram_rows[0]
    avail = _mem_available()
    cap = a.lookup_rows or int(max(avail - a.reserve_gib * GIB, 0) // fmt.row_bytes)
    rows = min(want, cap)
    if a.smoke:
        rows = min(rows, 2 ** 18)
    res = {"mem_available_gib": round(avail / GIB, 1), "full_rows_per_table": list(full.engram_rows),
           "full_bytes_both_tables_gib": round(sum(full.engram_rows) * fmt.row_bytes / GIB, 1),
           "rows_allocated": rows, "table_gib": round(rows * fmt.row_bytes / GIB, 2),
           "fits": "both tables" if avail - a.reserve_gib * GIB >= sum(full.engram_rows) * fmt.row_bytes else
           ("one full table (the second layer's ids looked up in it)" if rows == want else
            f"{rows / want:.1%} of one table")}
    print(res, file=sys.stderr, flush=True)
    one = full.replace(engram_layer_ids=(1,), engram_num_embeddings=(rows,))
    pattern = np.random.default_rng(0).integers(0, 0x70, (1 << 20, fmt.row_bytes), dtype=np.uint8)  # no NaN codes

    def fill(arrays):
        from concurrent.futures import ThreadPoolExecutor

        t = arrays[0]
        step = pattern.shape[0]

        def part(i):
            b = min(t.shape[0], i + step)
            t[i:b] = pattern[:b - i]

        with ThreadPoolExecutor(16) as ex:
            list(ex.map(part, range(0, t.shape[0], step)))

    t0 = time.perf_counter()
    tables = host_tables.build(one, None, fill, host_tables.StoreOptions(shared=False))
    res["fill_s"] = round(time.perf_counter() - t0, 1)
    res["huge_page_gib"] = round(tables.huge_page_bytes() / GIB, 2)
    tables.arrays = [tables.arrays[0], tables.arrays[0]]  # both layers' lookups in the one table
    token_map = np.arange(full.vocab_size, dtype=np.int64) % full.engram_compressed_vocab_size
    hasher = EngramHasher(full, token_map)
    dev = jax.devices()[0]
    rng = np.random.default_rng(1)
    cases = []
    for threads in (1, 2, 4, 8):
        feeder = EngramFeeder(full, tables, hasher, lambda b: [jax.device_put(x, dev) for x in b],
                              gather_threads=threads, prefetch=False)
        for name, k, n in [("decode", B, 1) for B in a.batches] + [("prefill", 1, a.chunk)]:
            toks = rng.integers(0, full.vocab_size, (k, n))
            hist = rng.integers(0, full.engram_compressed_vocab_size, (k, 3))
            bufs = [np.empty((k * n, feeder.C, feeder.RB), np.uint8) for _ in range(feeder.E)]
            ts_hash, ts_take = [], []
            for _ in range(a.lookup_reps):
                t0 = time.perf_counter()
                ids = hasher.hash_ids(toks, hist).reshape(k * n, feeder.E, feeder.C) % rows
                t1 = time.perf_counter()
                feeder._take(ids, bufs)
                ts_hash.append(t1 - t0)
                ts_take.append(time.perf_counter() - t1)
            nbytes = k * n * feeder.E * feeder.C * feeder.RB
            take = statistics.median(ts_take)
            t0 = time.perf_counter()
            for _ in range(a.lookup_reps):
                jax.block_until_ready([jax.device_put(b, dev) for b in bufs])
            h2d = (time.perf_counter() - t0) / a.lookup_reps
            cases.append({"threads": threads, "call": name, "tokens": k * n, "bytes": nbytes,
                          "hash_ms": round(1000 * statistics.median(ts_hash), 4), "gather_ms": round(1000 * take, 4),
                          "gather_gbs": round(nbytes / take / 1e9, 2), "h2d_ms": round(1000 * h2d, 4),
                          "h2d_gbs": round(nbytes / h2d / 1e9, 2)})
            print(cases[-1], file=sys.stderr, flush=True)
        feeder.close()
    res["cases"] = cases
    return res


def _run_part2(a) -> dict:
    out = a.out + ".lookup.json" if a.out else "/tmp/engram_host_lookup.json"
    cmd = [sys.executable, "-m", "bench.engram_host", "--part", "lookup", "--lookup-json", out,
           "--chunk", str(a.chunk), "--batches", ",".join(map(str, a.batches)), "--lookup-reps", str(a.lookup_reps),
           "--reserve-gib", str(a.reserve_gib)] + (["--smoke"] if a.smoke else []) + \
        (["--lookup-rows", str(a.lookup_rows)] if a.lookup_rows else [])
    try:
        p = subprocess.run(cmd, timeout=a.lookup_timeout, capture_output=True, text=True)
        sys.stderr.write(p.stderr[-4000:])
        if p.returncode != 0:
            return {"error": f"exit {p.returncode} (killed for memory?)", "stderr": p.stderr[-1000:]}
        with open(out) as f:
            return json.load(f)["result"]
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.lookup_timeout} s"}


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.engram_host")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny, small shapes, a small lookup table")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every case on both engines (after a warm-up)")
    ap.add_argument("--prefill-reps", type=int, default=3, help="1-chunk prompts per engine and round")
    ap.add_argument("--prefill-reps-long", type=int, default=1, help="4-chunk prompts per engine and round")
    ap.add_argument("--threads", type=int, default=0, help="gather threads of the host engine (0: its default)")
    ap.add_argument("--host-config", default="", help="more --engram-config keys of the host engine (JSON), e.g. "
                    "'{\"pinned_staging\": false, \"rows_in_call\": false}' for the copies of before")
    ap.add_argument("--lookup-reps", type=int, default=5)
    ap.add_argument("--lookup-rows", type=int, default=0, help="rows of the part-2 table (0: as many as fit)")
    ap.add_argument("--reserve-gib", type=float, default=12.0, help="host memory left free in part 2")
    ap.add_argument("--lookup-timeout", type=float, default=150.0)
    ap.add_argument("--skip", default="", help="part1 and/or part2")
    ap.add_argument("--budget", type=float, default=270.0, help="stop starting part-1 cases after this many s")
    ap.add_argument("--part", default="all", help=argparse.SUPPRESS)
    ap.add_argument("--lookup-json", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    a.t_start = time.perf_counter()
    if a.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        a.preset, a.context, a.chunk, a.steps, a.warmup, a.prefill_reps = "tiny", 64, 32, 3, 1, 1
        a.batches, a.lookup_reps, a.budget, a.rounds = "1,2", 2, 0, 2
    a.batches = [int(x) for x in str(a.batches).split(",")]
    import dsv41_jax  # noqa: F401  (XLA flags before the backend starts)

    if a.part == "lookup":
        from bench.common import write_result

        res = part2(a)
        write_result(a.lookup_json, res, "python -m bench.engram_host " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:]))
        return res
    from dsv41_jax.config import ModelConfig

    cfg = ModelConfig.preset(a.preset)
    rows: list = []
    result = {"preset": a.preset, "weight_format": cfg.weight_format, "rows": rows}
    command = "python -m bench.engram_host " + " ".join(argv if argv is not None else sys.argv[1:])

    def save():
        if a.out:
            from bench.common import write_result

            write_result(a.out, result, command)

    if "part1" not in a.skip:
        try:
            part1(a, cfg, rows, save)
        except Exception as ex:  # noqa: BLE001
            rows.append({"case": "part1", "error": f"{type(ex).__name__}: {ex}"})
    save()
    if "part2" not in a.skip:
        result["lookup_full_size"] = _run_part2(a)
    result["total_s"] = round(time.perf_counter() - a.t_start, 1)
    save()
    print(f"{'case':>8} {'side':>6} {'B/chunks':>8} {'n':>4} {'median ms':>9} {'overhead':>8} {'per round':>24} "
          f"{'lookup ms':>9} {'wait ms':>8} {'misses':>6}")
    for r in rows:
        if r["case"] not in ("decode", "prefill"):
            continue
        k = r.get("batch", r.get("chunks"))
        if "error" in r and "samples" not in r:
            print(f"{r['case']:>8} {r.get('side', ''):>6} {k:>8} error: {r['error']}")
            continue
        ms = r["itl_ms"] if r["case"] == "decode" else r["ms_per_chunk"]
        per = " ".join(f"{x:+.1%}" for x in r.get("overhead_per_round", []))
        ov = f"{r['overhead']:+.2%}" if "overhead" in r else ""
        print(f"{r['case']:>8} {r['side']:>6} {k:>8} {r['samples']:>4} {ms:>9} {ov:>8} {per:>24} "
              f"{r.get('lookup_ms_mean', ''):>9} {r.get('wait_ms_mean', ''):>8} {r.get('prefetch_misses', ''):>6}"
              + (f" ({r['error']})" if "error" in r else ""))
    lk = result.get("lookup_full_size", {})
    if "cases" in lk:
        print(f"full-size lookup: {lk['rows_allocated']:,} rows ({lk['table_gib']} GiB, {lk['fits']}), "
              f"huge pages {lk['huge_page_gib']} GiB, fill {lk['fill_s']} s")
        print(f"{'threads':>7} {'call':>8} {'tokens':>6} {'gather ms':>9} {'GB/s':>6} {'h2d GB/s':>8}")
        for c in lk["cases"]:
            print(f"{c['threads']:>7} {c['call']:>8} {c['tokens']:>6} {c['gather_ms']:>9} {c['gather_gbs']:>6} "
                  f"{c['h2d_gbs']:>8}")
    elif lk:
        print("full-size lookup:", lk.get("error"))
    print(f"total {result['total_s']} s")
    return result


if __name__ == "__main__":
    main()
