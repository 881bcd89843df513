"""Host (numpy) dequantization of the checkpoint weight formats, bit-identical to `dsv41_jax.quant`.

Used while importing when the model runs a weight in bf16 (wo_a always; every linear, expert and Engram table
with weight_format "bf16"), one tensor or row range at a time, so the f32 temporaries are bounded by the
slab being filled. Same arithmetic as the device code: value (E4M3 / E2M1 decoded to f32) times the UE8M0
scale 2^(code-127) (code 0 -> 2^-127) in f32, then rounded to the target dtype.

- `dequant_fp8_block(w, s)`: E4M3 [out, in], one scale per 32x32 block [ceil(out/32), ceil(in/32)];
- `dequant_fp4(packed, s)`: two E2M1 per byte [out, in/2] (low nibble = even element), scales [out, in/32];
- `dequant_rows32(q, s)`: E4M3 [rows, n] with one scale per 32 columns [rows, n/32] (Engram tables).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dsv41_jax.quant import FP4_VALUES

BF16 = np.dtype(ml_dtypes.bfloat16)


def e8m0_to_f32(scale: np.ndarray) -> np.ndarray:
    codes = np.ascontiguousarray(scale).view(np.uint8).astype(np.int32)
    out = (codes << 23).view(np.float32)
    out[codes == 0] = np.float32(2.0 ** -127)
    return out


def dequant_fp8_block(w: np.ndarray, s: np.ndarray, dtype=BF16, block: int = 32) -> np.ndarray:
    out, inp = w.shape
    f = w.astype(np.float32)
    sf = e8m0_to_f32(s)
    if out % block == 0 and inp % block == 0:
        f = f.reshape(out // block, block, inp // block, block)
        f *= sf[:, None, :, None]
        return f.reshape(out, inp).astype(dtype)
    f *= np.repeat(np.repeat(sf, block, axis=0), block, axis=1)[:out, :inp]
    return f.astype(dtype)


def _per32(values: np.ndarray, s: np.ndarray, dtype, block: int) -> np.ndarray:
    rows, n = values.shape
    v = values.reshape(rows, n // block, block)
    v *= e8m0_to_f32(s)[:, :, None]
    return v.reshape(rows, n).astype(dtype)


def dequant_fp4(packed: np.ndarray, s: np.ndarray, dtype=BF16, block: int = 32) -> np.ndarray:
    p = np.ascontiguousarray(packed).view(np.uint8)
    codes = np.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[0], p.shape[1] * 2)
    return _per32(FP4_VALUES[codes], s, dtype, block)


def dequant_rows32(q: np.ndarray, s: np.ndarray, dtype=BF16, block: int = 32) -> np.ndarray:
    return _per32(q.astype(np.float32), s, dtype, block)
