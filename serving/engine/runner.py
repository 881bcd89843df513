"""Model runner: device pools and the fixed-shape compiled programs (the JAX analogue of CUDA graphs).

Device state (donated to every program and updated in place):
  pages      uint8 [P, page_bytes]        the paged global KV (dsv41_jax.kv_cache.PagedKV layout)
  swa        uint8 [L, S+1, W, e]         per-request SWA rings, FP8 + UE8M0 per 32 (raw bytes if qdq off);
                                          slot S is scratch for padding rows
  comp_kv/comp_score f32 [n_r2, S+1, 2, d] partial ratio-2 compressor groups
  snap_*                                  exact mode only: SWA + compressor snapshots at retained boundaries

Programs (all compiled at start-up, behind a progress bar; afterwards nothing compiles):
  prefill[T, dec]   one request's chunk of T (bucketed) tokens; dec = "none" (non-final chunk: encoder and
                    the layer-20 build only), "win" (final chunk, CED: decoder on the last window rows, then
                    sampling), "all" (exact mode: decoder on every row; sampling on the final chunk)
  prefill[T, plp]   requests asking for prompt logprobs: decoder and logits on every row (exact), scored at
                    the next prompt token, plus sampling
  decode[B]         one token for each of B (bucketed) running requests: the whole 40-layer step + sampling
  snap_save/load    copy a request's SWA rings + compressor state to / from a snapshot slot (exact mode)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from dsv41_jax import quant
from dsv41_jax.kv_cache import PagedKV, PageLayout
from dsv41_jax.layers import cdtype
from dsv41_jax.model import step_impl
from dsv41_jax.params import source_slots
from serving.engine.sampler import sample
from serving.engine.types import MAX_LOGPROBS


def _swa_pack(cfg, x):
    if cfg.qdq:
        q, codes = quant.fp8_pack(x, 32)
        return jnp.concatenate([q, codes], axis=-1)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], -1)


def _swa_unpack(cfg, b):
    d = cfg.head_dim
    if cfg.qdq:
        return quant.fp8_unpack(b[..., :d], b[..., d:], 32, cdtype(cfg))
    dt = cdtype(cfg)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], d, jnp.dtype(dt).itemsize), dt)


class Runner:
    def __init__(self, cfg, params, args, max_pages: int):
        self.cfg, self.params, self.args = cfg, params, args
        self.max_pages = max_pages  # page-table width = ceil(max_model_len / 64)
        self.layout = PageLayout.for_config(cfg)
        self.kv = PagedKV(self.layout, cfg.compute_dtype)
        self.S = args.max_num_seqs
        self.n_r2 = source_slots(cfg)[1].get("src_r2", 0)
        self.n_cols = ((cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads) if cfg.engram_layer_ids else 0
        self.n_eng = len(cfg.engram_layer_ids)
        self.pools = self._alloc_pools()
        self.programs: dict = {}
        self.compile_count = 0

    # ------------------------------------------------------------------ pools
    def _alloc_pools(self):
        cfg, a = self.cfg, self.args
        W, d = cfg.window_size, cfg.head_dim
        e = d + d // 32 if cfg.qdq else d * jnp.dtype(cdtype(cfg)).itemsize
        pools = {"pages": jnp.zeros((a.num_pages, self.layout.page_bytes), jnp.uint8),
                 "swa": jnp.zeros((cfg.n_layers, self.S + 1, W, e), jnp.uint8)}
        if self.n_r2:
            pools["comp_kv"] = jnp.zeros((self.n_r2, self.S + 1, 2, d), jnp.float32)
            pools["comp_score"] = jnp.full((self.n_r2, self.S + 1, 2, d), -jnp.inf, jnp.float32)
        if not a.swa_bounded_replay:
            n = a.snapshot_slots
            pools["snap_swa"] = jnp.zeros((cfg.n_layers, n, W, e), jnp.uint8)
            if self.n_r2:
                pools["snap_comp_kv"] = jnp.zeros((self.n_r2, n, 2, d), jnp.float32)
                pools["snap_comp_score"] = jnp.full((self.n_r2, n, 2, d), -jnp.inf, jnp.float32)
        return pools

    def pool_bytes(self) -> dict:
        return {k: int(v.size * v.dtype.itemsize) for k, v in self.pools.items()}

    # ------------------------------------------------------------------ program bodies
    def _step(self, params, pools, slots, table, tokens, ids, pos0, n_valid, enc_clip, dec_clip, write_from,
              samp, *, n_dec, do_sample, n_logits=1):
        cfg = self.cfg
        state = {"pages": pools["pages"], "page_table": table,
                 "swa": _swa_unpack(cfg, pools["swa"][:, slots])}
        if self.n_r2:
            state["comp_kv"] = pools["comp_kv"][:, slots]
            state["comp_score"] = pools["comp_score"][:, slots]
        logits, state, _ = step_impl(cfg, params, state, tokens, ids, pos0, enc_clip, dec_clip, write_from,
                                     None, n_valid, fresh=False, n_dec=n_dec, n_logits=n_logits, kv=self.kv)
        out = dict(pools, pages=state["pages"], swa=pools["swa"].at[:, slots].set(_swa_pack(cfg, state["swa"])))
        if self.n_r2:
            out["comp_kv"] = pools["comp_kv"].at[:, slots].set(state["comp_kv"])
            out["comp_score"] = pools["comp_score"].at[:, slots].set(state["comp_score"])
        if not do_sample:
            return out, None
        if n_logits == 1:
            last = logits[:, 0]
        else:  # prompt logprobs: every row's distribution, scored at the next prompt token
            last = jnp.take_along_axis(logits, (n_valid - 1)[:, None, None], axis=1)[:, 0]
        res = sample(last, samp["temperature"], samp["top_k"], samp["top_p"], samp["min_p"],
                     samp["seed"], samp["counter"], MAX_LOGPROBS)
        if n_logits > 1:
            lp = jax.nn.log_softmax(logits, axis=-1)
            nxt = jnp.take_along_axis(lp, samp["next_ids"][..., None], axis=-1)[..., 0]
            top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
            res = res + (nxt, top_ids.astype(jnp.int32), top_lp)
        return out, res

    def _snap(self, pools, src, dst, *, save: bool):
        out = dict(pools)
        pairs = [("swa", "snap_swa")] + ([("comp_kv", "snap_comp_kv"), ("comp_score", "snap_comp_score")]
                                         if self.n_r2 else [])
        for live, snap in pairs:
            if save:
                out[snap] = pools[snap].at[:, dst].set(pools[live][:, src])
            else:
                out[live] = pools[live].at[:, dst].set(pools[snap][:, src])
        return out

    # ------------------------------------------------------------------ shapes and compilation
    def _abstract_inputs(self, B, T, plp=False):
        i32 = np.int32
        sds = jax.ShapeDtypeStruct
        ids = sds((B, T, self.n_eng, self.n_cols), i32) if self.n_eng else None
        samp = {"temperature": sds((B,), np.float32), "top_k": sds((B,), i32), "top_p": sds((B,), np.float32),
                "min_p": sds((B,), np.float32), "seed": sds((B,), np.uint32), "counter": sds((B,), i32)}
        if plp:
            samp["next_ids"] = sds((B, T), i32)
        return (sds((B,), i32), sds((B, self.max_pages), i32), sds((B, T), i32), ids, sds((B,), i32),
                sds((B,), i32), sds((B,), i32), sds((B,), i32), sds((B,), i32), samp)

    def program_keys(self):
        a = self.args
        keys = []
        for T in a.prefill_buckets:
            if a.swa_bounded_replay:
                keys += [("prefill", T, "none"), ("prefill", T, "win")]
            else:
                keys += [("prefill", T, "all"), ("prefill", T, "all+sample")]
        if a.enable_prompt_logprobs:
            keys += [("prefill", T, "plp") for T in a.prefill_buckets]
        keys += [("decode", B, "one") for B in a.decode_buckets]
        if not a.swa_bounded_replay:
            keys += [("snap", 1, "save"), ("snap", 1, "load")]
        return keys

    def _fn(self, key):
        kind, n, mode = key
        if kind == "snap":
            return partial(self._snap, save=mode == "save")
        W = self.cfg.window_size
        if kind == "decode":
            return partial(self._step, n_dec=1, do_sample=True)
        if mode == "plp":  # decoder and logits on every row: prompt logprobs, exact (no CED trimming)
            return partial(self._step, n_dec=n, do_sample=True, n_logits=n)
        n_dec = {"none": 0, "win": min(W, n), "all": n, "all+sample": n}[mode]
        return partial(self._step, n_dec=n_dec, do_sample=mode in ("win", "all+sample"))

    def compile_all(self, progress: bool = True):
        """Compile every program for its bucket (or prepare eager callables); returns seconds taken."""
        import time

        t0 = time.perf_counter()
        keys = self.program_keys()
        for key in tqdm(keys, desc="compiling programs", disable=not progress):
            fn = self._fn(key)
            if key[0] == "snap":
                if self.args.execution == "eager":
                    self.programs[key] = fn
                    continue
                i32 = jax.ShapeDtypeStruct((), np.int32)
                jf = jax.jit(fn, donate_argnums=(0,))
                self.programs[key] = jf.lower(self.pools, i32, i32).compile()
            else:
                B, T = (key[1], 1) if key[0] == "decode" else (1, key[1])
                if self.args.execution == "eager":
                    self.programs[key] = fn
                    continue
                jf = jax.jit(fn, donate_argnums=(1,))
                inputs = self._abstract_inputs(B, T, plp=key[2] == "plp")
                self.programs[key] = jf.lower(self.params, self.pools, *inputs).compile()
            self.compile_count += 1
        return time.perf_counter() - t0

    def run(self, key, *args):
        fn = self.programs[key]
        if self.args.execution == "eager":
            with jax.disable_jit():
                if key[0] == "snap":
                    self.pools = fn(self.pools, *args)
                    return None
                self.pools, res = fn(self.params, self.pools, *args)
                return res
        if key[0] == "snap":
            self.pools = fn(self.pools, *args)
            return None
        self.pools, res = fn(self.params, self.pools, *args)
        return res

    def bucket(self, kind: str, n: int) -> int:
        bs = self.args.prefill_buckets if kind == "prefill" else self.args.decode_buckets
        for b in bs:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest {kind} bucket {bs[-1]}")
