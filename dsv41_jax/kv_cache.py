"""The model's KV state: typed pytrees, one per storage strategy, and the strategies that read and write them.

`KVState` is what `model.step` threads through a chunk: the SWA rings (`swa`), the compressed global KV
(`glob`) and the ratio-2 compressors' partial groups (`comp`). Each part has its strategies:

SWA rings (the pytree's class is the strategy; both have the same methods):
  SwaRings  rings [L, B, W, d] in the compute dtype, one per sequence (the reference's layout; `paths`, the
            XLA engine after unpacking its pool rows)
  SwaPool   the engine's packed pool [L, R, W, e] (kv_format.swa_pack bytes) read and written in place at the
            rows `slots` [B] (the Pallas kernels)
  ring(cfg, l) -> [B, W, d]   layer l's rings before this chunk (ring slot s holds the latest p with p % W == s)
  write(cfg, l, kv, pos0, n_valid) -> the same class, the chunk's first n_valid rows entered
  load(cfg, pool, slots) / store(cfg, pool, slots): from / back into the engine's packed pool (the runner's
  only contact with the layout: it never branches on the kernel choice).

Global KV (a static strategy object in the ExecContext, `ex.kv`, over its state pytree):
  DenseKV over DenseGlobal: lat[r] [n_src, B, C, d], idx[r] [n_src, B, C, di] in the compute dtype;
  PagedKV over PagedGlobal: pages uint8 [P, page_bytes] and page_table int32 [B, max_pages]. A page covers
    PAGE_TOKENS = 64 token positions and holds, contiguously, every global group for them: for each KV source
    in order its latent region (64/ratio entries of FP4 e2m1 + E4M3-per-16 scales: 288 B at d=512) then, for
    each source, its index-key region (64/ratio entries of FP4 + UE8M0-per-32: 68 B at di=128). With qdq off
    the entries are raw compute-dtype bytes instead (formats: dsv41_jax.kv_format). Page 0 is the null page:
    table padding points at it, nothing valid lives there.
  capacity(glob, ratio)                       entries per sequence (C)
  index_keys(glob, ratio, src)     -> [B, C, di]   every index key of the sequence
  latents(glob, ratio, src, sel[B,T,k]) -> [B, T, k, d] the selected compressed latents (sel < 0: garbage)
  write(glob, ratio, src, lat, k, j, ok) -> glob   new entries j (groups) where ok
Values handed to `write` are already quantize-dequantized, so packing them is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import jax
import jax.numpy as jnp

from dsv41_jax.attention import ring_update
from dsv41_jax.kv_format import (
    PAGE_TOKENS,
    entry_pack,
    entry_unpack,
    index_entry_bytes,
    latent_entry_bytes,
    swa_pack,
    swa_unpack,
)

__all__ = ["PAGE_TOKENS", "CompressorCarry", "DenseGlobal", "DenseKV", "KVState", "PageLayout", "PagedGlobal",
           "PagedKV", "SwaPool", "SwaRings"]


def _pytree(cls):
    """Register a frozen dataclass whose fields are all arrays (or sub-pytrees, or None) as a pytree."""
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields(cls)], meta_fields=[])


def _window_write(cfg, kv, pos0, n_valid):
    """(ring slot index [B, T] of every chunk row, W where the row is not written): the chunk's last min(W,
    n_valid) valid rows, each slot written once (later rows of one slot win)."""
    T, W = kv.shape[1], cfg.window_size
    i = jnp.arange(T)[None]
    keep = (i < n_valid[:, None]) & (i >= n_valid[:, None] - W)
    return jnp.where(keep, jnp.mod(pos0[:, None] + i, W), W)  # W is out of bounds: dropped


# ----------------------------------------------------------------------------- SWA rings
@_pytree
@dataclass(frozen=True)
class SwaRings:
    """Per-sequence rings in the compute dtype."""
    rings: jax.Array  # [L, B, W, d] compute dtype

    @staticmethod
    def init(cfg, batch: int, dtype) -> SwaRings:
        return SwaRings(jnp.zeros((cfg.n_layers, batch, cfg.window_size, cfg.head_dim), dtype))

    @staticmethod
    def load(cfg, pool, slots) -> SwaRings:
        return SwaRings(swa_unpack(cfg, pool[:, slots]))

    def store(self, cfg, pool, slots):
        return pool.at[:, slots].set(swa_pack(cfg, self.rings))

    def ring(self, cfg, l):
        return jax.lax.dynamic_index_in_dim(self.rings, l, keepdims=False)

    def write(self, cfg, l, kv, pos0, n_valid) -> SwaRings:
        new = ring_update(self.ring(cfg, l), kv, pos0, cfg.window_size, n_valid)
        return SwaRings(jax.lax.dynamic_update_index_in_dim(self.rings, new.astype(self.rings.dtype), l, 0))


@_pytree
@dataclass(frozen=True)
class SwaPool:
    """The engine's packed ring pool, read and written in place at the sequences' pool rows."""
    pool: jax.Array  # [L, R, W, e] uint8, kv_format.swa_pack bytes (R pool rows, e = swa_entry_bytes)
    slots: jax.Array  # [B] int32 pool row of every sequence

    @staticmethod
    def load(cfg, pool, slots) -> SwaPool:
        return SwaPool(pool, slots)

    def store(self, cfg, pool, slots):
        return self.pool

    def ring(self, cfg, l):
        return swa_unpack(cfg, jax.lax.dynamic_index_in_dim(self.pool, l, keepdims=False)[self.slots])

    def write(self, cfg, l, kv, pos0, n_valid) -> SwaPool:
        """The chunk's last min(W, n_valid) rows (packed bytes) enter the pool in place."""
        B, T, _ = kv.shape
        ring_idx = _window_write(cfg, kv, pos0, n_valid)
        slot_idx = jnp.broadcast_to(self.slots[:, None], (B, T))
        layer = jnp.full((B, T), l, jnp.int32)
        return replace(self, pool=self.pool.at[layer, slot_idx, ring_idx].set(swa_pack(cfg, kv), mode="drop"))


