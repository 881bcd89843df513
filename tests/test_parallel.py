"""Tensor and data+expert parallelism on simulated CPU devices (docs/PARALLELISM.md).

Multi-device checks run in subprocesses with --xla_force_host_platform_device_count (this process keeps one
device); the model and engine subprocesses run concurrently, then the two processes of the multi-host run.
- model (4 devices): TP4 and DEP4 logits equal the single-device logits (f32, qdq off: psum order only,
  stated tolerance 1e-4; measured ~5e-6); a mesh of size 1 (TP1) is bit-exact in bf16 with every qdq point;
  the DEP MoE drops exactly the rows its capacity rule says (padded all_to_all and the ragged bookkeeping),
  counts them, and never sends padding rows; HF import and Orbax restore place every leaf on its shards.
- engine (2 devices): a DEP2 engine generates the single-device engine's greedy tokens; sessions stick to
  their rank and hit its prefix cache; the load cap moves a session; an idle rank and a queueing rank do not
  stall each other; each rank's page pool stays consistent and holds only its own sessions' pages.
- multi-host (2 processes x 2 devices, loopback): a TP4 engine through jax.distributed generates the
  single-device engine's greedy tokens (that engine runs in the engine subprocess: same weights, shapes and
  prompts); the follower replays the driver's calls and exits on shutdown.
In-process: layout errors (sizes that do not divide, more ranks than devices, TP with DP), the sharding
rules, placement and call packing.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from dsv41_jax.config import ModelConfig
from dsv41_jax.sharding import DATA, TENSOR, Parallel, check_layout, param_partition_specs
from serving.engine import EngineArgs, SamplingParams
from serving.engine.chunk_plan import DEC_NONE, DEC_WINDOW, ChunkPlan
from serving.engine.config import shared_cache_dir
from serving.engine.dp import Placement, Rank, chunk_groups, decode_rows
from serving.engine.page_pool import PagePool
from serving.engine.request import Request
from serving.engine.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig.preset("tiny")
TP4_CFG = dict(o_groups=4, index_n_heads=4, moe_inter_dim=128)  # tiny dims that split 4 ways

COMMON = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params
TINY32 = ModelConfig.preset("tiny", qdq=False, compute_dtype="float32")
CFG4 = TINY32.replace(o_groups=4, index_n_heads=4, moe_inter_dim=128)
def result(d):
    print("RESULT " + json.dumps(d), flush=True)
# the engines' shapes (prompts fit one chunk: only the window-decoder chunk program and decode are compiled)
ARGS = dict(max_model_len=192, max_num_seqs=2, max_num_batched_tokens=160, prefill_buckets=(160,),
            decode_buckets=(2,), enable_prompt_logprobs=False)
KEEP = lambda k: k.kind == "decode" or k.decoder == "window"
MH_PROMPTS = [np.random.default_rng(5).integers(0, 512, n).tolist() for n in (9, 16, 12)]

def greedy(e, prompts):
    from serving.engine import SamplingParams
    for i, t in enumerate(prompts):
        e.add_request(f"g{i}", t, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    res = {}
    while e.has_unfinished():
        for o in e.step():
            res.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [res[f"g{i}"] for i in range(len(prompts))]
"""

