"""Lightning indexer over paged FP4 index keys: the Pallas kernel and its jnp reference (see kernel.py; the
candidate-block and top-k selections on its scores are the model's, dsv41_jax.attention)."""

from pallas_kernels.indexer.kernel import (
    gather_index_keys,
    index_scores_paged,
    ref_index_scores_paged,
    score_keys,
)
from pallas_kernels.indexer.operands import IndexerOperands, PagedIndexKV

__all__ = ["IndexerOperands", "PagedIndexKV", "gather_index_keys", "index_scores_paged", "ref_index_scores_paged",
           "score_keys"]
