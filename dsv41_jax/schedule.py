"""The static layer schedule: how the 40 layers are grouped so that layers of one kind run under lax.scan.

A *group* is a first layer (SWA-only, KV source "src", index source "idx", or a reuse layer that carries an
Engram) followed by the reuse layers that read its KV / top-k. A *segment* is a run of consecutive groups
with the same signature; it runs as one lax.scan over its groups (each group body runs its first layer and
then a nested lax.scan over its reuse layers), so compile time grows with the number of distinct segments
(6 for V4.1-Flash), not with the 40 layers. Segments break at Engram layers (the Engram lookup runs just
before the segment) and at the encoder/decoder boundary (the CED split).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41_jax.config import KIND_IDX, KIND_REUSE, KIND_SRC, ModelConfig
from dsv41_jax.params import source_slots


@dataclass(frozen=True)
class Segment:
    kind: str  # kind of each group's first layer
    ratio: int
    n_reuse: int
    cand_source: bool  # the first layer is the candidate source (layer 20)
    uses_cand: bool  # the first layer scores inside the candidate blocks (Reindex)
    prebuilt: bool  # the first layer's KV was built by the encoder (decoder's layer 20)
    firsts: tuple[int, ...]
    reuse: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]  # slot of each first layer in its src_r*/idx stack (0 when none)
    engram_slot: int  # Engram applied before this segment (-1: none)

    @property
    def is_index_source(self) -> bool:
        return self.kind in (KIND_SRC, KIND_IDX)

    @property
    def stack(self) -> str | None:
        if self.kind == KIND_SRC:
            return f"src_r{self.ratio}"
        return "idx" if self.kind == KIND_IDX else None


def build_schedule(cfg: ModelConfig, lo: int, hi: int) -> tuple[Segment, ...]:
    """Segments covering layers [lo, hi)."""
    slots, _ = source_slots(cfg)
    eng = {l: i for i, l in enumerate(cfg.engram_layer_ids)}
    groups = []  # (first, [reuse...])
    for l in range(lo, hi):
        kind = cfg.layer_kind(l)
        if kind == KIND_REUSE and groups and l not in eng:
            groups[-1][1].append(l)
        else:
            groups.append((l, []))
    segs: list[Segment] = []
    for first, reuse in groups:
        kind = cfg.layer_kind(first)
        if any(cfg.compress_ratios[r] != cfg.compress_ratios[first] for r in reuse):
            raise ValueError(f"reuse layers {reuse} must share the compress ratio of layer {first}")
        sig = dict(
            kind=kind, ratio=cfg.compress_ratios[first], n_reuse=len(reuse),
            cand_source=first == cfg.candidate_source_layer,
            uses_cand=kind == KIND_IDX and 0 <= cfg.candidate_source_layer < first,
            prebuilt=first == cfg.decoder_start and lo == cfg.decoder_start and kind == KIND_SRC,
        )
        slot = slots.get(first, (None, 0))[1]
        e = eng.get(first, -1)
        prev = segs[-1] if segs else None
        same = prev is not None and e < 0 and all(getattr(prev, k) == v for k, v in sig.items())
        if same:
            segs[-1] = Segment(**sig, firsts=prev.firsts + (first,), reuse=prev.reuse + (tuple(reuse),),
                               slots=prev.slots + (slot,), engram_slot=prev.engram_slot)
        else:
            segs.append(Segment(**sig, firsts=(first,), reuse=(tuple(reuse),), slots=(slot,), engram_slot=e))
    return tuple(segs)


def encoder_schedule(cfg: ModelConfig):
    return build_schedule(cfg, 0, cfg.decoder_start)


def decoder_schedule(cfg: ModelConfig):
    return build_schedule(cfg, cfg.decoder_start, cfg.n_layers)
