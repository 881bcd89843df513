"""Global-KV storage seen by the model: dense per-sequence buffers or a paged, packed pool.

Both strategies expose the same three operations on the `state` dict that `model.step` threads through:
  index_keys(state, ratio, src)            -> [B, C, di]   every index key of the sequence (C = capacity)
  latents(state, ratio, src, sel[B,T,k])   -> [B, T, k, d] the selected compressed latents (sel < 0: garbage)
  write(state, ratio, src, lat, k, j, ok)  -> state        new entries j (groups) where ok
Values handed to `write` are already quantize-dequantized, so packing them is lossless.

DenseKV: state["lat_r{r}"] [n_src, B, C, d], state["idx_r{r}"] [n_src, B, C, di] in the compute dtype.

PagedKV: state["pages"] uint8 [P, page_bytes] and state["page_table"] int32 [B, max_pages]. A page covers
64 token positions and holds, contiguously, every global group for them: for each KV source in order its
latent region (64/ratio entries of FP4 e2m1 + E4M3-per-16 scales: 288 B at d=512) then, for each source, its
index-key region (64/ratio entries of FP4 + UE8M0-per-32: 68 B at di=128). With qdq off the entries are raw
compute-dtype bytes instead. Page 0 is the null page: table padding points at it, nothing valid lives there.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.kv_format import PAGE_TOKENS, index_entry_bytes, latent_entry_bytes

__all__ = ["PAGE_TOKENS", "DenseKV", "PagedKV", "PageLayout"]


class DenseKV:
    paged = False

    def capacity(self, state, ratio):
        return state[f"lat_r{ratio}"].shape[2]

    def index_keys(self, state, ratio, src):
        return jax.lax.dynamic_index_in_dim(state[f"idx_r{ratio}"], src, keepdims=False)

    def latents(self, state, ratio, src, sel):
        lat = jax.lax.dynamic_index_in_dim(state[f"lat_r{ratio}"], src, keepdims=False)
        B, T, k = sel.shape
        out = jnp.take_along_axis(lat, jnp.maximum(sel, 0).reshape(B, -1)[..., None], axis=1)
        return out.reshape(B, T, k, -1)

    def write(self, state, ratio, src, lat, k, j, ok):
        out = dict(state)
        for key, val in ((f"lat_r{ratio}", lat), (f"idx_r{ratio}", k)):
            buf = jax.lax.dynamic_index_in_dim(state[key], src, keepdims=False)
            C = buf.shape[1]
            jj = jnp.where(ok, j, C)
            b = jnp.arange(buf.shape[0])[:, None]
            buf = buf.at[b, jj].set(val.astype(buf.dtype), mode="drop")
            out[key] = jax.lax.dynamic_update_index_in_dim(state[key], buf, src, 0)
        return out

    def __hash__(self):
        return hash("DenseKV")

    def __eq__(self, other):
        return isinstance(other, DenseKV)


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

    def region(self, kind, ratio, src_static):
        return dict(self.regions)[(kind, ratio, src_static)]

    def n_src(self, ratio):
        return sum(1 for (k, r, _), _ in self.regions if k == "lat" and r == ratio)


def _pack(layout: PageLayout, kind: str, x):
    if layout.fmt == "fp4":
        if kind == "lat":
            p, s = quant.fp4_pack(x, 16, "e4m3")
        else:
            p, s = quant.fp4_pack(x, 32, "ue8m0")
        return jnp.concatenate([p, s], axis=-1)
    dt = jnp.dtype(layout.fmt)
    b = jax.lax.bitcast_convert_type(x.astype(dt), jnp.uint8)
    return b.reshape(*x.shape[:-1], -1)


def _unpack(layout: PageLayout, kind: str, b, out_dtype):
    dim = layout.head_dim if kind == "lat" else layout.index_head_dim
    if layout.fmt == "fp4":
        half = dim // 2
        if kind == "lat":
            return quant.fp4_unpack(b[..., :half], b[..., half:], 16, "e4m3", out_dtype)
        return quant.fp4_unpack(b[..., :half], b[..., half:], 32, "ue8m0", out_dtype)
    dt = jnp.dtype(layout.fmt)
    v = b.reshape(*b.shape[:-1], dim, dt.itemsize)
    return jax.lax.bitcast_convert_type(v, dt).astype(out_dtype)


@dataclass(frozen=True)
class PagedKV:
    layout: PageLayout
    out_dtype: str = "bfloat16"
    paged = True

    def capacity(self, state, ratio):
        return state["page_table"].shape[1] * (PAGE_TOKENS // ratio)

    def _select_region(self, kind, ratio, src):
        """(offset, entries, entry_bytes) of a source given as a traced slot: offsets of same-ratio sources
        are equally spaced, so offset = first + src * stride."""
        first = self.layout.region(kind, ratio, 0)
        n, eb = first[1], first[2]
        return first[0] + src * n * eb, n, eb

    def region_offset(self, kind, ratio, src):
        """Byte offset inside a page of a source's region (src may be traced)."""
        return self._select_region(kind, ratio, src)[0]

    def _byte_index(self, state, kind, ratio, src, entries):
        """Flat byte indices [.., entry_bytes] of global entries (per batch row) in the page pool."""
        off, n, eb = self._select_region(kind, ratio, src)
        table = state["page_table"]
        page = jnp.take_along_axis(table, jnp.clip(entries // n, 0, table.shape[1] - 1).reshape(table.shape[0], -1),
                                   axis=1).reshape(entries.shape)
        base = page * self.layout.page_bytes + off + (entries % n) * eb
        return base[..., None] + jnp.arange(eb)

    def index_keys(self, state, ratio, src):
        B = state["page_table"].shape[0]
        C = self.capacity(state, ratio)
        e = jnp.broadcast_to(jnp.arange(C), (B, C))
        b = state["pages"].reshape(-1)[self._byte_index(state, "idx", ratio, src, e)]
        return _unpack(self.layout, "idx", b, jnp.dtype(self.out_dtype))

    def latents(self, state, ratio, src, sel):
        b = state["pages"].reshape(-1)[self._byte_index(state, "lat", ratio, src, jnp.maximum(sel, 0))]
        return _unpack(self.layout, "lat", b, jnp.dtype(self.out_dtype))

    def write(self, state, ratio, src, lat, k, j, ok):
        pages = state["pages"]
        flat = pages.reshape(-1)
        size = flat.shape[0]
        for kind, val in (("lat", lat), ("idx", k)):
            idx = self._byte_index(state, kind, ratio, src, j)
            idx = jnp.where(ok[..., None], idx, size)  # masked entries -> dropped
            flat = flat.at[idx].set(_pack(self.layout, kind, val), mode="drop")
        return dict(state, pages=flat.reshape(pages.shape))
