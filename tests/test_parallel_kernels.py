"""The Pallas kernels under tensor parallelism, op by op, on 2 and 4 simulated CPU devices (interpret mode)
against one device (docs/PARALLELISM.md, "Pallas kernels under TP").

One subprocess with 4 devices: a prefill (XLA, one device) fills a paged state of the tiny model (window 64, TP-
divisible head / group / expert dims); then every op with a Pallas kernel runs with kernels="pallas" on one
device, on a TP mesh of 2 and of 4 (parameters placed on their shards), on the same operands:
- head-split ops (attention, WO-A, the indexer's scores and top-k): bit-identical (each head's arithmetic is the
  one device's; the indexer's f32 head partials sum exactly before the one rounding);
- replicated kernels (Mega-mHC boundary, the column-parallel and unsplit linears, the ring write): bit-identical;
- the MoE (Mega-Gate replicated, experts split over the intermediate dim) and the row-parallel linear (psum of f32
  partials): the psum order and the MoE's one rounding of the expert sum (docs/PARALLELISM.md) move an output
  by at most a few bf16 ulps of its row's largest value.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dsv41_jax import model, ops, paths, quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.kv_cache import CompressorCarry, KVState, PagedGlobal, PagedKV, PageLayout, SwaPool
from dsv41_jax.kv_format import swa_entry_bytes
from dsv41_jax.model import ChunkInputs
from dsv41_jax.params import init_params, source_slots
from dsv41_jax.rope import layer_freqs
from dsv41_jax.sharding import Parallel, check_layout, param_partition_specs
from dsv41_jax.weights import LayerRef
assert len(jax.devices()) == 4
CFG = ModelConfig.preset("tiny", window_size=64, n_heads=4, o_groups=4, index_n_heads=4, moe_inter_dim=128)
B, T0 = 2, 70
params = jax.jit(lambda: init_params(CFG, 0))()
lay = PageLayout.for_config(CFG)
kv = PagedKV(lay, "bfloat16")
table = jnp.asarray(np.arange(1, 1 + B * 4).reshape(B, 4), jnp.int32)
n_r2, d = source_slots(CFG)[1].get("src_r2", 0), CFG.head_dim
state = KVState(SwaPool(jnp.zeros((CFG.n_layers, B + 1, 64, swa_entry_bytes(CFG)), jnp.uint8),
                        jnp.arange(B, dtype=jnp.int32)),
                PagedGlobal(jnp.zeros((1 + B * 4, lay.page_bytes), jnp.uint8), table),
                CompressorCarry(jnp.zeros((n_r2, B, 2, d), jnp.float32), jnp.full((n_r2, B, 2, d), -jnp.inf)))
toks = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T0)).astype(np.int32)
state = model.step(CFG, params, state, ChunkInputs.make(toks, paths.engram_ids(CFG, toks)), fresh=True, n_dec=T0,
                   n_logits=1, ex=ops.ExecContext(kv=kv)).state
rng = np.random.default_rng(1)
def bf(*shape, s=1.0):
    return jnp.asarray(rng.normal(0, s, shape), jnp.bfloat16)
pos0 = jnp.full((B,), T0, jnp.int32)
qpos = pos0[:, None]
L = 4  # a ratio-1 layer reading source 0 of ratio 1 (layer 4 of tiny)
freqs = jnp.asarray(layer_freqs(CFG, 1))
sel = jnp.asarray(np.sort(rng.choice(T0, (B, 1, CFG.index_topk)), axis=-1), jnp.int32)
att = ops.AttentionOperands(q=bf(B, 1, CFG.n_heads, d), chunk_kv=quant.fp8_qdq(bf(B, 1, d), 32), pos0=pos0,
                            clip=jnp.zeros((B,), jnp.int32), sel=sel, sink=params["layers"]["attn"]["attn_sink"][L],
                            layer=jnp.int32(L), src=jnp.int32(0), ratio=1, freqs=freqs)
C = kv.capacity(state.glob, 1)
cand = jnp.full((B, 1, CFG.candidate_topk_blocks), -1, jnp.int32)
ix = ops.IndexerInputs(x=bf(B, 1, CFG.dim), qr=bf(B, 1, CFG.q_lora_rank), qpos=qpos, src=jnp.int32(0), cand=cand,
                       freqs=freqs, ratio=1, cand_source=True, uses_cand=False)
res = ops.Residual(bf(B, 1, CFG.hc_mult, CFG.dim), bf(B, 1, CFG.dim),
                   jnp.asarray(rng.uniform(0, 1, (B, 1, (2 + CFG.hc_mult) * CFG.hc_mult)), jnp.float32))
o_grp = bf(B, 1, CFG.o_groups, CFG.n_heads * d // CFG.o_groups)
x = bf(B, 1, CFG.dim)
qr = bf(B, 1, CFG.q_lora_rank)
xr = bf(B, 1, CFG.o_groups * CFG.o_lora_rank)

def run(par):
    ex = ops.ExecContext(kv=kv, kernels="pallas", mesh=None if par is None else par.mesh(), parallel=par)
    p, st = params, state
    if par is not None:
        check_layout(CFG, par, 4)
        specs = param_partition_specs(CFG, par, ex.mesh)
        p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(ex.mesh, s)), params, specs)
        st = jax.device_put(state, NamedSharding(ex.mesh, P()))
    def f(p, lr_stack, ip_stack, state):
        lr, ip = LayerRef(lr_stack, jnp.int32(L)), LayerRef(ip_stack, jnp.int32(0))
        out = {}
        out["attention"] = ops.csa_attention(ex, CFG, att, state)
        out["wo_a"] = ops.grouped_out_proj(ex, CFG, lr["attn"]["wo_a"], o_grp)
        out["topk"], out["cand"] = ops.indexer(ex, CFG, ip, ix, state)
        out["hc_h"], out["hc_x"], out["hc_xq"], out["hc_mix"] = ops.hc_boundary(ex, CFG, res, lr, "ffn")
        out["wq_a"] = ops.linear(ex, CFG, lr["attn"]["wq_a"], x)
        out["wq_b"] = ops.linear(ex, CFG, lr["attn"]["wq_b"], qr, split="column")
        out["wo_b"] = ops.linear(ex, CFG, lr["attn"]["wo_b"], xr, split="row")
        one = jnp.ones((B,), jnp.int32)
        out["ring"] = ops.ring_write(ex, CFG, state, jnp.int32(L), att.chunk_kv, pos0, one).swa.pool
        out["moe"] = ops.moe(ex, CFG, lr["ffn"], x)[0]
        return out
    out = jax.jit(f)(p, p["layers"], p["src_r1"]["indexer"], st)
    return {k: np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v)
            for k, v in out.items() if v is not None}

ref = run(None)
result = {}
for n in (2, 4):
    got = run(Parallel("tp", n))
    for k, w in ref.items():
        g = got[k]
        if g.dtype.kind == "f":
            scale = np.max(np.abs(w), axis=-1, keepdims=True) + 1e-30
            err = float(np.max(np.abs(g - w) / scale))
        else:
            err = float(np.mean(g != w))
        result[f"tp{n}_{k}"] = {"equal": bool(np.array_equal(g, w)), "err": err}
print("RESULT " + json.dumps(result), flush=True)
'''

EXACT = ("attention", "wo_a", "topk", "cand", "hc_h", "hc_x", "hc_xq", "hc_mix", "wq_a", "wq_b", "ring")


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("n", [2, 4])
def test_head_split_and_replicated_kernels_equal_one_device(result, n):
    bad = {k: result[f"tp{n}_{k}"] for k in EXACT if not result[f"tp{n}_{k}"]["equal"]}
    assert not bad, bad


@pytest.mark.parametrize("n", [2, 4])
def test_psum_ops_within_a_few_bf16_ulps(result, n):
    for k in ("wo_b", "moe"):
        assert result[f"tp{n}_{k}"]["err"] <= 4 * 2.0 ** -8, (k, result[f"tp{n}_{k}"])
