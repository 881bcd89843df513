"""Batches for the trainer: random windows of the corpus token files (`training.code_corpus`), Engram rows
hashed on the host, made by background threads and placed on the devices sharded over the batch axis.

A batch is (tokens [B,T] int32, engram ids [B,T,E,cols] int32 or None, targets [B,T] int32, mask [B,T] f32),
each sharded `P("data")` over a 1-D mesh of all local devices (data parallel; one device on an H200), so the
jitted step runs as SPMD with replicated weights and a gradient all-reduce that XLA inserts. Windows start
anywhere in the training stream (short phases) or at document starts chosen in proportion to the document's
length (long phases, so an 8K window mostly holds one long file); a window that runs past the stream's end
wraps around. Each thread has its own seeded generator (seed, phase, thread), so a run is reproducible up to
the order in which threads deliver.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from training import objective as T


class TokenFile:
    """One split: the flat uint16 stream (memory-mapped) and its document starts."""

    def __init__(self, directory: Path, name: str):
        d = Path(directory)
        self.tokens = np.fromfile(d / f"{name}.bin", dtype=np.uint16)
        self.starts = np.load(d / f"{name}.idx.npy")
        lens = np.diff(np.append(self.starts, len(self.tokens)))
        self.lens = lens
        self.weights = lens / max(lens.sum(), 1)

    def __len__(self):
        return len(self.tokens)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.starts[i]: self.starts[i] + self.lens[i]].astype(np.int32)

    def sample(self, rng, batch: int, length: int, long: bool) -> np.ndarray:
        """[batch, length + 1] int32 windows."""
        n = len(self.tokens)
        if long:
            starts = self.starts[rng.choice(len(self.starts), batch, p=self.weights)]
        else:
            starts = rng.integers(0, n, batch)
        idx = (starts[:, None] + np.arange(length + 1)[None]) % n
        return self.tokens[idx].astype(np.int32)


def data_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()), ("data",))


def host_batch(cfg, hasher, win: np.ndarray, mask: np.ndarray | None = None):
    tokens = np.ascontiguousarray(win[:, :-1])
    targets = np.ascontiguousarray(win[:, 1:])
    mask = np.ones(targets.shape, np.float32) if mask is None else mask.astype(np.float32)
    return tokens, T.host_engram_ids(cfg, hasher, tokens), targets, mask


def shard(mesh: Mesh, batch):
    s = NamedSharding(mesh, P("data"))
    return tuple(None if x is None else jax.device_put(x, s) for x in batch)


class Prefetch:
    """`threads` workers keep up to `depth` device-resident batches of one (B, T) shape ready."""

    def __init__(self, data: TokenFile, cfg, hasher, mesh, shape: tuple[int, int], long: bool, seed: int,
                 threads: int = 3, depth: int = 6):
        self.q = queue.Queue(depth)
        self.stop = False
        self.threads = []
        b, t = shape
        if b % mesh.size:
            raise ValueError(f"batch {b} does not split over {mesh.size} devices")
        for i in range(threads):
            rng = np.random.default_rng([seed, b * t, int(long), i])

            def run(rng=rng):
                while not self.stop:
                    item = shard(mesh, host_batch(cfg, hasher, data.sample(rng, b, t, long)))
                    while not self.stop:
                        try:
                            self.q.put(item, timeout=0.2)
                            break
                        except queue.Full:
                            continue

            th = threading.Thread(target=run, daemon=True)
            th.start()
            self.threads.append(th)

    def get(self):
        return self.q.get()

    def close(self):
        self.stop = True
        for th in self.threads:
            th.join(timeout=5)