MODEL_SCRIPT = COMMON + r'''
from jax.sharding import NamedSharding, PartitionSpec as P
from dsv41_jax import layers, model, ops, paths
from dsv41_jax.model import ChunkInputs, init_state
from dsv41_jax.sharding import DATA, Parallel, check_layout, param_partition_specs
from serving.engine.dp import Placement  # noqa: F401  (the engine package imports under a mesh too)
assert len(jax.devices()) == 4
out = {}

def chunk(cfg, B=4, T=24):
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    return ChunkInputs.make(toks, paths.engram_ids(cfg, toks), n_valid=np.array([T, T - 4, T, 9]))

def placed(cfg, params, par, mesh):
    specs = param_partition_specs(cfg, par, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs), specs

def logits(cfg, params, inp, par=None):
    B, T = inp.tokens.shape
    state = init_state(cfg, B, 64)
    kw = dict(fresh=True, n_dec=T, n_logits=T)
    if par is None:
        return np.asarray(model.step(cfg, params, state, inp, **kw).logits)
    check_layout(cfg, par, len(jax.devices()))
    mesh = par.mesh()
    ex = ops.ExecContext(mesh=mesh, parallel=par)
    pp, pspecs = placed(cfg, params, par, mesh)
    if par.mode == "tp":
        return np.asarray(model.step(cfg, pp, state, inp, ex=ex, **kw).logits)
    sspecs = jax.tree.map(lambda _: P(None, DATA), state)  # dense state: batch is dim 1 of every array
    def body(p, s, i):
        o = model.step_impl(cfg, p, s, i, ex=ex, **kw)
        return o.logits, o.aux.moe_dropped[None]
    f = ops.data_parallel(ex, body, (pspecs, sspecs, jax.tree.map(lambda _: P(DATA), inp)), (P(DATA), P(DATA)))
    lg, dropped = jax.jit(f)(pp, state, inp)
    out["dep_model_dropped"] = int(np.asarray(dropped).sum())
    return np.asarray(lg)

def err(a, b, inp):
    m = np.arange(a.shape[1])[None] < np.asarray(inp.n_valid)[:, None]
    return float(np.abs(a - b)[m].max())

# f32, qdq off: TP4 / DEP4 against one device (psum order is the only difference)
p4 = jax.jit(lambda: init_params(CFG4, 0))()
inp = chunk(CFG4)
ref = logits(CFG4, p4, inp)
out["ref_std"] = float(ref.std())
out["tp4_err"] = err(logits(CFG4, p4, inp, Parallel("tp", 4)), ref, inp)
out["dep4_err"] = err(logits(CFG4, p4, inp, Parallel("dp", 4, ep=True, a2a="emulated")), ref, inp)
# bf16 with every qdq point: a mesh of size 1 is the single-device program bit for bit
tiny = ModelConfig.preset("tiny")
pt = jax.jit(lambda: init_params(tiny, 0))()
inp = chunk(tiny)
out["tp1_bitexact"] = bool(np.array_equal(logits(tiny, pt, inp, Parallel("tp", 1)), logits(tiny, pt, inp)))

# the DEP MoE alone: capacity rule, drop count, padding rows never sent
N, n = 4, 32
p = jax.tree.map(lambda a: a[3], pt["layers"]["ffn"])
x = jax.random.normal(jax.random.key(7), (N * n, 1, tiny.dim), jnp.bfloat16)
valid = np.ones((N * n, 1), bool)
valid[-5:] = False  # padding rows of the last rank
def moe_call(a2a, cf):
    par = Parallel("dp", N, ep=True, a2a=a2a, capacity_factor=cf)
    ex = ops.ExecContext(mesh=par.mesh(), parallel=par)
    specs = {k: jax.tree.map(lambda _: P(DATA) if k == "experts" else P(), v) for k, v in p.items()}
    def body(p, x, valid):
        y, dropped = ops.moe(ex, tiny, p, x, valid)
        w, idx = layers.gate(tiny, p["gate"], x.reshape(-1, tiny.dim))
        return y, dropped[None], w, idx
    f = jax.jit(ops.data_parallel(ex, body, (specs, P(DATA), P(DATA)), (P(DATA),) * 4))
    return [np.asarray(v) for v in f(p, x, jnp.asarray(valid))]

def expected_keep(idx, a2a, cf):
    """The documented capacity rule, re-derived: per source rank, its valid assignments sorted by expert
    (stable); padded: the first C per (source, destination); ragged: the receiver's buffer of R rows fills
    in source-rank order."""
    k, E = idx.shape[1], tiny.n_routed_experts
    El = E // N
    rows = n * k
    ceil8 = lambda v: -(-int(-(-v // 1)) // 8) * 8
    C = rows if not cf else max(8, min(ceil8(cf * rows / N), rows))
    R = N * rows if not cf else max(8, min(ceil8(cf * rows), N * rows))
    keep = np.zeros(idx.shape, bool)
    filled = np.zeros(N, int)
    for src in range(N):
        flat = idx[src * n:(src + 1) * n].reshape(-1)
        live = np.repeat(valid[src * n:(src + 1) * n, 0], k)
        key = np.where(live, flat, E)
        order = np.argsort(key, kind="stable")
        per = np.zeros(N, int)
        for i in order:
            if not live[i]:
                continue
            d = key[i] // El
            ok = per[d] < C if a2a == "padded" else filled[d] + per[d] < R
            per[d] += 1
            if ok:
                keep[src * n + i // k, i % k] = True
        filled += per
    return keep

for a2a, cf in (("padded", 0.0), ("padded", 1.0), ("emulated", 1.0)):
    y, dropped, w, idx = moe_call(a2a, cf)
    keep = expected_keep(idx, a2a, cf)
    x2 = np.asarray(x).reshape(-1, tiny.dim)
    wk = jnp.asarray(np.where(keep, w, 0.0), jnp.float32)
    want = layers.routed_experts(tiny, p["experts"], jnp.asarray(x2), wk, jnp.asarray(idx))
    want = (want + layers.shared_expert(tiny, p["shared"], jnp.asarray(x2)).astype(jnp.float32)).astype(x.dtype)
    want = np.asarray(want.astype(jnp.float32))
    got = y.reshape(-1, tiny.dim).astype(np.float32)
    out[f"moe_{a2a}_{cf}"] = {"dropped": int(dropped.sum()),
                              "expected_dropped": int(valid.sum() * idx.shape[1] - keep.sum()),
                              "err": float(np.abs(got - want).max()), "scale": float(np.abs(want).max())}

# checkpoints straight onto their shards: HF import (TP2) and Orbax restore (DEP4)
import tempfile
from checkpoints import import_hf, load, save_orbax, write_hf
from checkpoints.tree import flat
d = tempfile.mkdtemp()
write_hf(tiny, pt, d + "/hf", shard_size_mb=0.25, progress=False)
tp2 = Parallel("tp", 2)
_, hp = import_hf(d + "/hf", mesh=tp2.mesh(), parallel=tp2, slab_bytes=2048, progress=False)
save_orbax(d + "/ob", tiny, pt)
dep4 = Parallel("dp", 4, ep=True)
_, op = load(d + "/ob", mesh=dep4.mesh(), parallel=dep4)
same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
           for tree in (hp, op) for a, b in zip(flat(pt).values(), flat(tree).values()))
wq = hp["layers"]["attn"]["wq_b"]
w2 = op["layers"]["ffn"]["experts"]["w2"]["weight"]
out["ckpt"] = {"same": same, "wq_b_spec": str(wq["weight"].sharding.spec),
               "wq_b_shard": list(wq["scale"].addressable_shards[0].data.shape),
               "w2_spec": str(w2.sharding.spec), "w2_shard": list(w2.addressable_shards[0].data.shape)}
result(out)
'''

