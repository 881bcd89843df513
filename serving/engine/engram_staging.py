"""Host buffers that hold gathered Engram rows on their way to the device (serving/engine/engram_host.py).

How a numpy array reaches a GPU through `jax.device_put` (XLA's PjRt GPU client, as read in its source):
- `may_alias=False` (copy semantics) hands the array over as "immutable only during the call": PjRt copies it
  into a pinned staging buffer on the *calling* thread before it starts the DMA, so the engine thread pays a host
  memcpy of every row (a 2,048-token chunk of medium is ~26 MB: several ms at single-thread memcpy speed);
- `may_alias=True` lets PjRt read the array after the call returns (it keeps a reference until the transfer
  completed); a GPU cannot alias host memory, so the array is copied on PjRt's transfer thread instead;
- a host range registered with the client (`Client.dma_map`, page-locking it for the device) is not staged at
  all: with `may_alias=True` the DMA reads the buffer itself. The CPU client does not implement `dma_map`.

`Staging` owns the buffers the feeder gathers into and stages from. With `pinned` (EngramConfig.pinned_staging)
it registers each buffer it allocates once (`dma_map`, one page-aligned allocation per layer, so that every
transfer starts where a registered range starts) and the feeder puts them with `alias` True: no host copy
between the gather and the DMA.
Where a GPU client cannot register memory (a failed probe) it says so once in the log and the buffers are plain
but still put with `alias` (the staging copy then runs on PjRt's thread, not the caller's); on the CPU backend
(nothing to speed up, and its client may alias a numpy buffer) plain buffers and copies: today's path, unchanged.

Invariants: a buffer set is handed out by `get` only when no transfer reads it: `recycle(bufs, arrays)` returns it
only after every device array made from it is ready (the device copy completed; on the caller's worker thread);
a registered buffer is unregistered (`dma_unmap`) when its numpy memory is freed (a weakref finalizer on the
allocation, which every view keeps alive, runs before numpy frees the memory); at most `per_shape` free sets are
kept a shape.
"""

from __future__ import annotations

import logging
import threading
import weakref

import numpy as np

log = logging.getLogger(__name__)
PAGE = 4096
_said = set()  # fallback reasons already logged (once a process)


def _say_once(msg: str, level: int = logging.WARNING):
    if msg not in _said:
        _said.add(msg)
        log.log(level, msg)


def _client_mapper():
    """(dma_map, dma_unmap) of the default backend's client, or a reason why there is none."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None, "the CPU backend has no device copy to speed up"
    client = dev.client
    if not hasattr(client, "dma_map"):
        return None, f"jax {jax.__version__}'s client has no dma_map"
    probe = _aligned(PAGE)
    try:
        client.dma_map(probe.ctypes.data, PAGE)
        client.dma_unmap(probe.ctypes.data)
    except Exception as e:  # noqa: BLE001 - any failure: fall back
        return None, f"dma_map failed on {dev.platform}: {e}"
    return (client.dma_map, client.dma_unmap), None


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array of nbytes (a view of a slightly larger allocation)."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + nbytes]


class Staging:
    """Buffer sets (one [shape] uint8 array per Engram layer) for the feeder (module
    docstring). `mapper`: (dma_map, dma_unmap) to use instead of the client's (tests); `pinned` False: plain
    buffers and copies."""

    def __init__(self, n_layers: int, pinned: bool, mapper=None, per_shape: int = 4):
        self.n_layers, self.per_shape = n_layers, per_shape
        self.free: dict[tuple, list] = {}
        self.lock = threading.Lock()
        self.registered = 0  # buffers registered so far
        self.mapper, why = (mapper, None) if mapper is not None or not pinned else _client_mapper()
        self.alias = self.mapper is not None  # put with may_alias=True: buffers unchanged until copied
        if pinned and self.mapper is None:
            import jax

            self.alias = jax.default_backend() != "cpu"
            # expected on the CPU backend (the default is on): said at INFO there, a WARNING on a GPU
            _say_once(f"Engram pinned staging unavailable ({why}): host rows are "
                      + ("staged by device_put on its own thread" if self.alias else "copied by device_put as before"),
                      logging.WARNING if self.alias else logging.INFO)

    @property
    def mapped(self) -> bool:
        """Buffers are registered with the device client: the transfer reads them directly (no host copy)."""
        return self.mapper is not None

    def get(self, shape: tuple) -> list[np.ndarray]:
        """A buffer set of `shape` per layer that no transfer reads (contents arbitrary)."""
        with self.lock:
            lst = self.free.get(shape)
            if lst:
                return lst.pop()
        return self._new(shape)

    def _new(self, shape: tuple) -> list[np.ndarray]:
        if self.mapper is None:
            return [np.empty(shape, np.uint8) for _ in range(self.n_layers)]
        return [self._registered(shape) for _ in range(self.n_layers)]

    def _registered(self, shape: tuple) -> np.ndarray:
        """One page-aligned buffer registered on its own: every transfer starts at a registered range's start
        (some clients look a transfer's range up by its start pointer)."""
        size = max(int(np.prod(shape)), 1)
        slab = _aligned(size)
        dma_map, dma_unmap = self.mapper
        dma_map(slab.ctypes.data, size)
        fin = weakref.finalize(slab.base, dma_unmap, slab.ctypes.data)  # the allocation every view keeps alive
        fin.atexit = False  # at exit the client may be gone; the process's memory goes with it
        self.registered += 1
        return slab[:int(np.prod(shape))].reshape(shape)

    def recycle(self, bufs: list[np.ndarray], arrays=()):
        """Return a buffer set once every device array copied from it is ready (blocks: call on a worker)."""
        for a in arrays:
            a.block_until_ready()  # the transfer has read the host buffer
        shape = bufs[0].shape
        with self.lock:
            lst = self.free.setdefault(shape, [])
            if len(lst) < self.per_shape:
                lst.append(bufs)