# ----------------------------------------------------------------------------- compressor carry
@_pytree
@dataclass(frozen=True)
class CompressorCarry:
    """The ratio-2 compressors' open (incomplete) group per sequence, at slot p % 2. With `rows_kv` / `rows_score`
    given (zeros [n_r2, B, 1+T, d] for a chunk of T rows), a step also records each source's extended chunk rows
    there (attention.compress `with_rows`), from which `attention.carry_at` gives the carry at any shorter end
    (speculative verification: the carry after the last accepted row)."""
    kv: jax.Array  # [n_r2, B, 2, d] f32 pooled-value inputs
    score: jax.Array  # [n_r2, B, 2, d] f32 gate scores (-inf: empty)
    rows_kv: jax.Array | None = None  # [n_r2, B, 1+T, d] f32 the chunk's extended rows (recorded when given)
    rows_score: jax.Array | None = None  # [n_r2, B, 1+T, d] f32


# ----------------------------------------------------------------------------- global KV: dense
@_pytree
@dataclass(frozen=True)
class DenseGlobal:
    lat: dict  # ratio -> [n_src, B, C, d] compute dtype latents
    idx: dict  # ratio -> [n_src, B, C, di] compute dtype index keys


class DenseKV:
    paged = False

    def capacity(self, glob: DenseGlobal, ratio):
        return glob.lat[ratio].shape[2]

    def index_keys(self, glob: DenseGlobal, ratio, src):
        return jax.lax.dynamic_index_in_dim(glob.idx[ratio], src, keepdims=False)

    def all_latents(self, glob: DenseGlobal, ratio, src):
        """Every latent [B, C, d] of a source."""
        return jax.lax.dynamic_index_in_dim(glob.lat[ratio], src, keepdims=False)

    def latents(self, glob: DenseGlobal, ratio, src, sel):
        lat = self.all_latents(glob, ratio, src)
        B, T, k = sel.shape
        out = jnp.take_along_axis(lat, jnp.maximum(sel, 0).reshape(B, -1)[..., None], axis=1)
        return out.reshape(B, T, k, -1)

    def write(self, glob: DenseGlobal, ratio, src, lat, k, j, ok) -> DenseGlobal:
        out = {}
        for name, val in (("lat", lat), ("idx", k)):
            stack = getattr(glob, name)[ratio]
            buf = jax.lax.dynamic_index_in_dim(stack, src, keepdims=False)
            C = buf.shape[1]
            jj = jnp.where(ok, j, C)
            b = jnp.arange(buf.shape[0])[:, None]
            buf = buf.at[b, jj].set(val.astype(buf.dtype), mode="drop")
            out[name] = {**getattr(glob, name), ratio: jax.lax.dynamic_update_index_in_dim(stack, buf, src, 0)}
        return DenseGlobal(**out)

    def __hash__(self):
        return hash("DenseKV")

    def __eq__(self, other):
        return isinstance(other, DenseKV)