ENGINE_SCRIPT = COMMON + r'''
from serving.engine import Engine, EngineArgs, SamplingParams
assert len(jax.devices()) == 2
params = jax.jit(lambda: init_params(CFG4, 0))()  # the weights the multi-host engine makes (seed 0)
rng = np.random.default_rng(3)
turn1 = {s: rng.integers(0, 512, 70).tolist() for s in ("s0", "s1")}
extra = {s: rng.integers(0, 512, 5).tolist() for s in ("s0", "s1")}
burst = [rng.integers(0, 512, 20).tolist() for _ in range(5)]
SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

def drive(e, reqs):
    got, ranks = {}, {}
    for rid, toks, sess in reqs:
        e.add_request(rid, toks, SP, session_id=sess)
        ranks[rid] = e._rank.get(rid)
    while e.has_unfinished():
        for o in e.step():
            r = got.setdefault(o.request_id, {"ids": [], "cached": 0})
            r["ids"] += o.new_token_ids
            r["cached"] = o.num_cached_tokens
    return got, ranks

def scenario(e):
    res, ranks = {}, {}
    for batch in ([("a0", turn1["s0"], "s0"), ("a1", turn1["s1"], "s1")], None,
                  [(f"b{i}", t, "s2") for i, t in enumerate(burst)]):
        if batch is None:  # second turns: prompt + answer + new tokens, s0 alone first (rank 1 idle)
            batch = [("c0", turn1["s0"] + res["a0"]["ids"] + extra["s0"], "s0")]
            g, r = drive(e, batch); res.update(g); ranks.update(r)
            batch = [("c1", turn1["s1"] + res["a1"]["ids"] + extra["s1"], "s1")]
        g, r = drive(e, batch)
        res.update(g); ranks.update(r)
    return res, ranks

single = Engine(CFG4, EngineArgs(**ARGS), params=params, progress=False, programs=KEEP)
ref, _ = scenario(single)
mh_ref = greedy(single, MH_PROMPTS)  # the multi-host test's single-device reference
dep = Engine(CFG4, EngineArgs(**ARGS, data_parallel_size=2, enable_expert_parallel=True, dp_load_cap=1),
             params=params, progress=False, programs=KEEP)
got, ranks = scenario(dep)
for r in dep.ranks:
    r.pool.check()
st = dep.stats()["parallel"]
result({"ref": ref, "got": got, "ranks": ranks, "stats": st, "mh_ref": mh_ref,
        "free_slots": [len(r.scheduler.free_slots) for r in dep.ranks],
        "all_free": [r.pool.num_free() == r.pool.num_pages - 1 for r in dep.ranks],
        "cached_pages": [sorted(r.pool.hash_of) for r in dep.ranks]})
'''

