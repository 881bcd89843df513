"""How gathered Engram rows get to the device fastest (issue 26; serving/engine/engram_staging.py explains the paths).

    python -m bench.engram_copy --out $OUT/engram_copy_medium_h200.json   # H200, ~1 minute
    python -m bench.engram_copy --smoke --out /tmp/engram_copy_smoke.json           # CPU

At medium's row shapes (both Engram layers, n_cols x row_bytes per token; `--preset`): decode calls of batch 1, 8,
32 (one token per row) and one `--chunk`-token prefill chunk. Each path copies the same host rows, `--reps` times
after `--warmup` discarded runs (the host buffers refilled before each rep, as a gather would, only once the last
copy is ready); per rep `host_ms` (the put calls on the calling thread: what the engine thread pays) and
`ready_ms` (until every array is on the device: what the program waits for); medians and p90s. Paths:
- copy_per_layer: device_put(numpy, may_alias=False) per layer (the feeder before pinned staging);
- copy_one_call: one device_put of both layers, may_alias=False;
- alias: one call, may_alias=True, plain numpy buffers (PjRt stages them on its own thread);
- mapped: one call, may_alias=True, buffers registered with the client (Client.dma_map): no staging copy
  (the feeder's `pinned_staging` path for staged calls);
- mapped_per_layer: the same, one call per layer (the feeder's eager prefill path: each layer sent when gathered);
- mapped_stacked: one [layers, ...] registered array in one transfer (what a stacked program input would cost);
- pinned_host: device_put to a pinned_host jax.Array, then device_put of that to the device;
- cuda_register: numpy buffers page-locked with cudaHostRegister (ctypes, libcudart), may_alias=True, one call
  (does this jaxlib skip staging for memory it did not register itself?);
and with a compiled program that reads one byte of each layer's rows (as the engine's programs take them; here
`ready_ms` is until its output is ready, `host_ms` the put and the program call):
- jit_device_args: the program alone on rows already on the device (the dispatch cost to subtract);
- jit_after_copy: copy_one_call, then the program;
- jit_after_mapped: mapped, then the program;
- jit_numpy_args: fresh numpy buffers handed to the program call itself (the feeder's `rows_in_call` path for
  decode-size calls: jax copies them within the call, as the call's other host inputs).
Each path's device arrays are checked against the host rows once. A failing path prints an error row and the
run goes on; the JSON is rewritten after each case. `register_ms`: dma_map of one buffer set of that shape (paid
once per pooled set). A short table is printed last.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import sys
import time

import numpy as np


def _p90(xs):
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def _cudart():
    """libcudart via ctypes (the jax CUDA wheels ship it as a pip package), or None."""
    names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
    try:
        import nvidia.cuda_runtime as cr  # noqa: F401  (jax[cuda12] wheels)

        d = os.path.join(list(cr.__path__)[0], "lib")
        names = [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.startswith("libcudart.so")] + names
    except Exception:  # noqa: BLE001
        pass
    found = ctypes.util.find_library("cudart")
    for n in names + ([found] if found else []):
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    return None


class _Path:
    """Host buffers of one path and how they are put."""

    def __init__(self, name, shape, n_layers, dev, staging_cls, cudart):
        import jax

        self.name, self.shape, self.E = name, shape, n_layers
        self.sh = jax.sharding.SingleDeviceSharding(dev)
        self.register_ms = None
        self._keep = []
        if name.startswith("jit_"):
            import jax.numpy as jnp

            avals = [jax.ShapeDtypeStruct(shape, np.uint8, sharding=self.sh)] * n_layers
            fn = jax.jit(lambda *r: sum(x[0, 0, 0, 0].astype(jnp.int32) for x in r))
            self.prog = fn.lower(*avals).compile()
        if name in ("mapped", "jit_after_mapped") or name.startswith("mapped_"):
            stacked = name == "mapped_stacked"
            st = staging_cls(1 if stacked else n_layers, pinned=True)
            if not st.mapped:
                raise RuntimeError("dma_map unavailable on this client")
            t0 = time.perf_counter()
            self.bufs = st.get((n_layers, *shape) if stacked else shape)
            self.register_ms = round((time.perf_counter() - t0) * 1e3, 3)
            self._keep.append(st)
            if stacked:
                self.stacked, self.bufs = self.bufs[0], list(self.bufs[0])
        elif name == "cuda_register":
            if cudart is None:
                raise RuntimeError("libcudart not found")
            self.bufs = [_aligned_array(shape) for _ in range(n_layers)]
            for b in self.bufs:
                rc = cudart.cudaHostRegister(ctypes.c_void_p(b.ctypes.data), ctypes.c_size_t(b.nbytes),
                                             ctypes.c_uint(0))
                if rc != 0:
                    raise RuntimeError(f"cudaHostRegister returned {rc}")
            self._cudart = cudart
        else:
            self.bufs = [np.empty(shape, np.uint8) for _ in range(n_layers)]
        if name == "pinned_host":
            self.psh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    def fill(self, rng):
        if self.name == "jit_numpy_args":  # fresh buffers each call (the call may read them after it returns)
            self.bufs = [np.empty(self.shape, np.uint8) for _ in range(self.E)]
        if not hasattr(self, "_src"):  # two random sources, alternated (cheaper than drawing 50 MB per rep)
            self._src, self._i = [rng.integers(0, 256, self.shape, np.uint8) for _ in range(2)], 0
        self._i += 1
        for e, b in enumerate(self.bufs):
            b[...] = self._src[(self._i + e) % 2]

    def put(self) -> list:
        import jax

        n = self.name
        if n == "copy_per_layer":
            return [jax.device_put(b, self.sh, may_alias=False) for b in self.bufs]
        if n == "copy_one_call":
            return jax.device_put(self.bufs, self.sh, may_alias=False)
        if n in ("alias", "mapped", "cuda_register"):
            return jax.device_put(self.bufs, self.sh, may_alias=True)
        if n == "mapped_per_layer":
            return [jax.device_put(b, self.sh, may_alias=True) for b in self.bufs]
        if n == "mapped_stacked":
            return [jax.device_put(self.stacked, self.sh, may_alias=True)]
        if n == "jit_device_args":
            if not hasattr(self, "dev_rows"):
                self.dev_rows = jax.device_put(self.bufs, self.sh)
            return [self.prog(*self.dev_rows)]
        if n == "jit_after_copy":
            return [self.prog(*jax.device_put(self.bufs, self.sh, may_alias=False))]
        if n == "jit_after_mapped":
            return [self.prog(*jax.device_put(self.bufs, self.sh, may_alias=True))]
        if n == "jit_numpy_args":
            return [self.prog(*self.bufs)]
        if n == "pinned_host":
            return jax.device_put(jax.device_put(self.bufs, self.psh, may_alias=False), self.sh)
        raise ValueError(n)

    def check(self, arrays):
        if self.name.startswith("jit_"):
            src = self.bufs if self.name != "jit_device_args" else [np.asarray(x) for x in self.dev_rows]
            want = sum(int(b[0, 0, 0, 0]) for b in src)
            if int(arrays[0]) != want:
                raise AssertionError(f"{self.name}: the program read {int(arrays[0])}, want {want}")
            return
        got = [np.asarray(a) for a in arrays]
        if self.name == "mapped_stacked":
            got = list(got[0])
        for g, b in zip(got, self.bufs):
            if not np.array_equal(g, b):
                raise AssertionError(f"{self.name}: device rows differ from the host rows")

    def close(self):
        if self.name == "cuda_register":
            for b in self.bufs:
                self._cudart.cudaHostUnregister(ctypes.c_void_p(b.ctypes.data))


def _aligned_array(shape):
    n = int(np.prod(shape))
    raw = np.empty(n + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + n].reshape(shape)


PATHS = ("copy_per_layer", "copy_one_call", "alias", "mapped", "mapped_per_layer", "mapped_stacked", "pinned_host",
         "cuda_register", "jit_device_args", "jit_after_copy", "jit_after_mapped", "jit_numpy_args")


def run_case(a, call, shape, n_layers, path, dev, rng, cudart):
    import jax

    from serving.engine.engram_staging import Staging

    p = _Path(path, shape, n_layers, dev, Staging, cudart)
    try:
        host, ready = [], []
        for i in range(a.warmup + a.reps):
            p.fill(rng)
            t0 = time.perf_counter()
            arrays = p.put()
            t1 = time.perf_counter()
            jax.block_until_ready(arrays)
            t2 = time.perf_counter()
            if i == 0:
                p.check(arrays)
            if i >= a.warmup:
                host.append((t1 - t0) * 1e3)
                ready.append((t2 - t0) * 1e3)
            del arrays
        mb = n_layers * int(np.prod(shape)) / 1e6
        med = statistics.median(ready)
        return {"call": call, "path": path, "shape": list(shape), "layers": n_layers, "mb": round(mb, 3),
                "reps": a.reps, "host_ms": round(statistics.median(host), 4), "host_p90_ms": round(_p90(host), 4),
                "ready_ms": round(med, 4), "ready_p90_ms": round(_p90(ready), 4),
                "gbs": round(mb / 1e3 / (med / 1e3), 2), "register_ms": p.register_ms}
    finally:
        p.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--smoke", action="store_true", help="CPU, few reps")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        a.reps, a.warmup, a.chunk = 3, 1, 256
    import dsv41_jax  # noqa: F401, I001  (XLA flags before the backend starts)
    import jax  # noqa: I001

    from bench.common import write_result
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.engram_rows import row_format

    cfg = ModelConfig.preset(a.preset)
    C, RB, E = cfg.engram_layout.n_cols, row_format(cfg).row_bytes, len(cfg.engram_layer_ids)
    dev = jax.devices()[0]
    cudart = _cudart() if dev.platform == "gpu" else None
    cases = [(f"decode{b}", (b, 1, C, RB)) for b in [int(x) for x in a.batches.split(",")]]
    cases.append((f"chunk{a.chunk}", (1, a.chunk, C, RB)))
    rows: list = []
    result = {"preset": a.preset, "n_cols": C, "row_bytes": RB, "layers": E, "platform": dev.platform, "rows": rows}
    command = "python -m bench.engram_copy " + " ".join(argv if argv is not None else sys.argv[1:])
    rng = np.random.default_rng(0)
    t_start = time.perf_counter()
    for call, shape in cases:
        for path in a.paths.split(","):
            try:
                rows.append(run_case(a, call, shape, E, path, dev, rng, cudart))
            except Exception as ex:  # noqa: BLE001 - an error row, the run goes on
                rows.append({"call": call, "path": path, "error": f"{type(ex).__name__}: {ex}"[:300]})
            if a.out:
                write_result(a.out, result, command)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    if a.out:
        write_result(a.out, result, command)
    print(f"{'call':>10} {'path':>16} {'MB':>7} {'host ms':>8} {'p90':>7} {'ready ms':>9} {'p90':>7} {'GB/s':>6} "
          f"{'reg ms':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['call']:>10} {r['path']:>16} error: {r['error']}")
            continue
        print(f"{r['call']:>10} {r['path']:>16} {r['mb']:>7} {r['host_ms']:>8} {r['host_p90_ms']:>7} "
              f"{r['ready_ms']:>9} {r['ready_p90_ms']:>7} {r['gbs']:>6} {r['register_ms'] or '':>7}")
    print(f"total {result['total_s']} s on {dev.device_kind}")
    return result


if __name__ == "__main__":
    main()
