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
  verify[B]   speculative decoding (--speculative-config, k drafts): B requests x (1 + k) rows (the last sampled
              token and the drafts; a request with fewer drafts has fewer valid rows), the decoder band on every
              row, logits on every row, the verification on device (spec_verify.py) and the rollback below
  snap_save / snap_load  copy a request's SWA rings + compressor state to / from a snapshot slot (exact mode)
Every chunk/decode program takes (params, pools, StepInputs) and returns (pools, packed outputs): see step_io.

Rollback in verify[B] (the state after the call equals plain decoding's after the accepted tokens):
- SWA rings: the ring entries the 1 + k rows overwrite (slots (pos0 + i) % W, all layers) are read before the
  step; after the verification the slots of the rejected rows get their old bytes back (a rejected row at
  position p destroyed position p - W, which the next steps still read when fewer than k - 1 drafts pass);
- compressor carry: the step records each ratio-2 source's chunk rows, and the carry is recomputed at the end of
  the accepted rows (attention.carry_at), not at the end of the chunk;
- global KV (FP4 latents, index keys): rejected rows' entries stay in the request's own pages but are never read:
  a query at position t sees only entries of complete groups before t, and the step that later covers such a
  position rewrites its entries (from the accepted token, with the restored carry) before any query reads them;
  pages are published to the prefix cache only below the accepted positions (Scheduler.accepted).
Requires 1 + k <= W (EngineArgs.resolved checks it). With the DSpark draft (method dspark) every program with
decoder rows also writes the draft's context rings and every sampling program drafts the next k tokens
(serving/engine/spec_draft.py): only accepted rows enter the rings.

Invariant: after a program call the runner holds valid pools, or `pools_lost()` is true (the call failed after
the pools were donated); the engine then calls `reset_pools()` and recomputes what was lost.

Parallel layouts (`args.parallel`, a dsv41_jax.sharding.Parallel; docs/PARALLELISM.md):
- TP: the parameters are split per the layout's rules; pools, inputs and outputs are replicated (the single
  latent KV is shared by all heads, so every rank holds the same pages and rings).