MH_SCRIPT = COMMON + r'''
pid, port = int(sys.argv[1]), int(sys.argv[2])
from serving.engine import multihost
multihost.initialize("127.0.0.1", port, 2, pid, local_devices=2)
from serving.engine import Engine, EngineArgs
assert jax.process_count() == 2 and len(jax.devices()) == 4
eng = Engine(CFG4, EngineArgs(**ARGS, tensor_parallel_size=4), progress=False, programs=KEEP)
if pid:
    eng.follow()
    print("FOLLOWER-DONE", flush=True)
else:
    got = greedy(eng, MH_PROMPTS)
    eng.shutdown()
    result({"got": got, "layout": eng.stats()["parallel"]["layout"]})
'''


def _env(devices: int | None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=shared_cache_dir(),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    flags = os.environ.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = flags + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
    return env


def _start(script: str, devices: int | None, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen, timeout: float = 900) -> dict:
    out, err = p.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def runs():
    """The model and engine subprocesses, run concurrently (each compiles on its own core)."""
    procs = {"model": _start(MODEL_SCRIPT, 4), "engine": _start(ENGINE_SCRIPT, 2)}
    try:
        return {k: _result(p) for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


# ----------------------------------------------------------------------------- in-process: layouts and rules
@pytest.mark.parametrize("flags,needle", [
    (dict(tensor_parallel_size=2, data_parallel_size=2), "tensor parallelism with data parallelism"),
    (dict(tensor_parallel_size=2, enable_expert_parallel=True), "needs --data-parallel-size"),
    (dict(tensor_parallel_size=0), ">= 1"),
])
def test_bad_flag_combinations(flags, needle):
    with pytest.raises(ValueError, match=needle):
        Parallel.from_flags(**flags)


@pytest.mark.parametrize("par,cfg,needle", [
    (Parallel("tp", 4), TINY, r"o_groups \(2\)"),
    (Parallel("tp", 3), TINY, r"n_heads \(4\)"),
    (Parallel("tp", 2), TINY.replace(moe_inter_dim=96), r"moe_inter_dim \(96\) into multiples of 32"),
    (Parallel("dp", 3, ep=True), TINY, r"n_routed_experts \(8\)"),
])
def test_sizes_that_do_not_divide_the_model_fail_at_start_up(par, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        check_layout(cfg, par, 8)
    check_layout(cfg.replace(**TP4_CFG), Parallel("tp", 4), 8)  # the same sizes on dims that divide
    check_layout(cfg, Parallel("dp", 3), 8)  # DP without EP replicates the experts: any size


def test_more_ranks_than_devices_is_a_clear_error():
    for kw in (dict(tensor_parallel_size=2), dict(data_parallel_size=2, enable_expert_parallel=True)):
        with pytest.raises(ValueError, match="parallelism is not available with 1 device"):
            EngineArgs(max_model_len=256, **kw).resolved(TINY)
    with pytest.raises(ValueError, match="eager runs on one device"):
        EngineArgs(max_model_len=256, force_mesh=True, execution="eager").resolved(TINY)
    assert EngineArgs(max_model_len=256).resolved(TINY).parallel is None  # no flags: single device, no mesh


def test_rules_split_exactly_the_tp_and_dep_dims():
    tp = param_partition_specs(TINY, Parallel("tp", 2), Parallel("tp", 2).abstract_mesh())
    a = tp["layers"]["attn"]
    assert a["wq_b"]["weight"] == P(None, TENSOR) and a["wq_b"]["scale"] == P(None, TENSOR)  # column-parallel
    assert a["wo_b"]["weight"] == P(None, None, TENSOR)  # row-parallel: psum
    assert a["wo_a"] == P(None, TENSOR) and a["attn_sink"] == P(None, TENSOR)
    assert a["wq_a"]["weight"] == P() and a["wkv"]["weight"] == P()  # the latent KV path is replicated
    f = tp["layers"]["ffn"]
    assert f["experts"]["w1"]["weight"] == P(None, None, TENSOR) and f["experts"]["w2"]["scale"] == P(*[None] * 3,
                                                                                                     TENSOR)
    assert f["shared"]["w2"]["weight"] == P(None, None, TENSOR) and f["gate"]["weight"] == P()
    assert tp["idx"]["indexer"]["wq_b"]["weight"] == P(None, TENSOR) and tp["embed"]["weight"] == P()
    dep = param_partition_specs(TINY, Parallel("dp", 2, ep=True), Parallel("dp", 2).abstract_mesh())
    assert dep["layers"]["ffn"]["experts"]["w1"]["weight"] == P(None, DATA)
    assert all(s == P() for k, s in _flat(dep) if "experts" not in k)
    dp = param_partition_specs(TINY, Parallel("dp", 2), Parallel("dp", 2).abstract_mesh())
    assert all(s == P() for _, s in _flat(dp))  # DP without EP: full replicas


def _flat(tree, pre=()):
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _flat(v, pre + (k,))]
    if isinstance(tree, list):
        return [x for i, v in enumerate(tree) for x in _flat(v, pre + (str(i),))]
    return [(pre, tree)]


# ----------------------------------------------------------------------------- in-process: placement, packing
def _ranks(n=2, pages=40):
    args = EngineArgs(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64).resolved(TINY)
    out = []
    for i in range(n):
        pool = PagePool(pages)
        out.append(Rank(i, pool, Scheduler(args, pool, TINY.window_size), None))
    return out


def _req(rid, tokens, session=None):
    return Request(rid, list(tokens), len(tokens), SamplingParams(max_tokens=1), session)


def test_placement_sticky_cache_aware_and_capped():
    ranks, pl = _ranks(), Placement(load_cap=1, caching=True)
    r0 = pl.place(ranks, [1] * 70, "A", None)
    ranks[r0].scheduler.waiting.append(_req("a", [1] * 70, "A"))
    r1 = pl.place(ranks, [2] * 70, "B", None)  # least loaded
    assert (r0, r1) == (0, 1)
    ranks[r1].scheduler.waiting.append(_req("b", [2] * 70, "B"))
    ranks[0].scheduler.waiting.append(_req("x", [3] * 10))  # rank 0: load 2, rank 1: load 1
    assert pl.place(ranks, [1] * 90, "A", None) == 0  # sticky while within the cap
    ranks[0].scheduler.waiting.append(_req("y", [3] * 10))  # rank 0: load 3 > 1 + cap
    assert pl.place(ranks, [1] * 90, "A", None) == 1 and pl.sessions["A"] == 1 and pl.counts["moved"] == 1
    # without a session: the rank whose pool holds the prompt's cached prefix wins over the lighter one
    ranks2, pl2 = _ranks(), Placement(load_cap=4, caching=True)
    from serving.engine.block_hash import block_hashes

    toks = list(range(200))
    pages = ranks2[1].pool.allocate(2)
    for p, h in zip(pages, block_hashes(toks, None)):
        ranks2[1].pool.register(p, h)
    ranks2[1].scheduler.waiting.append(_req("z", [5] * 10))
    assert pl2.place(ranks2, toks, None, None) == 1 and pl2.counts["cache"] == 1
    assert pl2.place(ranks2, toks, None, "other-salt") == 0  # another salt: no hit, least loaded


def _plan(req, n, decoder=DEC_NONE, sample=False, decode=False):
    return ChunkPlan(req, 0, n, decoder, 0, 0, 0, sample, False, decode)


def test_calls_pack_one_chunk_per_rank_and_every_rank_s_decodes():
    reqs = {f"r{i}": _req(f"r{i}", [1] * 10) for i in range(6)}
    rank = {"r0": 0, "r1": 0, "r2": 1, "r3": 1, "r4": 1, "r5": 0}
    of = lambda r: rank[r.request_id]  # noqa: E731
    plans = [_plan(reqs["r0"], 32), _plan(reqs["r1"], 16, DEC_WINDOW, True), _plan(reqs["r2"], 16),
             _plan(reqs["r3"], 8), _plan(reqs["r4"], 8, DEC_WINDOW, True)]
    calls = chunk_groups(plans, of)
    assert [[p.req.request_id for p in c] for c, _ in calls] == [["r0", "r2"], ["r3"], ["r1", "r4"]]
    assert all(rows == [rank[p.req.request_id] for p in c] for c, rows in calls)  # row = rank
    dec = [_plan(reqs[r], 1, decode=True) for r in ("r0", "r2", "r3", "r4", "r5")]
    B, rows = decode_rows(dec, of)
    assert B == 3 and rows == [0, 3, 4, 5, 1]  # rank 1's rows start at B


# ----------------------------------------------------------------------------- multi-device subprocesses
def test_tp_and_dep_logits_equal_single_device(runs):
    m = runs["model"]
    assert m["ref_std"] > 0.1
    assert m["tp4_err"] < 1e-4 and m["dep4_err"] < 1e-4, m  # f32: psum order only
    assert m["dep_model_dropped"] == 0  # lossless capacity by default
    assert m["tp1_bitexact"], "a mesh of size 1 must be the single-device program bit for bit"


def test_dep_capacity_drops_exactly_the_overflow_and_counts_it(runs):
    m = runs["model"]
    lossless = m["moe_padded_0.0"]
    assert lossless["dropped"] == lossless["expected_dropped"] == 0
    for name in ("moe_padded_1.0", "moe_emulated_1.0"):
        r = m[name]
        assert r["expected_dropped"] > 0, "the capacity must bind for this check to mean anything"
        assert r["dropped"] == r["expected_dropped"], (name, r)
    for name in ("moe_padded_0.0", "moe_padded_1.0", "moe_emulated_1.0"):
        r = m[name]
        assert r["err"] <= 1e-2 * r["scale"], (name, r)  # the kept rows, and only those, were combined


def test_checkpoints_land_on_their_shards(runs):
    c = runs["model"]["ckpt"]
    assert c["same"]
    assert c["wq_b_spec"] == str(P(None, TENSOR)) and c["wq_b_shard"][1] == TINY.n_heads * TINY.head_dim // 64
    assert c["w2_spec"] == str(P(None, DATA)) and c["w2_shard"][1] == TINY.n_routed_experts // 4


def test_dep_engine_greedy_equals_single_device_with_sticky_sessions(runs):
    e = runs["engine"]
    assert e["got"] == e["ref"]
    ranks, st = e["ranks"], e["stats"]
    assert ranks["a0"] == ranks["c0"] != ranks["a1"] == ranks["c1"]  # second turns went to their rank
    hit = 64 - TINY.window_size  # and hit its prefix cache (one block; bounded replay recomputes the last window)
    assert e["got"]["c0"]["cached"] == e["got"]["c1"]["cached"] == e["ref"]["c0"]["cached"] == hit
    assert [ranks[f"b{i}"] for i in range(5)] == [0, 0, 1, 1, 1]  # the load cap (1) moved session s2 once
    assert st["layout"] == "DEP2" and st["placements"]["moved"] == 1 and st["placements"]["sticky"] >= 4
    assert st["moe_dropped_rows"] == 0
    assert e["free_slots"] == [2, 2] and e["all_free"] == [True, True]
    # each rank's cache holds only its own sessions' pages: one 64-token block per first turn
    assert [len(c) for c in e["cached_pages"]] == [1, 1]


def test_multi_host_tp4_over_two_processes_equals_single_device(runs):
    """The reference: the single-device engine of the engine subprocess (same weights, shapes and prompts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_start(MH_SCRIPT, None, pid, port) for pid in (0, 1)]
    try:
        res = _result(procs[0])
        out, err = procs[1].communicate(timeout=300)
        assert procs[1].returncode == 0 and "FOLLOWER-DONE" in out, err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert res["layout"] == "TP4" and res["got"] == runs["engine"]["mh_ref"]
