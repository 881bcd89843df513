"""Decode inter-token latency against batch and context, XLA vs Pallas kernels, with the HBM roofline.

    python -m bench.decode_itl --preset medium --weight-format bf16 --kernels xla,pallas --batches 1,8,32 \
        --contexts 2048,8192,32768 --out bench/results/decode_medium_bf16_h200.json

For each kernel choice one engine is built that compiles only its decode programs (one per batch bucket).
For each (batch, context), B requests are injected at position `context` as if their prompts had been
prefilled: their pages and SWA rings hold random but well-formed FP4 / FP8 bytes (no NaN codes), so the decode
step reads exactly the bytes it would read after a real prefill, without spending minutes on prefills. The
engine then runs `--steps` decode steps (after `--warmup`); ITL = median wall time of `Engine.step()` (host
work included; the engine pipelines the host side with the device).

Roofline: the fewest bytes a decode step must read, over the 4.3 TB/s copy ceiling: every non-expert weight
byte of every layer and the head, the routed experts that B tokens activate (expected distinct experts under
uniform routing), and per sequence the KV the layers read (SWA windows, top-k latents, the indexer's keys:
full scans at the index sources that own keys, the candidate blocks at the Reindex layers).
`result.rows`: one row per configuration with preset, kernels, batch, context, itl_ms, roofline_ms.
Prints a short table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

COPY_GBS = 4300.0


def roofline_bytes(cfg, B: int, context: int) -> dict:
    from dsv41_jax import kv_format
    from dsv41_jax.params import param_specs

    E, k = cfg.n_routed_experts, cfg.n_activated_experts
    active = E * (1 - (1 - k / E) ** B)
    w = 0.0
    for path, leaf in param_specs(cfg).items():
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if path[0] == "embed" or leaf.role == "engram_table":
            continue  # B rows only
        if "experts" in path:
            nbytes *= active / E
        w += nbytes
    d, di, W = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    lat, idx = kv_format.fp4_latent_bytes(d), kv_format.fp4_index_bytes(di)
    kv = 0.0
    for l in range(cfg.n_layers):
        r = cfg.compress_ratios[l]
        kv += W * kv_format.fp8_swa_bytes(d)
        if r:
            C = context // r
            kv += min(cfg.index_topk, C) * lat
            kind = cfg.layer_kind(l)
            if kind == "src":
                kv += C * idx
            elif kind == "idx":
                kv += min(C, cfg.candidate_topk_blocks * cfg.candidate_block_size) * idx
    return {"weights": w, "kv": kv * B, "total": w + kv * B, "active_experts": active}


def fill_pools(engine, seed: int = 0):
    """Random, well-formed bytes in every page and ring: FP4 nibbles anything, scales 1.0, FP8 never NaN."""
    import jax
    import jax.numpy as jnp

    r = engine.runner
    lay = r.layout
    pb = lay.page_bytes
    scale_val = np.zeros(pb, np.int32) - 1
    for (kind, _, _), (off, n, eb) in lay.regions:
        dim = lay.head_dim if kind == "lat" else lay.index_head_dim
        for e in range(n):
            s0 = off + e * eb + dim // 2
            scale_val[s0:off + (e + 1) * eb] = 0x38 if kind == "lat" else 127  # E4M3 1.0 / UE8M0 2^0
    key = jax.random.key(seed)
    pages = r.pools["pages"]
    rnd = jax.random.randint(key, pages.shape, 0, 256, jnp.int32)
    sv = jnp.asarray(scale_val)
    r.pools["pages"] = jnp.where(sv[None] >= 0, sv[None], rnd).astype(jnp.uint8)
    swa = r.pools["swa"]
    d = engine.cfg.head_dim
    v = jax.random.randint(jax.random.fold_in(key, 1), swa.shape, 0, 0x70, jnp.int32)
    sign = jax.random.randint(jax.random.fold_in(key, 2), swa.shape, 0, 2, jnp.int32) << 7
    col = jnp.arange(swa.shape[-1])
    r.pools["swa"] = jnp.where(col >= d, 127, v | sign).astype(jnp.uint8)
    jax.block_until_ready(r.pools)


def inject(engine, B: int, context: int, n_steps: int, rng):
    """B running requests at position `context`, as if their prompts were prefilled."""
    from dsv41_jax.kv_format import pages_for
    from serving.engine.detokenizer import IncrementalDetokenizer
    from serving.engine.request import RUNNING, Request
    from serving.engine.types import SamplingParams

    W = engine.cfg.window_size
    out = []
    for i in range(B):
        toks = rng.integers(0, engine.cfg.vocab_size, context + 1).tolist()
        req = Request(f"itl-{context}-{B}-{i}", toks, context,
                      SamplingParams(max_tokens=n_steps + 8, temperature=0.0, ignore_eos=True))
        req.out.detok = IncrementalDetokenizer(None)
        req.out.out_ids.append(toks[-1])
        s = req.sched
        s.status, s.num_computed, s.prefill_end = RUNNING, context, context
        pages = engine.pool.allocate(pages_for(context + n_steps + 8))
        if pages is None:
            raise RuntimeError("page pool too small for the injected requests")
        s.pages = pages
        s.slot = engine.scheduler.free_slots.pop()
        s.enc_clip = s.dec_clip = max(context - W, 0)
        s.write_from = context
        s.admitted_once = True
        req.refresh_hashes()
        s.registered = len(s.hashes)
        engine.requests[req.request_id] = req
        engine.scheduler.running.append(req)
        out.append(req)
    return out


def replay(engine, key, inp, n: int) -> dict:
    """The engine's last decode program call, replayed n times with the same inputs, three ways (ms per call):
    `dispatch`: host time until the call returns (XLA enqueueing the step's kernels); `sync`: call, then wait
    for its sampled tokens (a minimal engine that waits each step, no Python scheduling); `async`: n calls
    back to back, waiting once at the end (what a step costs when the host never waits: async scheduling)."""
    import jax

    runner = engine.runner
    jax.block_until_ready(runner.pools)
    disp, sync = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        res = runner._call(key, inp)
        t1 = time.perf_counter()
        jax.block_until_ready(res.packed if res is not None else runner.pools)
        disp.append(t1 - t0)
        sync.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        res = runner._call(key, inp)
    jax.block_until_ready(runner.pools)
    if res is not None:
        jax.block_until_ready(res.packed)
    async_s = (time.perf_counter() - t0) / n
    return {"replay_dispatch_ms": round(1000 * statistics.median(disp), 3),
            "replay_sync_ms": round(1000 * statistics.median(sync), 3),
            "replay_async_ms": round(1000 * async_s, 3)}


def measure(engine, B, context, steps, warmup, rng, n_replay: int = 0):
    reqs = inject(engine, B, context, steps + warmup, rng)
    runner = engine.runner
    calls = []
    if n_replay:
        orig = runner.run

        def spy(key, inp):
            calls.append((key, inp))
            return orig(key, inp)

        runner.run = spy
    for _ in range(warmup):
        engine.step()
    ts = []
    h0 = dict(engine.host_time)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        ts.append(time.perf_counter() - t0)
    h1 = engine.host_time
    host_ms = 1000 * ((h1["step_s"] - h0["step_s"]) - (h1["wait_s"] - h0["wait_s"])) / steps
    extra = {}
    if n_replay:
        del runner.run  # back to the class's method
        decodes = [(k, i) for k, i in calls if k.kind == "decode"]
        if decodes:
            extra = replay(engine, *decodes[-1], n_replay)
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return ts, host_ms, extra


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.decode_itl")
    ap.add_argument("--preset", default="medium", help="a preset (random weights) or a checkpoint directory")
    ap.add_argument("--weight-format", default=None, help="bf16 | fp8 (None: the preset's)")
    ap.add_argument("--kernels", default="xla,pallas")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--xla-batches", default=None, help="batches for the xla side (default: --batches)")
    ap.add_argument("--budget", type=float, default=0,
                    help="after this many s from the start, build no engine (kernel choice) beyond the first; an "
                         "engine that was built measures all its configurations (a few seconds each), so a slow "
                         "compilation never leaves a built engine unmeasured")
    ap.add_argument("--scheduling", default="async",
                    help="comma list of async | sync: each configuration measured with the engine's async "
                         "scheduling and with its collect-first steps (serving/engine/device_tokens.py)")
    ap.add_argument("--replay", type=int, default=0,
                    help="also replay the last decode program call this many times: dispatch, sync and async "
                         "ms per call (what the step costs without the engine's Python, and without waiting)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    import jax

    import checkpoints
    import dsv41_jax  # noqa: F401
    from bench.common import kernel_args
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.kv_format import pages_for
    from serving.engine import Engine, EngineArgs

    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    kw = {"weight_format": a.weight_format} if a.weight_format else {}
    t0 = time.perf_counter()
    if os.path.isdir(a.preset):  # a checkpoint (e.g. the embedded default model)
        from serving.engine.engine import load_model

        cfg, params = load_model(a.preset, weight_format=a.weight_format)
    else:
        cfg = ModelConfig.preset(a.preset, **kw)
        params = checkpoints.random_init(cfg, 0)
    jax.block_until_ready(params)
    print(f"params ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    mml = -(-(max(contexts) + a.steps + a.warmup + 64) // 64) * 64
    rows = []
    rng = np.random.default_rng(0)
    def save():
        if a.out:
            from bench.common import write_result

            write_result(a.out, {"rows": rows}, "python -m bench.decode_itl " + " ".join(
                argv if argv is not None else sys.argv[1:]))

    built = False
    for impl in a.kernels.split(","):
        bl = [int(x) for x in a.xla_batches.split(",")] if (impl == "xla" and a.xla_batches) else batches
        args = EngineArgs(max_model_len=mml, max_num_seqs=max(bl), max_num_batched_tokens=cfg.window_size,
                          prefill_buckets=(cfg.window_size,), decode_buckets=tuple(bl),
                          **kernel_args(impl),
                          enable_prompt_logprobs=False, enable_prefix_caching=False,
                          num_pages=1 + max(bl) * pages_for(mml))
        if a.budget and built and time.perf_counter() - t_start > a.budget:
            print(f"budget exhausted: skipping {impl}", file=sys.stderr, flush=True)
            continue
        built = True
        t0 = time.perf_counter()
        eng = Engine(cfg, args, params=params, progress=True, programs=lambda k: k.kind == "decode")
        build = time.perf_counter() - t0
        fill_pools(eng)
        feedback = eng.device_tokens
        for B, C, sched in [(B, C, s) for B in bl for C in contexts for s in a.scheduling.split(",")]:
            if sched not in ("async", "sync"):
                raise SystemExit(f"--scheduling: async or sync, not {sched!r}")
            if sched == "async" and feedback is None:
                print(f"{impl}: async scheduling unavailable", file=sys.stderr, flush=True)
                continue
            eng.device_tokens = feedback if sched == "async" else None
            ts, host_ms, extra = measure(eng, B, C, a.steps, a.warmup, rng, a.replay)
            roof = roofline_bytes(cfg, B, C)
            row = {"preset": a.preset, "weight_format": cfg.weight_format, "kernels": impl, "scheduling": sched,
                   "batch": B,
                   "context": C, "itl_ms": round(1000 * statistics.median(ts), 3),
                   "itl_ms_p90": round(1000 * float(np.percentile(ts, 90)), 3),
                   "host_ms_per_step": round(host_ms, 3),
                   "roofline_ms": round(roof["total"] / COPY_GBS / 1e6, 4),
                   "roofline_bytes": int(roof["total"]), "kv_bytes": int(roof["kv"]),
                   "active_experts": round(roof["active_experts"], 2), "engine_build_s": round(build, 1),
                   **extra}
            row["over_roofline"] = round(row["itl_ms"] / max(row["roofline_ms"], 1e-9), 2)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
            save()
        del eng
    save()
    print(f"{'fmt':>5} {'kernels':>7} {'sched':>5} {'B':>3} {'context':>7} {'ITL ms':>8} {'roof ms':>8} {'x roof':>6}"
          + (f" {'dispatch':>8} {'sync':>8} {'async':>8}" if a.replay else ""))
    for r in rows:
        print(f"{r['weight_format']:>5} {r['kernels']:>7} {r['scheduling']:>5} {r['batch']:>3} {r['context']:>7} "
              f"{r['itl_ms']:>8} "
              f"{r['roofline_ms']:>8} {r['over_roofline']:>6}"
              + (f" {r.get('replay_dispatch_ms', '-'):>8} {r.get('replay_sync_ms', '-'):>8} "
                 f"{r.get('replay_async_ms', '-'):>8}" if a.replay else ""))
    return rows


if __name__ == "__main__":
    main()
