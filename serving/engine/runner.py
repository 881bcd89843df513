"""Model runner: device pools and the fixed-shape compiled programs (the JAX analogue of CUDA graphs).

Device state (donated to every program and updated in place):
  pages      uint8 [P, page_bytes]        the paged global KV (dsv41_jax.kv_cache.PagedKV layout)
  swa        uint8 [L, S+1, W, e]         per-request SWA rings, FP8 + UE8M0 per 32 (raw bytes if qdq off);
                                          slot S is scratch for padding rows
  comp_kv/comp_score f32 [n_r2, S+1, 2, d] partial ratio-2 compressor groups
  snap_*                                  exact mode only: SWA + compressor snapshots at retained boundaries

Programs (`ProgramKey`; all compiled at start-up behind a progress bar; afterwards nothing compiles):
  prefill[T]  one request's chunk of T (bucketed) tokens, decoder rows none / window / all as the chunk plan
              says, sampling on final chunks, or logits on every row (prompt logprobs)
  decode[B]   one token for each of B (bucketed) running requests: the whole 40-layer step + sampling
  snap_save / snap_load  copy a request's SWA rings + compressor state to / from a snapshot slot (exact mode)
Every chunk/decode program takes (params, pools, StepInputs) and returns (pools, packed outputs): see step_io.

Invariant: after a program call the runner holds valid pools, or `pools_lost()` is true (the call failed after
the pools were donated); the engine then calls `reset_pools()` and recomputes what was lost.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from dsv41_jax import quant
from dsv41_jax.kv_cache import PagedKV, PageLayout
from dsv41_jax.kv_format import swa_entry_bytes
from dsv41_jax.layers import cdtype
from dsv41_jax.model import step_impl
from dsv41_jax.ops import ExecContext
from dsv41_jax.params import source_slots
from serving.engine.chunk_plan import DEC_ALL, DEC_NONE, DEC_WINDOW
from serving.engine.sampler import sample
from serving.engine.step_io import (
    DECODE,
    PREFILL,
    SNAP_LOAD,
    SNAP_SAVE,
    PendingOutputs,
    ProgramKey,
    StepInputs,
    StepOutputs,
    pack_outputs,
)
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


def _check_pallas_config(cfg):
    """The kernels implement the production formats: bf16 compute, FP8/FP4 KV (qdq on), 64-entry window chunks."""
    problems = []
    if cfg.compute_dtype != "bfloat16":
        problems.append(f"compute_dtype {cfg.compute_dtype} (needs bfloat16)")
    if not cfg.qdq:
        problems.append("qdq off (the kernels read FP8 rings and FP4 pages)")
    if cfg.window_size % 64:
        problems.append(f"window {cfg.window_size} (needs a multiple of 64)")
    if problems:
        raise ValueError("--kernels pallas does not support this model config: " + "; ".join(problems))


class Runner:
    def __init__(self, cfg, params, args, max_pages: int):
        self.cfg, self.params, self.args = cfg, params, args
        self.max_pages = max_pages  # page-table width = pages_for(max_model_len)
        self.layout = PageLayout.for_config(cfg)
        if args.kernels == "pallas":
            _check_pallas_config(cfg)
        self.ex = ExecContext(kv=PagedKV(self.layout, cfg.compute_dtype), kernels=args.kernels)
        self.S = args.max_num_seqs
        self.n_r2 = source_slots(cfg)[1].get("src_r2", 0)
        self.n_cols = ((cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads) if cfg.engram_layer_ids else 0
        self.n_eng = len(cfg.engram_layer_ids)
        self.pools = self._alloc_pools()
        self.programs: dict[ProgramKey, object] = {}
        self.compile_count = 0

    # ------------------------------------------------------------------ pools
    def _alloc_pools(self):
        cfg, a = self.cfg, self.args
        W, d = cfg.window_size, cfg.head_dim
        e = swa_entry_bytes(cfg)
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

    def pools_lost(self) -> bool:
        """True when a failed call consumed (donated) the pools: their contents are gone."""
        return any(v.is_deleted() for v in self.pools.values())

    def reset_pools(self):
        """Fresh zeroed pools (after a failure that lost them): every page and ring must be recomputed."""
        for v in self.pools.values():
            if not v.is_deleted():
                v.delete()
        self.pools = self._alloc_pools()

    # ------------------------------------------------------------------ program bodies
    def _step(self, params, pools, inp: StepInputs, *, key: ProgramKey):
        cfg = self.cfg
        slots = inp.slots
        state = {"pages": pools["pages"], "page_table": inp.page_table}
        if self.ex.pallas:  # the kernels read the packed rings in place and write only the new entries
            state.update(swa_pool=pools["swa"], slots=slots)
        else:
            state["swa"] = _swa_unpack(cfg, pools["swa"][:, slots])
        if self.n_r2:
            state["comp_kv"] = pools["comp_kv"][:, slots]
            state["comp_score"] = pools["comp_score"][:, slots]
        T = key.tokens
        n_dec = {DEC_NONE: 0, DEC_WINDOW: min(cfg.window_size, T), DEC_ALL: T}[key.decoder]
        n_logits = T if key.all_logits else 1
        logits, state, _ = step_impl(cfg, params, state, inp.chunk, fresh=False, n_dec=n_dec, n_logits=n_logits,
                                     ex=self.ex)
        if self.ex.pallas:
            out = dict(pools, pages=state["pages"], swa=state["swa_pool"])
        else:
            out = dict(pools, pages=state["pages"], swa=pools["swa"].at[:, slots].set(_swa_pack(cfg, state["swa"])))
        if self.n_r2:
            out["comp_kv"] = pools["comp_kv"].at[:, slots].set(state["comp_kv"])
            out["comp_score"] = pools["comp_score"].at[:, slots].set(state["comp_score"])
        if not key.sample:
            return out, None
        s = inp.sampling
        if n_logits == 1:
            last = logits[:, 0]
        else:  # prompt logprobs: every row's distribution, scored at the next prompt token
            last = jnp.take_along_axis(logits, (inp.chunk.n_valid - 1)[:, None, None], axis=1)[:, 0]
        tok, tok_lp, top_ids, top_lp = sample(last, s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.counter,
                                              MAX_LOGPROBS, allowed=s.allowed)
        res = StepOutputs(tok, tok_lp, top_ids, top_lp)
        if key.all_logits:
            lp = jax.nn.log_softmax(logits, axis=-1)
            res.prompt_next_logprob = jnp.take_along_axis(lp, s.next_ids[..., None], axis=-1)[..., 0]
            res.prompt_top_logprobs, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
            res.prompt_top_ids = ids.astype(jnp.int32)
        return out, pack_outputs(res, T, key.all_logits)

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

    # ------------------------------------------------------------------ programs
    def program_keys(self) -> list[ProgramKey]:
        """Every program the engine can call, derived from the buckets and the mode."""
        a = self.args
        keys = []
        for T in a.prefill_buckets:
            if a.swa_bounded_replay:
                keys += [ProgramKey(PREFILL, T, DEC_NONE, sample=False), ProgramKey(PREFILL, T, DEC_WINDOW)]
            else:
                keys += [ProgramKey(PREFILL, T, DEC_ALL, sample=False), ProgramKey(PREFILL, T, DEC_ALL)]
            if a.enable_prompt_logprobs:
                keys.append(ProgramKey(PREFILL, T, DEC_ALL, all_logits=True))
        keys += [ProgramKey(DECODE, B) for B in a.decode_buckets]
        if not a.swa_bounded_replay:
            keys += [ProgramKey(SNAP_SAVE, 1), ProgramKey(SNAP_LOAD, 1)]
        return keys

    def program_for_chunk(self, plan) -> ProgramKey:
        """The prefill program that runs a (non-decode) chunk plan."""
        T = self.bucket(PREFILL, plan.n)
        if plan.all_logits:  # one program per bucket: it always samples (used at the prompt's end)
            return ProgramKey(PREFILL, T, DEC_ALL, all_logits=True)
        return ProgramKey(PREFILL, T, plan.decoder, sample=plan.sample)

    def inputs(self, key: ProgramKey) -> StepInputs:
        """Zero-filled host inputs for `key` (the engine fills the rows it uses)."""
        return StepInputs.host(key.batch, key.tokens, self.max_pages, self.n_eng, self.n_cols, self.cfg.vocab_size,
                               key.all_logits, self.S)

    def _fn(self, key: ProgramKey):
        if key.kind in (SNAP_SAVE, SNAP_LOAD):
            return partial(self._snap, save=key.kind == SNAP_SAVE)
        return partial(self._step, key=key)

    def compile_all(self, progress: bool = True, keep=None):
        """Compile every program for its bucket (or prepare eager callables); returns seconds taken.
        `keep(key) -> bool` restricts the set (benchmarks that only decode)."""
        t0 = time.perf_counter()
        keys = [k for k in self.program_keys() if keep is None or keep(k)]
        for key in tqdm(keys, desc="compiling programs", disable=not progress):
            fn = self._fn(key)
            if self.args.execution == "eager":
                self.programs[key] = fn
                continue
            if key.kind in (SNAP_SAVE, SNAP_LOAD):
                i32 = jax.ShapeDtypeStruct((), np.int32)
                self.programs[key] = jax.jit(fn, donate_argnums=(0,)).lower(self.pools, i32, i32).compile()
            else:
                inp = StepInputs.abstract(key.batch, key.tokens, self.max_pages, self.n_eng, self.n_cols,
                                          self.cfg.vocab_size, key.all_logits)
                self.programs[key] = jax.jit(fn, donate_argnums=(1,)).lower(self.params, self.pools, inp).compile()
            self.compile_count += 1
        return time.perf_counter() - t0

    def run(self, key: ProgramKey, inp: StepInputs) -> PendingOutputs | None:
        """Dispatch a chunk/decode program; its outputs (if it samples) start copying to the host at once."""
        fn = self.programs[key]
        if self.args.execution == "eager":
            with jax.disable_jit():
                self.pools, packed = fn(self.params, self.pools, inp)
        else:
            self.pools, packed = fn(self.params, self.pools, inp)
        return None if packed is None else PendingOutputs(packed, key.tokens, key.all_logits)

    def snapshot(self, save: bool, src: int, dst: int):
        key = ProgramKey(SNAP_SAVE if save else SNAP_LOAD, 1)
        fn = self.programs[key]
        if self.args.execution == "eager":
            with jax.disable_jit():
                self.pools = fn(self.pools, np.int32(src), np.int32(dst))
        else:
            self.pools = fn(self.pools, np.int32(src), np.int32(dst))

    def bucket(self, kind: str, n: int) -> int:
        bs = self.args.prefill_buckets if kind == PREFILL else self.args.decode_buckets
        for b in bs:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest {kind} bucket {bs[-1]}")
