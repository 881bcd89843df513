"""Shared pieces of the Pallas kernels: in-kernel decoding of the V4.1 byte formats, the interpret switch,
a fix for Pallas Triton's pointer offsets into 1-byte arrays of 2..4 GiB, and a CPU-side check that a kernel
lowers through the Pallas Triton backend for an H200.

The offset fix (`_install_offset_fix`, applied when this module is imported, so before any kernel lowers) wraps
one private function of jax's Pallas Triton lowering, process-wide: arrays of more than 2^31 one-byte elements
but at most 4 GiB get 64-bit offsets instead of sign-extended 32-bit ones (which address their upper half
wrongly). It changes nothing else; if jax's internals move, `check_offsets` refuses such arrays instead.

In-kernel decoders use only integer shifts/masks, compares, selects and float multiplies, because Hopper
has no FP4 type and the Pallas Triton lowering cannot load float4 refs (tests/kernels/test_common.py). They
are plain jnp functions on int32 arrays, so the same code runs inside a kernel body, in interpret mode on
CPU, and in the references. Every decoder is bit-exact (tests/kernels/test_common.py checks all codes).

Byte formats (dsv41_jax.quant):
- E2M1 (FP4) code c in [0, 16): sign bit 3, exponent bits 2..1, mantissa bit 0; values 0, .5, 1, 1.5, 2, 3, 4, 6.
  Two codes per byte, low nibble = even element.
- E4M3 (FP8, fn variant) byte: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; 0x7f/0xff are NaN.
- UE8M0 / E8M0 scale byte s: 2^(s - 127) (s = 0 -> 2^-127, subnormal; s = 255 is NaN in the OCP format, never
  produced by our quantizers).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

from pallas_kernels import act_quant

F32 = jnp.float32


# ----------------------------------------------------------------------------- operand bundles
def operands(cls):
    """A frozen keyword-only dataclass of one op's operands, registered as a pytree: fields made with `static()`
    are metadata (hashable, part of the jit key), the others arrays (or None). The producer fills it and the
    kernel reads it, so adding an operand touches those two and nothing in between (the ops seam and shard_map
    pass it whole)."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    meta = [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]
    data = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static(**kw):
    """An `operands` field that is static metadata (an int / bool / str), not an array."""
    return dataclasses.field(metadata={"static": True}, **kw)


def heads(dim: int, **kw):
    """An `operands` array field whose dim `dim` indexes query / index heads: tensor parallelism splits it there
    (every other field is replicated)."""
    return dataclasses.field(metadata={"heads": dim}, **kw)


def head_dims(bundle) -> dict:
    """field name -> its heads dim (None: replicated) of an `operands` bundle."""
    return {f.name: f.metadata.get("heads") for f in dataclasses.fields(bundle)
            if not f.metadata.get("static")}


def interpret_default() -> bool:
    """Pallas kernels run in interpret mode on CPU (the only mode there) and compiled elsewhere. The platform is
    the default device's where one is set (`with jax.default_device(d)`: a compile-only GPU device on a host
    without one lowers the kernels for that GPU, bench/hlo_kernels.py), else the default backend's."""
    dev = jax.config.jax_default_device
    if dev is not None and not isinstance(dev, str):
        return dev.platform == "cpu"
    return (dev or jax.default_backend()) == "cpu"


def last_arrival(counter_ref, index, arrivals: int, interpret: bool):
    """Inside a kernel body: count this program's arrival at counter_ref[index] (int32, zeroed per call) and
    return whether it is the last of `arrivals` programs to arrive there: that program may then read what the
    others stored before their arrival (its loads of them must bypass L1: `load_uncached`). A CTA barrier
    orders every thread's stores before the acquire-release atomic (Triton issues a scalar atomic from one
    thread); interpret mode runs the programs one after another and has no barrier. No program ever waits, so
    the grid may exceed what the GPU holds at once."""
    if not interpret:
        plt.debug_barrier()
    return plt.atomic_add(counter_ref, index, jnp.int32(1)) == arrivals - 1


