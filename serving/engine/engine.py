"""The step-level engine: add_request / step / abort over the scheduler, the page pool and the runner.

One thread drives `step()`; `add_request` and `abort` may be called between steps (the API servers call
them from the same thread through a queue). Bad input raises ValueError (or QueueFull) before anything
reaches the scheduler, so a bad request never disturbs the others.
"""

from __future__ import annotations

import os
import time

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from serving.engine.block_hash import BLOCK
from serving.engine.config import EngineArgs
from serving.engine.metrics import Metrics
from serving.engine.page_pool import PagePool
from serving.engine.runner import Runner
from serving.engine.scheduler import FINISHED, Request, Scheduler
from serving.engine.snapshots import SnapshotIndex
from serving.engine.types import RequestOutput, SamplingParams


class QueueFull(RuntimeError):
    """Too many queued requests (HTTP 503 / RESOURCE_EXHAUSTED)."""


def load_model(model, seed: int = 0, weight_format: str | None = None):
    """A preset name, a ModelConfig (random weights built on device), or a checkpoint directory (HF or orbax)."""
    import checkpoints

    if isinstance(model, ModelConfig):
        cfg = model
    elif isinstance(model, str) and not os.path.isdir(model):
        cfg = ModelConfig.preset(model)
    else:
        return checkpoints.load(model, weight_format=weight_format)
    return cfg, checkpoints.random_init(cfg, seed)


