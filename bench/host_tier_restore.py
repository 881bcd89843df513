"""A warm turn restored from the host tier (--kv-offloading-size) vs kept on the device vs recomputed (issue 27 b).

    python -m bench.host_tier_restore --out /root/out/host_tier_restore_medium_h200.json   # H200, ~4 min
    python -m bench.host_tier_restore --smoke --out /tmp/host_tier_smoke.json                     # CPU, tiny

One engine (medium, prefix caching on, a host tier large enough for the longest prefix). For each prefix length
(8K and 64K tokens; "64K" is 65,280 so that the turn fits medium's 65,536-token context):
- kept: turn 1 = the prefix (one token generated), then turn 2 = prefix + `--extra` new tokens: TTFT of turn 2
  with the prefix's pages still on the device (bounded replay: the last window plus the new tokens computed);
- restored: every free page of the pool is allocated and released again, which evicts the cached prefix (its
  pages are saved to the host tier: `host_tier.wait()`), then turn 2 again: TTFT with the prefix copied back
  from host memory (the pages restored, counted, and the same greedy token as the kept turn);
- recompute: a prompt of the same length with no cached prefix (another cache_salt): TTFT of the full prefill.
Then the tier's copy bandwidth for the longest prefix's pages: the save path (gather of the rows + device-to-host
copy, what `HostTier.evicted` runs) and the restore path (host-to-device copy + donated scatter, `write_pages`),
against the host link: a bulk device_put / device-to-host copy of the same bytes and of 1 GiB.
Every failing case prints an error row and the run goes on; a short table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

GIB = 2 ** 30


def _turn(eng, toks, salt=None) -> tuple[float, int, int]:
    """(TTFT s, first token, cached tokens) of one request generating one token."""
    from serving.engine import SamplingParams

    rid = f"t{np.random.randint(1 << 30)}"
    t0 = time.perf_counter()
    eng.add_request(rid, toks, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), cache_salt=salt)
    tok, cached, ttft = None, 0, None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids and ttft is None:
                ttft, tok, cached = time.perf_counter() - t0, o.new_token_ids[0], o.num_cached_tokens
    return ttft, tok, cached


def _evict_all(eng):
    pool = eng.pool
    pages = pool.allocate(pool.num_free())
    pool.release(pages)
    eng.host_tier.wait()


def _bw(nbytes: int, s: float) -> float:
    return round(nbytes / s / 1e9, 2)


def copy_bandwidth(eng, n_pages: int, reps: int) -> dict:
    """The tier's save / restore paths on n_pages rows against plain bulk copies of the same bytes and of 1 GiB."""
    import jax

    r = eng.runner
    rows = np.arange(1, n_pages + 1, dtype=np.int32)
    pb = r.layout.page_bytes
    nbytes = n_pages * pb
    out = {"pages": n_pages, "bytes": nbytes}
    host = np.asarray(r.read_pages(rows))[:n_pages]  # compiles the padded shapes once
    r.write_pages(rows, host)
    jax.block_until_ready(r.pools)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dev = r.read_pages(rows)
        dev.copy_to_host_async()
        np.asarray(dev)
        ts.append(time.perf_counter() - t0)
    out["save_ms"] = round(1000 * statistics.median(ts), 3)
    out["save_gbs"] = _bw(nbytes, statistics.median(ts))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r.write_pages(rows, host)
        jax.block_until_ready(r.pools["pages"])
        ts.append(time.perf_counter() - t0)
    out["restore_ms"] = round(1000 * statistics.median(ts), 3)
    out["restore_gbs"] = _bw(nbytes, statistics.median(ts))
    dev0 = jax.devices()[0]
    for name, size in (("same_bytes", nbytes), ("1gib", GIB)):
        x = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        h2d, d2h = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            d = jax.block_until_ready(jax.device_put(x, dev0))
            h2d.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            np.asarray(d)
            d2h.append(time.perf_counter() - t0)
            d.delete()
        out[f"link_{name}_h2d_gbs"] = _bw(size, statistics.median(h2d))
        out[f"link_{name}_d2h_gbs"] = _bw(size, statistics.median(d2h))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.host_tier_restore")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--prefixes", default="8192,65280")
    ap.add_argument("--extra", type=int, default=64, help="new tokens of the warm turn")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny, short prefixes")
    ap.add_argument("--budget", type=float, default=200.0, help="stop starting cases after this many s")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    if a.smoke:
        import os

        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        a.preset, a.prefixes, a.extra, a.chunk, a.reps, a.budget = "tiny", "128,192", 16, 64, 2, 0
    import dsv41_jax  # noqa: F401  (XLA flags before the backend starts)
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.kv_format import pages_for
    from serving.engine import Engine, EngineArgs
    from serving.engine.config import shared_cache_dir

    cfg = ModelConfig.preset(a.preset)
    prefixes = [int(x) for x in a.prefixes.split(",")]
    mml = min(cfg.max_seq_len, pages_for(max(prefixes) + a.extra + 1) * 64)
    n = pages_for(mml)
    W = cfg.window_size
    args = EngineArgs(max_model_len=mml, max_num_seqs=1, max_num_batched_tokens=a.chunk,
                      prefill_buckets=tuple(sorted({pages_for(W + a.extra) * 64, a.chunk})), decode_buckets=(1,),
                      enable_prompt_logprobs=False, num_pages=1 + 3 * n, kv_offloading_size=1.0,
                      compilation_cache_dir=shared_cache_dir())
    t0 = time.perf_counter()
    eng = Engine(cfg, args, progress=not a.smoke, programs=lambda k: k.kind != "decode" or k.size == 1)
    rows, result = [], {"preset": a.preset, "build_s": round(time.perf_counter() - t0, 1)}
    page_bytes = eng.runner.layout.page_bytes
    needed = (n + 1) * page_bytes
    if needed > eng.host_tier.capacity * page_bytes:
        rows.append({"case": "setup", "error": f"host tier of {eng.host_tier.capacity} pages < {n}"})
    result["rows"] = rows
    command = "python -m bench.host_tier_restore " + " ".join(argv if argv is not None else sys.argv[1:])

    def save():
        if a.out:
            from bench.common import write_result

            write_result(a.out, result, command)

    rng = np.random.default_rng(0)
    m = eng.metrics.counters
    for P in prefixes:
        if a.budget and time.perf_counter() - t_start > a.budget:
            rows.append({"prefix": P, "error": "budget exhausted"})
            continue
        try:
            kept, restored, recompute, tok_k, tok_r, cached_k, cached_r, pages_r = [], [], [], [], [], [], [], []
            reps = a.reps if P <= 8192 else max(1, a.reps - 1)  # a 64K turn 1 is a long prefill
            for i in range(reps):
                prefix = rng.integers(0, cfg.vocab_size, P).tolist()
                turn2 = prefix + rng.integers(0, cfg.vocab_size, a.extra).tolist()
                _turn(eng, prefix)  # turn 1: the prefix cached on the device
                t, tok, c = _turn(eng, turn2)
                kept.append(t)
                tok_k.append(tok)
                cached_k.append(c)
                _evict_all(eng)
                r0 = m["offload_restored_pages"]
                t, tok, c = _turn(eng, turn2)
                restored.append(t)
                tok_r.append(tok)
                cached_r.append(c)
                pages_r.append(m["offload_restored_pages"] - r0)
                if i == 0 or P <= 8192:  # one 64K recompute
                    t, _, c = _turn(eng, turn2, salt=f"cold-{i}")
                    recompute.append(t)
                _evict_all(eng)  # the next repetition starts with an empty device cache
            med = lambda x: round(1000 * statistics.median(x), 2)  # noqa: E731
            row = {"prefix": P, "extra": a.extra, "kept_ttft_ms": med(kept), "restored_ttft_ms": med(restored),
                   "recompute_ttft_ms": med(recompute), "cached_tokens_kept": cached_k[0],
                   "cached_tokens_restored": cached_r[0], "pages_restored": pages_r[0],
                   "same_token": tok_k == tok_r, "restore_over_kept_ms": round(med(restored) - med(kept), 2),
                   "recompute_over_restored": round(statistics.median(recompute) / statistics.median(restored), 1)}
        except Exception as ex:  # noqa: BLE001 - an error row, the run goes on
            row = {"prefix": P, "error": f"{type(ex).__name__}: {ex}"}
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        save()
    try:
        k = min(pages_for(max(prefixes)), eng.args.num_pages - 1)
        result["copy"] = copy_bandwidth(eng, 1 << (k.bit_length() - 1), a.reps)  # a power of two: no padding
    except Exception as ex:  # noqa: BLE001
        result["copy"] = {"error": f"{type(ex).__name__}: {ex}"}
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(f"{'prefix':>7} {'kept ms':>9} {'restored ms':>11} {'recompute ms':>12} {'pages':>6} {'same':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r.get('prefix', ''):>7} error: {r['error']}")
            continue
        print(f"{r['prefix']:>7} {r['kept_ttft_ms']:>9} {r['restored_ttft_ms']:>11} {r['recompute_ttft_ms']:>12} "
              f"{r['pages_restored']:>6} {str(r['same_token']):>5}")
    c = result["copy"]
    if "error" not in c:
        print(f"copy of {c['pages']} pages ({c['bytes'] / 2 ** 20:.1f} MiB): save {c['save_gbs']} GB/s, restore "
              f"{c['restore_gbs']} GB/s; link same bytes h2d {c['link_same_bytes_h2d_gbs']} / d2h "
              f"{c['link_same_bytes_d2h_gbs']} GB/s, 1 GiB h2d {c['link_1gib_h2d_gbs']} / d2h {c['link_1gib_d2h_gbs']}")
    else:
        print("copy:", c["error"])
    print(f"total {result['total_s']} s")
    return result


if __name__ == "__main__":
    main()