def load_uncached(ref, *, l2_only: bool = True, **kw):
    """Inside a kernel body: a load that bypasses L1 (`ld.volatile`: L2 serves it), for values other programs of
    this launch stored (last-arrival partials, a buffer written earlier in the same kernel). `l2_only=False` is a
    plain load. Why volatile and not cache_modifier=".cg": jax 0.11's Triton lowering rejects every cache
    modifier string (KeyError '.cg'), while the volatile flag lowers on every jax version we run."""
    return plt.load(ref, volatile=l2_only, **kw)


# Registers per thread that a group of in-flight partial loads may hold (sum_in_order).
LOAD_REGS_IN_FLIGHT = 64


def sum_in_order(load, n: int, init, *, regs_per_load: int):
    """Inside a kernel: init + load(0) + ... + load(n - 1), added in index order (deterministic: the order of a
    loop over k). n is static and the sum is unrolled in groups: a group's loads are all issued before the first
    of them is added, so they wait about one memory latency together where a loop waits one per load (Triton does
    not pipeline a loop of `num_stages=1` kernels). regs_per_load: 32-bit registers a thread holds per load
    (elements of the loaded block / threads); a group holds at most LOAD_REGS_IN_FLIGHT of them."""
    group = max(1, LOAD_REGS_IN_FLIGHT // max(regs_per_load, 1))
    acc = init
    for g0 in range(0, n, group):
        for v in [load(k) for k in range(g0, min(n, g0 + group))]:
            acc = acc + v
    return acc


def _i32(x):
    return x.astype(jnp.int32)


def e2m1_to_f32(code):
    """E2M1 codes (any int dtype, values 0..15) -> f32 values."""
    c = _i32(code)
    e = (c >> 1) & 3
    m = (c & 1).astype(F32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)))
    return jnp.where((c & 8) != 0, -mag, mag)


def low_nibble(byte):
    return _i32(byte) & 15


def high_nibble(byte):
    return (_i32(byte) >> 4) & 15


def e8m0_to_f32(byte):
    """E8M0 / UE8M0 scale bytes -> f32 powers of two (2^(s-127))."""
    s = _i32(byte) & 255
    normal = jax.lax.bitcast_convert_type(s << 23, F32)
    return jnp.where(s == 0, jnp.float32(2.0 ** -127), normal)


def e4m3_to_f32(byte):
    """E4M3 (fn) bytes -> f32, by bit manipulation (NaN for 0x7f / 0xff)."""
    b = _i32(byte) & 255
    e = (b >> 3) & 15
    m = (b & 7).astype(F32)
    # normal: (1 + m/8) * 2^(e-7) = (8 + m) * 2^(e-10); subnormal (e == 0): m * 2^-9
    pow2 = jax.lax.bitcast_convert_type((jnp.maximum(e, 1) - 10 + 127) << 23, F32)
    mag = jnp.where(e == 0, m * jnp.float32(2.0 ** -9), (8.0 + m) * pow2)
    mag = jnp.where((b & 127) == 127, jnp.float32(jnp.nan), mag)
    return jnp.where((b & 128) != 0, -mag, mag)


