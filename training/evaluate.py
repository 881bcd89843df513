"""Scoring a served (fp8-format) parameter tree: mean NLL of windows, and bits per byte per held-out file.

One compiled program per window shape ([batch, length] with `training.objective.eval_step`); a file longer than
a window is scored in consecutive windows (each window after the first starts without the earlier context, so
the per-file numbers are slightly pessimistic for files over `length` tokens). Bits per byte of a file:
sum of its tokens' NLL (nats, the <|bos|> excluded as context, its <|end|> included) / ln 2 / its UTF-8 bytes.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from training import corpus
from training import data as D
from training import objective as T


class Evaluator:
    def __init__(self, cfg, hasher, mesh, batch: int, length: int):
        self.cfg, self.hasher, self.mesh, self.batch, self.length = cfg, hasher, mesh, batch, length
        self.fn = None

    def nll(self, params, win: np.ndarray) -> np.ndarray:
        """win [n, length+1] -> per-token NLL [n, length] (numpy)."""
        out = []
        for i in range(0, len(win), self.batch):
            w = win[i:i + self.batch]
            pad = self.batch - len(w)
            if pad:
                w = np.concatenate([w, np.full((pad, w.shape[1]), corpus.PAD, np.int32)])
            tokens, ids, targets, _ = D.shard(self.mesh, D.host_batch(self.cfg, self.hasher, w))
            if self.fn is None:
                self.fn = jax.jit(T.eval_step(self.cfg, 0)).lower(params, tokens, ids, targets).compile()
            out.append(np.asarray(self.fn(params, tokens, ids, targets)[0])[: self.batch - pad])
        return np.concatenate(out) if out else np.zeros((0, self.length))

    def windows_of(self, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A document -> ([k, length+1] windows padded with <|pad|>, [k, length] target mask)."""
        L = self.length
        k = max(1, math.ceil((len(doc) - 1) / L))
        win = np.full((k, L + 1), corpus.PAD, np.int32)
        mask = np.zeros((k, L), np.float32)
        for j in range(k):
            piece = doc[j * L: j * L + L + 1]
            win[j, :len(piece)] = piece
            mask[j, :len(piece) - 1] = 1.0
        return win, mask

    def per_file(self, params, docs: list[np.ndarray]) -> list[float]:
        """Summed NLL (nats) of each document's tokens after its first."""
        wins, masks, owner = [], [], []
        for i, d in enumerate(docs):
            w, m = self.windows_of(d)
            wins.append(w)
            masks.append(m)
            owner += [i] * len(w)
        nll = self.nll(params, np.concatenate(wins)) * np.concatenate(masks)
        sums = np.zeros(len(docs))
        np.add.at(sums, np.asarray(owner), nll.sum(1))
        return sums.tolist()


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / math.log(2) / max(n_bytes, 1)
