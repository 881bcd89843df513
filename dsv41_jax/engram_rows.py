"""The row format of Engram tables kept in host memory, and the in-program decoding of gathered rows.

A host table is one uint8 array [rows, row_bytes]: row r holds the bytes of table row r exactly as the
parameter leaves store them, weight first, then its scales:
- weight_format "fp8": head_dim E4M3 bytes + head_dim/32 UE8M0 scale bytes (V4.1-Flash: 256 + 8 = 264 B);
- weight_format "bf16": head_dim bfloat16 values (2 * head_dim bytes, little-endian).

The engine gathers the rows a program needs on the host (serving/engine/engram_host.py) and passes them as
``ChunkInputs.engram_rows``: one uint8 array [B, T, n_cols, row_bytes] per Engram layer. `decode_rows` turns
them into the values `layers.engram_lookup` computes from the device tables, with the same operations in the
same order, so both paths give bit-identical activations.

`split_tables` / `drop_tables` remove the table leaves (``engram[i].embed``) from a parameter-shaped tree (the
parameters, their shardings or partition specs): with host tables the device tree has no table at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax import quant

SCALE_BLOCK = 32  # table columns per UE8M0 scale (fp8 tables)


@dataclass(frozen=True)
class RowFormat:
    head_dim: int
    fp8: bool

    @property
    def weight_bytes(self) -> int:
        return self.head_dim if self.fp8 else 2 * self.head_dim

    @property
    def scale_bytes(self) -> int:
        return self.head_dim // SCALE_BLOCK if self.fp8 else 0

    @property
    def row_bytes(self) -> int:
        return self.weight_bytes + self.scale_bytes

    @property
    def weight_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.float8_e4m3fn if self.fp8 else ml_dtypes.bfloat16)


def row_format(cfg) -> RowFormat:
    return RowFormat(cfg.engram_head_dim, cfg.weight_format == "fp8")


def table_bytes(cfg) -> list[int]:
    """Host bytes of each Engram table in this format."""
    rb = row_format(cfg).row_bytes
    return [rows * rb for rows in cfg.engram_rows]


def pack_rows(fmt: RowFormat, weight: np.ndarray, scale: np.ndarray | None = None, out: np.ndarray | None = None):
    """Host: table rows (weight [n, head_dim] + scale [n, head_dim/32] for fp8) -> uint8 [n, row_bytes]."""
    weight = np.ascontiguousarray(weight)
    n = weight.shape[0]
    if weight.shape != (n, fmt.head_dim):
        raise ValueError(f"Engram table rows have shape {weight.shape}, expected (n, {fmt.head_dim})")
    out = np.empty((n, fmt.row_bytes), np.uint8) if out is None else out
    out[:, :fmt.weight_bytes] = weight.view(np.uint8).reshape(n, fmt.weight_bytes)
    if fmt.fp8:
        if scale is None or scale.shape != (n, fmt.scale_bytes):
            raise ValueError(f"an fp8 Engram table needs scales [{n}, {fmt.scale_bytes}]")
        out[:, fmt.weight_bytes:] = np.ascontiguousarray(scale).view(np.uint8)
    return out


def unpack_rows(fmt: RowFormat, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Host: uint8 [n, row_bytes] -> (weight [n, head_dim], scale [n, head_dim/32] or None): pack_rows' inverse."""
    w = np.ascontiguousarray(rows[:, :fmt.weight_bytes]).view(fmt.weight_dtype)
    if not fmt.fp8:
        return w, None
    return w, np.ascontiguousarray(rows[:, fmt.weight_bytes:]).view(ml_dtypes.float8_e8m0fnu)


def bad_rows(fmt: RowFormat, rows: np.ndarray) -> np.ndarray:
    """Indices of rows holding a NaN (fp8: E4M3 code 0x7F/0xFF or UE8M0 0xFF; bf16: NaN or inf)."""
    if fmt.fp8:
        w = rows[:, :fmt.weight_bytes]
        bad = ((w & 0x7F) == 0x7F).any(axis=1) | (rows[:, fmt.weight_bytes:] == 0xFF).any(axis=1)
    else:
        bits = np.ascontiguousarray(rows).view(np.uint16)
        bad = ((bits & 0x7F80) == 0x7F80).any(axis=1)
    return np.flatnonzero(bad)


def decode_rows(cfg, rows, dtype):
    """In a program: gathered rows uint8 [..., n_cols, row_bytes] -> [..., n_cols * head_dim] in `dtype`, the
    values `layers.engram_lookup` computes from the device table for the same ids."""
    fmt = row_format(cfg)
    w = jax.lax.bitcast_convert_type(rows[..., :fmt.weight_bytes], jnp.float8_e4m3fn) if fmt.fp8 else \
        jax.lax.bitcast_convert_type(rows[..., :fmt.weight_bytes].reshape(*rows.shape[:-1], -1, 2), jnp.bfloat16)
    if fmt.fp8:
        sc = quant.e8m0_to_f32(rows[..., fmt.weight_bytes:])
        w = w.astype(jnp.float32).reshape(*w.shape[:-1], -1, SCALE_BLOCK) * sc[..., None]
        w = w.reshape(*rows.shape[:-1], -1)
    return w.astype(dtype).reshape(*rows.shape[:-2], -1)


# ----------------------------------------------------------------------------- parameter trees
def split_tables(tree):
    """(tree without the Engram table leaves, [table node of each Engram layer]): a shallow copy, the input is
    left as it is. A tree without tables gives ([] if it has no "engram" entry, else Nones)."""
    if not isinstance(tree, dict) or "engram" not in tree:
        return tree, []
    layers, tables = [], []
    for node in tree["engram"]:
        node = dict(node)
        tables.append(node.pop("embed", None))
        layers.append(node)
    return {**tree, "engram": layers}, tables


def drop_tables(tree):
    return split_tables(tree)[0]
