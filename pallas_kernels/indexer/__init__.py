"""Lightning indexer over paged FP4 index keys: the Pallas kernel, its jnp reference, and the candidate-block
and top-k selections built on its scores (see kernel.py)."""

from pallas_kernels.indexer.kernel import (
    candidate_block_ids,
    gather_index_keys,
    index_scores_paged,
    ref_index_scores_paged,
    score_keys,
    select_topk_entries,
)

__all__ = ["candidate_block_ids", "gather_index_keys", "index_scores_paged", "ref_index_scores_paged",
           "score_keys", "select_topk_entries"]