- DP / DEP over N ranks: every pool gets N blocks along its page / slot axis, rank r's block on device r
  (`pages` [N*P, ...], `swa` [L, N*(S+1), ...], ...), and a program's inputs hold N blocks of the bucket's rows
  (rank r's rows r*B .. r*B+B-1, with rank-local slots and page ids). The program body runs once per rank
  inside `ops.data_parallel` on its own block; a rank without work gets padding rows (scratch slot, null
  pages, n_valid 0) and still joins the expert all-to-all. Packed outputs come back replicated ([N*B, w]).
  Under DEP `moe_dropped` [N] counts the rows each rank's capacity dropped.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from dsv41_jax import ops
from dsv41_jax.attention import carry_at
from dsv41_jax.engram_rows import drop_tables, row_format
from dsv41_jax.kv_cache import CompressorCarry, KVState, PagedGlobal, PagedKV, PageLayout
from dsv41_jax.kv_format import swa_entry_bytes
from dsv41_jax.model import step_impl
from dsv41_jax.ops import ExecContext, pallas_config_problems
from dsv41_jax.params import source_slots
from dsv41_jax.sharding import DATA, param_partition_specs
from serving.engine import multihost
from serving.engine.chunk_plan import DEC_ALL, DEC_NONE, DEC_WINDOW, decoder_rows
from serving.engine.multihost import OP_RESET, OP_RUN, OP_SNAP, OP_STOP
from serving.engine.program_cache import ProgramCache, compile_fresh
from serving.engine.sampler import sample
from serving.engine.spec_draft import POOL_AXIS, DeviceDraft
from serving.engine.spec_verify import verify
from serving.engine.step_io import (
    DECODE,
    PREFILL,
    SNAP_LOAD,
    SNAP_SAVE,
    VERIFY,
    PendingOutputs,
    ProgramKey,
    StepInputs,
    StepOutputs,
    pack_outputs,
)
from serving.engine.types import MAX_LOGPROBS

log = logging.getLogger(__name__)


def _check_pallas_config(cfg):
    problems = pallas_config_problems(cfg)
    if problems:
        raise ValueError("--kernels pallas does not support this model config: " + "; ".join(problems))


def _pool_axis(name: str) -> int:
    """The axis of a pool that holds the data-parallel ranks' blocks (pages / slots / snapshot slots)."""
    return 0 if name in ("pages", "moe_dropped") else POOL_AXIS.get(name, 1)


def restore_ring_slots(pool, slots, ring, saved, rejected, W: int):
    """Verify rollback of the SWA rings: the slots `ring` [B, T] of the rejected rows get back the bytes `saved`
    [L, B, T, e] they held before the step (pool [L, R, W, e], rows `slots` [B])."""
    return pool.at[:, slots[:, None], jnp.where(rejected, ring, W)].set(saved, mode="drop")


def accepted_carry(comp: CompressorCarry, pos0, end):
    """Verify rollback of the ratio-2 compressors: the carry after the accepted rows (positions < end), from the
    chunk rows the step recorded; ([n_r2, B, 2, d] kv, score)."""
    return jax.vmap(lambda ek, es: carry_at(ek, es, pos0, end, 2))(comp.rows_kv, comp.rows_score)


class Runner:
    def __init__(self, cfg, params, args, max_pages: int, mesh=None, *, abstract: bool = False):
        """`abstract`: nothing is allocated or placed; params and pools are ShapeDtypeStructs on `mesh` (which may
        be an AbstractMesh), for `lower` only (`Runner.for_lowering`)."""
        self.cfg, self.args = cfg, args
        self.max_pages = max_pages  # page-table width = pages_for(max_model_len)
        self.layout = PageLayout.for_config(cfg)
        if args.kernels == "pallas":
            _check_pallas_config(cfg)
        self.par = getattr(args, "parallel", None)
        if (self.par is None) != (mesh is None):
            raise ValueError("Runner: a parallel layout needs its mesh (and a mesh its layout)")
        self.mesh = mesh
        self.dp = self.par is not None and self.par.mode == "dp"
        self.n_ranks = self.par.size if self.dp else 1  # data-parallel ranks (blocks of every pool)
        self.ex = ExecContext(kv=PagedKV(self.layout, cfg.compute_dtype), kernels=args.kernels, mesh=mesh,
                              parallel=self.par, xla_ops=tuple(getattr(args, "xla_ops", ()) or ()))
        self.swa_layout = ops.swa_layout(self.ex)  # how a program holds the rings (kv_cache.SwaRings / SwaPool)
        # host Engram tables (serving/engine/engram_host.py): no table among the parameters; programs take rows
        host_eng = getattr(args, "engram", None) is not None and args.engram.cpu_offload
        self.engram_row_bytes = row_format(cfg).row_bytes if host_eng else 0
        spec = getattr(args, "speculative", None)
        self.draft = None  # DSpark: the draft's pools and program part (serving.engine.spec_draft)
        if spec is not None and spec.method == "dspark":
            self.draft = DeviceDraft(cfg, spec.num_speculative_tokens, spec.draft_sample_method == "probabilistic",
                                     self.ex)
        if mesh is not None:
            self.param_specs = param_partition_specs(cfg, self.par, mesh)
            if host_eng:
                self.param_specs = drop_tables(self.param_specs)
            if not abstract:
                from checkpoints.sharding import place

                params = place(cfg, params, mesh, self.par)
        if self.ex.pallas and "lm_head" not in self.ex.xla_ops and not self.ex.tp:
            from checkpoints.kernel_layout import head_as_stored

            params, _ = head_as_stored(params)  # the Pallas head reads the checkpoint's bf16 (ops.lm_head)
        self.params = params
        self.S = args.max_num_seqs
        self.n_r2 = source_slots(cfg)[1].get("src_r2", 0)
        self.n_cols = ((cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads) if cfg.engram_layer_ids else 0
        self.n_eng = len(cfg.engram_layer_ids)
        self.pools = self._abstract_pools() if abstract else self._alloc_pools()
        self.programs: dict[ProgramKey, object] = {}
        self.compile_count = 0
        self.program_cache_hits = 0  # programs loaded by compile_all from the program cache (no tracing)
        self.program_cache_not_stored = 0  # compiled programs JAX's own cache served (not stored: program_cache.py)
        self.abstract = abstract
        self.channel = None  # multi-host: the driver -> followers command stream (serving.engine.multihost)

    # ------------------------------------------------------------------ pools
    def _pool_shapes(self) -> dict:
        """name -> (shape, dtype, fill) of every pool (N rank blocks along `_pool_axis` under DP)."""
        cfg, a, N = self.cfg, self.args, self.n_ranks
        W, d = cfg.window_size, cfg.head_dim
        e = swa_entry_bytes(cfg)
        f32, u8 = jnp.float32, jnp.uint8
        shapes = {"pages": ((N * a.num_pages, self.layout.page_bytes), u8, 0),
                  "swa": ((cfg.n_layers, N * (self.S + 1), W, e), u8, 0)}
        if self.n_r2:
            shapes["comp_kv"] = ((self.n_r2, N * (self.S + 1), 2, d), f32, 0)
            shapes["comp_score"] = ((self.n_r2, N * (self.S + 1), 2, d), f32, -jnp.inf)
        if not a.swa_bounded_replay:
            n = a.snapshot_slots + (1 if self.dp else 0)  # DP: a scratch snapshot slot for idle ranks
            shapes["snap_swa"] = ((cfg.n_layers, N * n, W, e), u8, 0)
            if self.n_r2:
                shapes["snap_comp_kv"] = ((self.n_r2, N * n, 2, d), f32, 0)
                shapes["snap_comp_score"] = ((self.n_r2, N * n, 2, d), f32, -jnp.inf)
        if self.par is not None and self.par.ep:
            shapes["moe_dropped"] = ((N,), jnp.int32, 0)
        if self.draft is not None:
            shapes.update(self.draft.pool_shapes(N * (self.S + 1)))
        return shapes

    def pool_specs(self) -> dict:
        """PartitionSpec of each pool: rank blocks split over "data" (DP), replicated (TP)."""
        return {k: P(*[None] * _pool_axis(k), DATA) if self.dp else P() for k in self._pool_shapes()}

    def _alloc_pools(self):
        out = {}
        specs = self.pool_specs() if self.mesh is not None else {}
        for k, (shape, dt, fill) in self._pool_shapes().items():
            if self.mesh is None:
                out[k] = jnp.full(shape, fill, dt)
            else:  # built on the devices, each with its block only
                out[k] = jax.jit(partial(jnp.full, shape, fill, dt),
                                 out_shardings=NamedSharding(self.mesh, specs[k]))()
        return out

    def _abstract_pools(self):
        specs = self.pool_specs() if self.mesh is not None else {}
        return {k: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(self.mesh, specs[k]) if specs else None)
                for k, (shape, dt, _) in self._pool_shapes().items()}

    @classmethod
    def for_lowering(cls, cfg, args, max_pages: int, mesh):
        """A runner over abstract parameters and pools on `mesh` (a Mesh or AbstractMesh, with args.parallel set):
        `lower(key)` then gives each program's StableHLO without any device memory (ahead-of-time checks for
        device counts this host does not have)."""
        from dsv41_jax.params import abstract_params

        host_eng = getattr(args, "engram", None) is not None and args.engram.cpu_offload
        abs_p = drop_tables(abstract_params(cfg)) if host_eng else abstract_params(cfg)
        if mesh is not None:
            specs = param_partition_specs(cfg, args.parallel, mesh)
            specs = drop_tables(specs) if host_eng else specs
            abs_p = jax.tree.map(lambda a, sp: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                    sharding=NamedSharding(mesh, sp)), abs_p, specs)
        return cls(cfg, abs_p, args, max_pages, mesh, abstract=True)

    def lower(self, key: ProgramKey, platforms: tuple[str, ...] | None = None):
        """The jax `Lowered` of one program (for `platforms`, e.g. ("cuda",); default: this host's backend)."""
        fn, donated, *args = self._program_args(key)
        traced = jax.jit(fn, donate_argnums=(donated,)).trace(*args)
        return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

    def moe_dropped(self) -> int:
        """DEP: routed rows the capacity dropped so far, over this process's ranks. Never waits for the device:
        while a step is in flight it returns the last value read."""
        v = self.pools.get("moe_dropped")
        if v is not None and not v.is_deleted() and v.is_ready():
            self._dropped_seen = int(sum(np.asarray(s.data).sum() for s in v.addressable_shards))
        return getattr(self, "_dropped_seen", 0)

    def pool_bytes(self) -> dict:
        return {k: int(v.size * v.dtype.itemsize) for k, v in self.pools.items()}

    def pools_lost(self) -> bool:
        """True when a failed call consumed (donated) the pools: their contents are gone."""
        return any(v.is_deleted() for v in self.pools.values())

    def reset_pools(self):
        """Fresh zeroed pools (after a failure that lost them): every page and ring must be recomputed."""
        self._announce(OP_RESET)
        for v in self.pools.values():
            if not v.is_deleted():
                v.delete()
        self.pools = self._alloc_pools()

    # ------------------------------------------------------------------ program bodies
    def _dp_region(self, fn, *, inputs: bool, outputs: bool):
        """fn(params?, pools, *args) run per data-parallel rank on its blocks; packed outputs gathered."""
        pspec = self.pool_specs()
        rank = P(DATA)

        def body(*args):
            out = fn(*args)
            if not outputs:
                return out
            pools, packed = out
            return pools, (None if packed is None else ops.gather_rows(packed))

        def specs(args):
            lead = (self.param_specs, pspec) if inputs else (pspec,)
            return (*lead, *[jax.tree.map(lambda _: rank, a) for a in args[len(lead):]])

        def run(*args):
            out_specs = (pspec, P()) if outputs else pspec
            return ops.data_parallel(self.ex, body, specs(args), out_specs)(*args)

        return run

    def _step(self, params, pools, inp: StepInputs, *, key: ProgramKey):
        if self.dp:
            return self._dp_region(partial(self._step_local, key=key), inputs=True, outputs=True)(params, pools, inp)
        out, packed = self._step_local(params, pools, inp, key=key)
        if self.mesh is not None:  # TP: pools stay replicated across calls (donation aliases them)
            out = {k: jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, P())) for k, v in out.items()}
        return out, packed

    def _step_local(self, params, pools, inp: StepInputs, *, key: ProgramKey):
        """One rank's program (the whole program without DP): rank-local pools, slots and page ids."""
        cfg = self.cfg
        slots = inp.slots
        T = key.tokens
        comp = (CompressorCarry(pools["comp_kv"][:, slots], pools["comp_score"][:, slots]) if self.n_r2 else None)
        if key.verify:
            if comp is not None:  # record the chunk's compressor rows (the carry after the accepted rows)
                rows = jnp.zeros((self.n_r2, slots.shape[0], T + 1, cfg.head_dim), jnp.float32)
                comp = CompressorCarry(comp.kv, comp.score, rows, rows)
            ring = jnp.mod(inp.chunk.pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None], cfg.window_size)
            saved = pools["swa"][:, slots[:, None], ring]  # [L, B, T, e]: what the rows overwrite
        state = KVState(self.swa_layout.load(cfg, pools["swa"], slots), PagedGlobal(pools["pages"], inp.page_table),
                        comp)
        n_dec = decoder_rows(key.decoder, T, cfg.window_size)
        n_logits = T if key.all_logits or key.verify else 1
        draft = self.draft is not None and n_dec > 0  # the draft reads the decoder rows' features
        res = step_impl(cfg, params, state, inp.chunk, fresh=False, n_dec=n_dec, n_logits=n_logits, ex=self.ex,
                        **({"features": True} if draft else {}))
        logits, state, aux, feats = res[0], res[1], res[3], res[4] if draft else None
        out = dict(pools, pages=state.glob.pages, swa=state.swa.store(cfg, pools["swa"], slots))
        if self.n_r2:
            out["comp_kv"] = pools["comp_kv"].at[:, slots].set(state.comp.kv)
            out["comp_score"] = pools["comp_score"].at[:, slots].set(state.comp.score)
        if "moe_dropped" in pools:
            out["moe_dropped"] = pools["moe_dropped"] + aux.moe_dropped
        if not key.sample:
            if draft:
                out, _ = self.draft.step(params, pools, out, slots, feats, feats.valid)
            return out, None
        if key.verify:
            return self._verify(params, pools, out, state, logits, feats, inp, ring, saved, T)
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
        if draft:  # the draft continues after the sampled token, at the position after the chunk
            c = inp.chunk
            out, res.drafts = self.draft.step(params, pools, out, slots, feats, feats.valid, tok, c.pos0 + c.n_valid,
                                              s, s.counter + 1)
        return out, pack_outputs(res, T, key.all_logits, drafts=self.draft_tokens(key))

    def draft_tokens(self, key: ProgramKey) -> int:
        """Draft tokens a program returns per row (the DSpark draft's, in sampling programs with decoder rows)."""
        has_dec = key.kind != PREFILL or key.decoder != DEC_NONE or key.all_logits
        return self.draft.k if self.draft is not None and key.sample and has_dec else 0

    def _verify(self, params, pools, out, state, logits, feats, inp: StepInputs, ring, saved, T: int):
        """verify[B]'s tail: accept / resample (spec_verify.verify), then roll back what the rejected rows wrote;
        with the DSpark draft, its context from the accepted rows and the next drafts."""
        cfg, s, c, slots = self.cfg, inp.sampling, inp.chunk, inp.slots
        n_draft = jnp.maximum(c.n_valid - 1, 0)
        q = None if self.draft is None else self.draft.probs(pools, slots)
        toks, n_acc, tok_lp, top_ids, top_lp = verify(logits, c.tokens[:, 1:], n_draft, s.temperature, s.top_k,
                                                      s.top_p, s.min_p, s.seed, s.counter, s.allowed,
                                                      None if q is None else q[:, :T - 1])
        rows = jnp.arange(T)[None]
        rejected = (rows > n_acc[:, None]) & (rows < c.n_valid[:, None])
        out["swa"] = restore_ring_slots(out["swa"], slots, ring, saved, rejected, cfg.window_size)
        if self.n_r2:
            kv, sc = accepted_carry(state.comp, c.pos0, c.pos0 + n_acc + 1)
            out["comp_kv"] = out["comp_kv"].at[:, slots].set(kv)
            out["comp_score"] = out["comp_score"].at[:, slots].set(sc)
        res = StepOutputs(toks, tok_lp, top_ids, top_lp, n_accepted=n_acc)
        if feats is not None:  # rows 0..a are final: their features enter the rings; the last token anchors
            last = jnp.take_along_axis(toks, n_acc[:, None], axis=1)[:, 0]
            acc = feats.valid & (rows <= n_acc[:, None])
            out, res.drafts = self.draft.step(params, pools, out, slots, feats, acc, last, c.pos0 + n_acc + 1, s,
                                              s.counter + n_acc + 1)
        return out, pack_outputs(res, T, False, verify=True, drafts=self.draft_tokens(ProgramKey(VERIFY, 1)))

    def _snap(self, pools, src, dst, *, save: bool):
        if self.dp:  # src / dst: one slot per rank [N]
            return self._dp_region(partial(self._snap_local, save=save), inputs=False, outputs=False)(pools, src, dst)
        return self._snap_local(pools, src, dst, save=save)

    def _snap_local(self, pools, src, dst, *, save: bool):
        if self.dp:
            src, dst = src[0], dst[0]
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
        if a.speculative is not None:
            keys += [ProgramKey(VERIFY, B, DEC_ALL, spec=a.speculative.num_speculative_tokens)
                     for B in a.decode_buckets]
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
        """Zero-filled host inputs for `key` (the engine fills the rows it uses): n_ranks blocks of the bucket's
        rows, rank r's row i at r * key.batch + i."""
        return StepInputs.host(self.n_ranks * key.batch, key.tokens, self.max_pages, self.n_eng, self.n_cols,
                               self.cfg.vocab_size, key.all_logits, self.S, self.engram_row_bytes)

    def _abstract_inputs(self, key: ProgramKey):
        inp = StepInputs.abstract(self.n_ranks * key.batch, key.tokens, self.max_pages, self.n_eng, self.n_cols,
                                  self.cfg.vocab_size, key.all_logits, self.engram_row_bytes)
        if self.mesh is None:
            return inp
        spec = P(DATA) if self.dp else P()
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=NamedSharding(self.mesh, spec)), inp)

    def _fn(self, key: ProgramKey):
        if key.kind in (SNAP_SAVE, SNAP_LOAD):
            return partial(self._snap, save=key.kind == SNAP_SAVE)
        return partial(self._step, key=key)

    def compile_all(self, progress: bool = True, keep=None):
        """Compile every program for its bucket (or prepare eager callables); returns seconds taken.
        `keep(key) -> bool` restricts the set (benchmarks that only decode).

        With `args.program_cache` (and a compilation cache directory) a program compiled by an earlier start of the
        same code, model, flags and devices is loaded from disk without tracing (serving/engine/program_cache.py),
        `compile_threads` loads at once.
        The others are traced and lowered one after another on this thread (tracing is Python, and the model's
        trace-time state is not shared across threads), and each lowered module is compiled on a pool of
        `compile_threads` threads while the next one is traced: XLA's compilation (and a persistent-cache read)
        runs outside the GIL. The programs are the same whatever the thread count."""
        t0 = time.perf_counter()
        keys = [k for k in self.program_keys() if keep is None or keep(k)]
        multi = self.mesh is not None and multihost.spans_processes(self.mesh)
        if self.args.execution == "eager":
            self.programs.update({key: self._fn(key) for key in keys})
        else:
            self._compile(keys, progress, multi)
        if multi:
            self.channel = multihost.Channel(list(self.programs))
        return time.perf_counter() - t0

    def _compile(self, keys, progress: bool, multi: bool):
        cache = None
        if self.args.program_cache and self.args.compilation_cache_dir and not multi and not self.abstract:
            cache = ProgramCache(self.args.compilation_cache_dir, self.cfg, self.args, self.mesh, self.params,
                                 self.pools)
        with ThreadPoolExecutor(self.args.compile_threads) as pool, \
                tqdm(total=len(keys), desc="compiling programs", disable=not progress) as bar:
            pending, loads = {}, {}
            try:
                digests = {key: cache.digest(key, self._program_args(key)[2:]) if cache else None for key in keys}
                if cache:
                    loads = {key: pool.submit(cache.load, digests[key]) for key in keys}
                for key in keys:  # the stored programs load side by side (at most compile_threads at once)
                    loaded = loads[key].result() if cache else None
                    if loaded is not None:
                        self.programs[key] = loaded
                        self.compile_count += 1
                        bar.update()
                for key in keys:
                    if key not in self.programs:
                        pending[pool.submit(compile_fresh, self.lower(key))] = (key, digests[key])
                for done in as_completed(pending):
                    key, digest = pending[done]
                    self.programs[key], fresh = done.result()
                    self.compile_count += 1
                    if cache:
                        cache.store(digest, self.programs[key], fresh)
                    bar.update()
            except BaseException:
                for f in [*pending, *loads.values()]:
                    f.cancel()
                raise
        self.program_cache_hits = cache.hits if cache else 0
        self.program_cache_not_stored = cache.not_stored if cache else 0
        if cache and cache.not_stored:
            log.info("%d programs came from JAX's compilation cache and are not in the program cache: they are "
                     "traced at every start until one start compiles them (another --compilation-cache-dir)",
                     cache.not_stored)

    def _program_args(self, key: ProgramKey) -> tuple:
        """(function, donated argument index, *arguments) of one program, as `lower` traces it."""
        fn = self._fn(key)
        if key.kind in (SNAP_SAVE, SNAP_LOAD):
            i32 = self._slot_arg()
            return fn, 0, self.pools, i32, i32
        return fn, 1, self.params, self.pools, self._abstract_inputs(key)

    # ------------------------------------------------------------------ multi-host
    def _announce(self, op: int, key=None, *args: int, inputs=None):
        if self.channel is not None and self.channel.driver:
            self.channel.send(op, key, *args, inputs=inputs)

    def stop_followers(self):
        """Multi-host driver: release the followers' `follow` loops (no-op elsewhere)."""
        self._announce(OP_STOP)

    def follow(self):
        """Multi-host follower: replay the driver's program calls until it stops."""
        if self.channel is None or self.channel.driver:
            raise RuntimeError("Runner.follow runs on a multi-host follower process only")
        while True:
            op, key, args = self.channel.receive_header()
            if op == OP_RUN:
                self._call(key, self.channel.receive_inputs(self.inputs(key)))
            elif op == OP_SNAP:
                self._snapshot(key, *args[:3])
            elif op == OP_RESET:
                self.reset_pools()
            elif op == OP_STOP:
                return
            else:
                raise RuntimeError(f"unknown multi-host command {op}")

    def run(self, key: ProgramKey, inp: StepInputs) -> PendingOutputs | None:
        """Dispatch a chunk/decode program; its outputs (if it samples) start copying to the host at once."""
        self._announce(OP_RUN, key, inputs=inp)
        return self._call(key, inp)

    def _call(self, key: ProgramKey, inp: StepInputs) -> PendingOutputs | None:
        fn = self.programs[key]
        if self.args.execution == "eager":
            with jax.disable_jit():
                self.pools, packed = fn(self.params, self.pools, inp)
        else:
            self.pools, packed = fn(self.params, self.pools, inp)
        return None if packed is None else PendingOutputs(packed, key.tokens, key.all_logits, key.verify,
                                                          self.draft_tokens(key))

    def _slot_arg(self):
        if not self.dp:
            return jax.ShapeDtypeStruct((), np.int32)
        return jax.ShapeDtypeStruct((self.n_ranks,), np.int32, sharding=NamedSharding(self.mesh, P(DATA)))

    def snapshot(self, save: bool, src: int, dst: int, rank: int = 0):
        """Copy one request's rings + compressor state to (save) / from a snapshot slot, on its rank."""
        key = ProgramKey(SNAP_SAVE if save else SNAP_LOAD, 1)
        self._announce(OP_SNAP, key, src, dst, rank)
        self._snapshot(key, src, dst, rank)

    def _snapshot(self, key: ProgramKey, src: int, dst: int, rank: int):
        save = key.kind == SNAP_SAVE
        fn = self.programs[key]
        if self.dp:  # the other ranks copy between scratch slots
            idle_src, idle_dst = (self.S, self.args.snapshot_slots) if save else (0, self.S)
            s_all, d_all = np.full(self.n_ranks, idle_src, np.int32), np.full(self.n_ranks, idle_dst, np.int32)
            s_all[rank], d_all[rank] = src, dst
            src, dst = s_all, d_all
        else:
            src, dst = np.int32(src), np.int32(dst)
        if self.args.execution == "eager":
            with jax.disable_jit():
                self.pools = fn(self.pools, src, dst)
        else:
            self.pools = fn(self.pools, src, dst)

    def put_engram_rows(self, bufs: list[np.ndarray], alias: bool = False) -> list:
        """Host Engram rows (one [rows, T, n_cols, row_bytes] per layer) onto the devices as the programs take
        them, in one device_put call. `alias` False: copied during the call (the host buffers may be reused at
        once); True: the transfer reads them after the call returns, so they must stay unchanged until the arrays
        are ready (serving/engine/engram_staging.py: buffers registered with the client are not staged at all)."""
        if self.mesh is None:
            sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            sh = NamedSharding(self.mesh, P(DATA) if self.dp else P())
        if jax.default_backend() == "cpu":  # the CPU client may alias a numpy buffer (even with may_alias=False)
            bufs, alias = [b.copy() for b in bufs], False
        return list(jax.device_put(list(bufs), sh, may_alias=alias))

    # ------------------------------------------------------------------ host tier (serving.engine.host_tier)
    @staticmethod
    def _pad_rows(rows: np.ndarray, *data):
        """Pad to a power of two by repeating the last row (a few compiled shapes; a repeated row is harmless)."""
        n = len(rows)
        b = 1 << max(n - 1, 0).bit_length()
        idx = np.concatenate([np.arange(n), np.full(b - n, n - 1)])
        return (rows[idx], *[d[idx] for d in data])

    def read_pages(self, rows: np.ndarray):
        """A new device array holding rows `rows` of the pages pool (padded; dispatched, not waited for). Taken
        before the next program donates the pool, it keeps those bytes whatever that program writes."""
        if not hasattr(self, "_page_read"):
            self._page_read = jax.jit(lambda pages, r: pages[r])
        (rows,) = self._pad_rows(np.asarray(rows, np.int32))
        return self._page_read(self.pools["pages"], rows)

    def write_pages(self, rows: np.ndarray, data: np.ndarray):
        """Write host bytes `data[i]` into row `rows[i]` of the pages pool (one donated scatter)."""
        if not hasattr(self, "_page_write"):
            self._page_write = jax.jit(lambda pages, r, d: pages.at[r].set(d), donate_argnums=(0,))
        rows, data = self._pad_rows(np.asarray(rows, np.int32), np.asarray(data, np.uint8))
        self.pools = dict(self.pools, pages=self._page_write(self.pools["pages"], rows, data))

    def bucket(self, kind: str, n: int) -> int:
        bs = self.args.prefill_buckets if kind == PREFILL else self.args.decode_buckets  # decode and verify
        for b in bs:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest {kind} bucket {bs[-1]}")