class Engine:
    def __init__(self, model="tiny", args: EngineArgs | None = None, *, params=None, tokenizer=None,
                 token_map=None, progress: bool = True, **engine_kw):
        args = args or EngineArgs(**engine_kw)
        if args.compilation_cache_dir:  # before anything compiles, the weight init included
            import jax

            jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        if params is None:
            cfg, params = load_model(model, args.seed)
        else:
            cfg = model if isinstance(model, ModelConfig) else ModelConfig.preset(model)
        self.cfg = cfg
        self.args = args.resolved(cfg)
        if tokenizer is None:
            from serving.tokenizer import ByteTokenizer

            tokenizer = ByteTokenizer(cfg.vocab_size) if cfg.vocab_size >= 256 else None
        self.tokenizer = tokenizer
        eos = set(self.args.eos_token_ids)
        if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = {tokenizer.eos_token_id}
        self.eos_ids = eos
        self.metrics = Metrics()
        self.pool = PagePool(self.args.num_pages, self.args.enable_prefix_caching, self.args.session_ttl_s)
        self.snapshots = None if self.args.swa_bounded_replay else SnapshotIndex(self.args.snapshot_slots)
        self.max_pages = -(-self.args.max_model_len // BLOCK)
        self.runner = Runner(cfg, params, self.args, self.max_pages)
        self.warmup_s = self.runner.compile_all(progress)
        self.metrics.set("compiled_programs", self.runner.compile_count)
        self.metrics.set("snapshot_bytes", sum(v for k, v in self.runner.pool_bytes().items() if k.startswith("snap")))
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None
        self.scheduler = Scheduler(self.args, self.pool, cfg.window_size, self.snapshots, self.metrics)
        self.requests: dict[str, Request] = {}
        self.last_step_ids: list[str] | None = None  # requests the current step scheduled (None: not known yet)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids, sampling_params: SamplingParams | None = None, *,
                    session_id: str | None = None, cache_salt: str | None = None, callback=None):
        sp = sampling_params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        V = self.cfg.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < V:
                raise ValueError(f"token id {t!r} is not in the vocabulary [0, {V})")
        sp.validate(V)
        if sp.prompt_logprobs is not None and not self.args.enable_prompt_logprobs:
            raise ValueError("prompt_logprobs is disabled on this server (EngineArgs.enable_prompt_logprobs)")
        limit = self.args.max_model_len
        if len(ids) + max(sp.max_tokens, 1) > limit:
            raise ValueError(f"this model's maximum context length is {limit} tokens; the request has "
                             f"{len(ids)} prompt tokens and max_tokens={sp.max_tokens}")
        if len(self.scheduler.waiting) >= self.args.max_queued_requests:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are already queued")
        req = Request(request_id, [int(t) for t in ids], len(ids), sp, session_id, cache_salt, callback=callback)
        self.requests[request_id] = req
        self.metrics.inc("prompt_tokens", len(ids))
        if sp.max_tokens == 0 and sp.prompt_logprobs is None:
            self._finish(req, "length", emit=True)
            return
        self.scheduler.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.status == FINISHED:
            return False
        self._finish(req, "abort", emit=True)
        self.metrics.inc("requests_aborted")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step. A failure while running a request's chunk fails only the requests of
        that program call (their final output carries `error`); the others continue."""
        self.last_step_ids = None
        sched = self.scheduler.schedule()
        self.last_step_ids = [s.req.request_id for s in sched]
        touched = []
        for s in sched:
            if s.req.restore_snapshot is not None:
                self.runner.run(("snap", 1, "load"), np.int32(s.req.restore_snapshot), np.int32(s.req.slot))
                s.req.restore_snapshot = None
        pre = [s for s in sched if s.req.in_prefill]
        dec = [s for s in sched if not s.req.in_prefill]
        for s in pre:
            self._guarded(self._run_prefill, s, [s.req])
            touched.append(s.req)
        if dec:
            self._guarded(self._run_decode, dec, [s.req for s in dec])
            touched += [s.req for s in dec]
        outs = []
        seen = set()
        for req in touched:
            if req.request_id in seen:
                continue
            seen.add(req.request_id)
            o = self._emit(req)
            if o is not None:
                outs.append(o)
        self.metrics.set("running", len(self.scheduler.running))
        self.metrics.set("waiting", len(self.scheduler.waiting))
        self.metrics.set("kv_usage", self.pool.usage())
        return outs

    def _guarded(self, fn, arg, reqs: list[Request]):
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001 - isolate the failure to these requests
            for r in reqs:
                if r.status != FINISHED:
                    r.error = f"{type(e).__name__}: {e}"
                    self._finish(r, "abort")

    def _hash_ids(self, req: Request, pos0: int, toks: np.ndarray):
        if self.hasher is None:
            return None
        h = self.hasher.n - 1
        hist = np.full((1, h), -1, np.int64)
        prev = req.tokens[max(pos0 - h, 0):pos0]
        if prev:
            hist[0, h - len(prev):] = self.hasher.compress(np.asarray(prev))
        return self.hasher.hash_ids(toks, hist)

    def _samp(self, reqs: list[Request], B: int) -> dict:
        f32, i32 = np.float32, np.int32
        samp = {"temperature": np.zeros(B, f32), "top_k": np.full(B, -1, i32), "top_p": np.ones(B, f32),
                "min_p": np.zeros(B, f32), "seed": np.zeros(B, np.uint32), "counter": np.zeros(B, i32)}
        for i, r in enumerate(reqs):
            sp = r.sampling
            samp["temperature"][i] = sp.temperature
            samp["top_k"][i] = sp.top_k
            samp["top_p"][i] = sp.top_p
            samp["min_p"][i] = sp.min_p
            seed = sp.seed if sp.seed is not None else (hash((self.args.seed, r.request_id)) & 0xFFFFFFFF)
            samp["seed"][i] = seed & 0xFFFFFFFF
            samp["counter"][i] = r.counter
        return samp

    def _table(self, req: Request) -> np.ndarray:
        t = np.zeros(self.max_pages, np.int32)
        t[:len(req.pages)] = req.pages
        return t

    def _run_prefill(self, s):
        req, n = s.req, s.n
        T = self.runner.bucket("prefill", n)
        plp = req.sampling.prompt_logprobs is not None
        if plp:
            mode = "plp"
        elif self.args.swa_bounded_replay:
            mode = "win" if s.final else "none"
        else:
            mode = "all+sample" if s.final else "all"
        pos0 = req.num_computed
        toks = np.zeros((1, T), np.int32)
        toks[0, :n] = req.tokens[pos0:pos0 + n]
        ids = self._hash_ids(req, pos0, toks)
        i1 = lambda v: np.asarray([v], np.int32)  # noqa: E731
        trim = self.args.swa_bounded_replay and s.final and not plp
        dec_clip = max(req.dec_clip, pos0 + n - self.cfg.window_size) if trim else req.dec_clip
        samp = self._samp([req], 1)
        if plp:
            nxt = req.tokens[pos0 + 1:pos0 + n + 1]
            samp["next_ids"] = np.zeros((1, T), np.int32)
            samp["next_ids"][0, :len(nxt)] = nxt
        res = self.runner.run(("prefill", T, mode), i1(req.slot), self._table(req)[None], toks, ids, i1(pos0), i1(n),
                              i1(req.enc_clip), i1(dec_clip), i1(req.write_from), samp)
        req.num_computed += n
        if trim:
            req.dec_clip = max(req.num_computed - self.cfg.window_size, 0)
        self._publish(req)
        if plp:
            self._prompt_logprobs(req, pos0, n, res)
        if s.final:
            if req.sampling.max_tokens == 0:
                self._finish(req, "length")
            else:
                self._append(req, res, 0)

    def _prompt_logprobs(self, req: Request, pos0: int, n: int, res):
        nxt, top_ids, top_lps = (np.asarray(x)[0] for x in res[4:])
        if not req.prompt_lps:
            req.prompt_lps.append(None)
        k = req.sampling.prompt_logprobs
        for i in range(n):
            p = pos0 + i + 1
            if p >= req.n_prompt or p < len(req.prompt_lps):
                continue
            d = {req.tokens[p]: float(nxt[i])}
            for j in range(k):
                d.setdefault(int(top_ids[i, j]), float(top_lps[i, j]))
            req.prompt_lps.append(d)

    def _run_decode(self, dec):
        reqs = [s.req for s in dec]
        B = self.runner.bucket("decode", len(reqs))
        S = self.args.max_num_seqs
        slots = np.full(B, S, np.int32)
        table = np.zeros((B, self.max_pages), np.int32)
        toks = np.zeros((B, 1), np.int32)
        pos0, n_valid = np.zeros(B, np.int32), np.zeros(B, np.int32)
        enc, dclip, wf = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        ids = None
        if self.hasher is not None:
            ids = np.zeros((B, 1, len(self.cfg.engram_layer_ids), self.runner.n_cols), np.int32)
        for i, r in enumerate(reqs):
            p = r.num_computed
            slots[i], table[i], toks[i, 0], pos0[i], n_valid[i] = r.slot, self._table(r), r.tokens[p], p, 1
            enc[i], dclip[i], wf[i] = r.enc_clip, r.dec_clip, r.write_from
            if ids is not None:
                ids[i] = self._hash_ids(r, p, toks[i:i + 1])[0]
        res = self.runner.run(("decode", B, "one"), slots, table, toks, ids, pos0, n_valid, enc, dclip, wf,
                              self._samp(reqs, B))
        res = [np.asarray(x) for x in res]
        for i, r in enumerate(reqs):
            r.num_computed += 1
            self._publish(r)
            self._append(r, res, i)

    def _publish(self, req: Request):
        """Register newly completed pages in the prefix cache; save exact-mode snapshots at boundaries."""
        full = min(req.num_computed // BLOCK, len(req.hashes), len(req.pages))
        for j in range(req.registered, full):
            self.pool.register(req.pages[j], req.hashes[j])
        req.registered = max(req.registered, full)
        if self.snapshots is not None and req.num_computed in req.boundaries:
            k = req.num_computed // BLOCK
            slot = self.snapshots.claim(req.hashes[k - 1])
            if slot is not None:
                self.runner.run(("snap", 1, "save"), np.int32(req.slot), np.int32(slot))

    def _append(self, req: Request, res, i: int):
        tok, tok_lp, top_ids, top_lps = (np.asarray(x) for x in res[:4])
        t = int(tok[i])
        now = time.perf_counter()
        req.tokens.append(t)
        req.out_ids.append(t)
        req.counter += 1
        req.refresh_hashes()
        if req.sampling.logprobs is not None:
            d = {t: float(tok_lp[i])}
            for j in range(req.sampling.logprobs):
                d.setdefault(int(top_ids[i, j]), float(top_lps[i, j]))
            req.out_logprobs.append(d)
        if req.first_token_t is None:
            req.first_token_t = now
            self.metrics.observe("ttft", now - req.arrival)
        else:
            self.metrics.observe("itl", now - req.last_token_t)
        req.last_token_t = now
        self.metrics.inc("generation_tokens")
        sp = req.sampling
        if t in sp.stop_token_ids or (t in self.eos_ids and not sp.ignore_eos):
            self._finish(req, "stop")
        elif self._stop_string(req):
            self._finish(req, "stop")
        elif len(req.out_ids) >= sp.max_tokens or len(req.tokens) >= self.args.max_model_len:
            self._finish(req, "length")

    def _stop_string(self, req: Request) -> bool:
        if self.tokenizer is None:
            return False
        special = set(req.sampling.stop_token_ids) | (self.eos_ids if not req.sampling.ignore_eos else set())
        req.text = self.tokenizer.decode([t for t in req.out_ids if t not in special])
        for s in req.sampling.stop:
            k = req.text.find(s, max(0, req.sent_text - len(s)))
            if k >= 0:
                req.text = req.text[:k + (len(s) if req.sampling.include_stop_str_in_output else 0)]
                return True
        return False

    def _finish(self, req: Request, reason: str, emit: bool = False):
        """Release the request's pages and slot now; its final output is emitted by the step (or here)."""
        if req.status != FINISHED:
            self.scheduler.finish(req, reason)
        req.finish_reason = reason
        if reason != "abort":
            self.metrics.inc("requests_finished")
            if req.first_token_t is not None:
                self.metrics.observe("e2e", time.perf_counter() - req.arrival)
        if emit:
            self._emit(req)

    def _emit(self, req: Request) -> RequestOutput | None:
        new_ids = req.out_ids[req.sent_ids:]
        finished = req.status == FINISHED
        if not new_ids and not finished:
            return None
        if req.finish_reason != "stop" or not req.sampling.stop:
            if self.tokenizer is not None:
                special = set(req.sampling.stop_token_ids) | (self.eos_ids if not req.sampling.ignore_eos else set())
                req.text = self.tokenizer.decode([t for t in req.out_ids if t not in special])
        text = req.text
        if not finished and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
            text = text.rstrip("\ufffd")
        new_text = text[req.sent_text:] if len(text) >= req.sent_text else ""
        lps = req.out_logprobs[req.sent_ids:] if req.sampling.logprobs is not None else None
        req.sent_ids = len(req.out_ids)
        req.sent_text = max(req.sent_text, len(text))
        out = RequestOutput(req.request_id, new_ids, new_text, lps, finished, req.finish_reason if finished else None,
                            req.n_prompt, req.num_cached, len(req.out_ids),
                            prompt_logprobs=req.prompt_lps if finished and req.sampling.prompt_logprobs is not None
                            else None, error=req.error)
        if finished:
            self.requests.pop(req.request_id, None)
        if req.callback is not None:
            req.callback(out)
        return out

    # ------------------------------------------------------------------ conveniences
    def run_until_done(self, max_steps: int = 100000) -> list[RequestOutput]:
        outs = []
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            outs += self.step()
        return outs

    def model_info(self) -> dict:
        return {"model": self.cfg.name, "vocab_size": self.cfg.vocab_size, "max_model_len": self.args.max_model_len,
                "eos_token_ids": sorted(self.eos_ids), "window": self.cfg.window_size,
                "swa_bounded_replay": self.args.swa_bounded_replay, "warmup_s": round(self.warmup_s, 2),
                "compiled_programs": self.runner.compile_count}