def fp8_encode_block(x, block: int = 32):
    """Inside a kernel: dsv41_jax.quant.fp8_encode of an f32 [rows, n] block (the rule: pallas_kernels/act_quant.py).
    Returns (E4M3 values [rows, n] float8_e4m3fn, scale codes [rows, n / block] int32, scales [rows, n / block] f32)."""
    rows, n = x.shape
    q, code, scale = act_quant.encode_blocks(x.reshape(rows, n // block, block))
    return q.reshape(rows, n), code, scale


def fp8_qdq_block(x, block: int = 32):
    """Inside a kernel: dsv41_jax.quant.fp8_qdq of an f32 [rows, n] block, in f32."""
    rows, n = x.shape
    q, _, scale = fp8_encode_block(x, block)
    return (q.astype(F32).reshape(rows, n // block, block) * scale[:, :, None]).reshape(rows, n)


# ----------------------------------------------------------------------------- a Pallas Triton offset bug
def _widen_for_offsets(block_info):
    """BlockInfo of a 1-byte array with more than 2^31 elements, relabelled 2 bytes wide so that the lowering's
    own size test (> 4 GiB) picks 64-bit offsets. Only that test reads the dtype; strides come from the shape."""
    aval = getattr(block_info, "full_shape_dtype", None)
    if aval is None or jnp.dtype(aval.dtype).itemsize != 1 or math.prod(aval.shape) <= 2 ** 31 - 1:
        return block_info
    return dataclasses.replace(block_info, full_shape_dtype=aval.update(dtype=jnp.dtype(jnp.uint16)))


def _install_offset_fix() -> bool:
    """Pallas Triton (jax 0.12.0.1's lowering.py; the same rule in the older sources) indexes an array with
    32-bit offsets unless it exceeds 4 GiB, and Triton's pointer add sign-extends them: in a 1-byte array of
    2..4 GiB (e.g. one layer's MXFP4 experts, [384, 2304, 2560] uint8) every element past 2^31 would be read
    from the wrong address. Wrap the offset computation so such arrays get 64-bit offsets (always correct,
    otherwise unchanged). Returns whether the fix is in place (False if jax's internals moved: `check_offsets`
    then refuses those arrays)."""
    try:
        from jax._src.pallas.triton import lowering as tl
        orig = tl._compute_offsets_from_indices
    except (ImportError, AttributeError):
        return False
    if getattr(orig, "_dsv41_offset_fix", False):
        return True

    @functools.wraps(orig)
    def fixed(block_info, *args, **kwargs):
        return orig(_widen_for_offsets(block_info), *args, **kwargs)

    fixed._dsv41_offset_fix = True
    tl._compute_offsets_from_indices = fixed
    return True


OFFSET_FIX = _install_offset_fix()  # at import: every kernel module imports common


def check_offsets(*arrays):
    """Without the offset fix, refuse 1-byte arrays with more than 2^31 elements of at most 4 GiB."""
    for a in arrays:
        if not OFFSET_FIX and a.dtype.itemsize == 1 and 2 ** 31 <= a.size <= 2 ** 32:
            raise ValueError(
                f"1-byte array {a.shape}: Pallas Triton would use 32-bit signed offsets past 2^31; keep such "
                "weights stacked (> 4 GiB) or sharded (< 2 GiB)")



# ----------------------------------------------------------------------------- GPU lowering check (CPU side)
def lower_for_h200(fn, *abstract_args):
    """Lower `fn(*abstract_args)` for CUDA on a machine without a GPU, through the Pallas Triton backend.

    This runs every Pallas Triton lowering rule (shapes must be powers of two, supported primitives, ref
    indexing), i.e. most of what fails when a kernel is first compiled on the GPU; it does not run Triton's
    own compiler (ptxas, shared-memory limits). Returns the StableHLO text. Kernels must be built with
    interpret=False for this check."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*abstract_args)
    return exp.mlir_module()


def split_bf16x3(x):
    """x f32 -> (hi, mid, lo) bf16 with hi + mid + lo == x exactly: hi = bf16(x) holds x's top 8 significant bits,
    the f32 remainder x - hi is exact and holds at most 16 more, mid takes 8 of them and lo the rest (for normal x
    whose remainders stay above bf16's smallest normal, ~1e-38). Plain jnp: XLA and the Triton lowering both run it
    (the LM head's x in gemm.matmul_f32x, Mega-mHC's f32 `fn` tiles in-kernel)."""
    x = x.astype(jnp.float32)
    hi = x.astype(jnp.bfloat16)
    r = x - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)