# ----------------------------------------------------------------------------- global KV: paged
@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one page. regions[(kind, ratio, src)] = (offset, entries, entry_bytes)."""
    regions: tuple
    page_bytes: int
    fmt: str  # "fp4" or a raw dtype name
    head_dim: int
    index_head_dim: int

    @staticmethod
    def for_config(cfg) -> PageLayout:
        fmt = "fp4" if cfg.qdq else cfg.compute_dtype
        d, di = cfg.head_dim, cfg.index_head_dim
        lat_b, idx_b = latent_entry_bytes(cfg), index_entry_bytes(cfg)
        srcs = {}
        for l in cfg.kv_source_layers:
            r = cfg.compress_ratios[l]
            srcs.setdefault(r, []).append(l)
        regions, off = [], 0
        for kind, eb in (("lat", lat_b), ("idx", idx_b)):
            for r in sorted(srcs, reverse=True):
                for s in range(len(srcs[r])):
                    n = PAGE_TOKENS // r
                    regions.append(((kind, r, s), (off, n, eb)))
                    off += n * eb
        return PageLayout(tuple(regions), off, fmt, d, di)

    @property
    def page_tokens(self) -> int:
        return PAGE_TOKENS

    def region(self, kind, ratio, src_static):
        return dict(self.regions)[(kind, ratio, src_static)]

    def entry_bytes(self, kind) -> int:
        return next(eb for (k, _, _), (_, _, eb) in self.regions if k == kind)

    def n_src(self, ratio):
        return sum(1 for (k, r, _), _ in self.regions if k == "lat" and r == ratio)


@_pytree
@dataclass(frozen=True)
class PagedGlobal:
    pages: jax.Array  # [P, page_bytes] uint8 the page pool (PageLayout)
    page_table: jax.Array  # [B, max_pages] int32 page ids of every sequence (0: the null page)


@dataclass(frozen=True)
class PagedKV:
    layout: PageLayout
    out_dtype: str = "bfloat16"
    paged = True

    def capacity(self, glob: PagedGlobal, ratio):
        return glob.page_table.shape[1] * (PAGE_TOKENS // ratio)

    def _select_region(self, kind, ratio, src):
        """(offset, entries, entry_bytes) of a source given as a traced slot: offsets of same-ratio sources
        are equally spaced, so offset = first + src * stride."""
        first = self.layout.region(kind, ratio, 0)
        n, eb = first[1], first[2]
        return first[0] + src * n * eb, n, eb

    def region_offset(self, kind, ratio, src):
        """Byte offset inside a page of a source's region (src may be traced)."""
        return self._select_region(kind, ratio, src)[0]

    def _byte_index(self, glob: PagedGlobal, kind, ratio, src, entries):
        """Flat byte indices [.., entry_bytes] of global entries (per batch row) in the page pool."""
        off, n, eb = self._select_region(kind, ratio, src)
        table = glob.page_table
        page = jnp.take_along_axis(table, jnp.clip(entries // n, 0, table.shape[1] - 1).reshape(table.shape[0], -1),
                                   axis=1).reshape(entries.shape)
        base = page * self.layout.page_bytes + off + (entries % n) * eb
        return base[..., None] + jnp.arange(eb)

    def _unpack(self, kind, b):
        dim = self.layout.head_dim if kind == "lat" else self.layout.index_head_dim
        return entry_unpack(self.layout.fmt, kind, b, dim, jnp.dtype(self.out_dtype))

    def _read(self, glob: PagedGlobal, kind, ratio, src, entries):
        return self._unpack(kind, glob.pages.reshape(-1)[self._byte_index(glob, kind, ratio, src, entries)])

    def _all(self, glob: PagedGlobal, ratio):
        B = glob.page_table.shape[0]
        C = self.capacity(glob, ratio)
        return jnp.broadcast_to(jnp.arange(C), (B, C))

    def index_keys(self, glob: PagedGlobal, ratio, src):
        return self._read(glob, "idx", ratio, src, self._all(glob, ratio))

    def all_latents(self, glob: PagedGlobal, ratio, src):
        return self._read(glob, "lat", ratio, src, self._all(glob, ratio))

    def latents(self, glob: PagedGlobal, ratio, src, sel):
        return self._read(glob, "lat", ratio, src, jnp.maximum(sel, 0))

    def write(self, glob: PagedGlobal, ratio, src, lat, k, j, ok) -> PagedGlobal:
        pages = glob.pages
        flat = pages.reshape(-1)
        size = flat.shape[0]
        for kind, val in (("lat", lat), ("idx", k)):
            idx = self._byte_index(glob, kind, ratio, src, j)
            idx = jnp.where(ok[..., None], idx, size)  # masked entries -> dropped
            flat = flat.at[idx].set(entry_pack(self.layout.fmt, kind, val), mode="drop")
        return replace(glob, pages=flat.reshape(pages.shape))


# ----------------------------------------------------------------------------- the whole state
@_pytree
@dataclass(frozen=True)
class KVState:
    """Everything a chunk step reads and writes besides the parameters (see the module docstring)."""
    swa: SwaRings | SwaPool  # the sliding-window rings
    glob: DenseGlobal | PagedGlobal  # the compressed global KV (read through ExecContext.kv)
    comp: CompressorCarry | None  # ratio-2 compressor carry (None: the model has no ratio-2 source)
