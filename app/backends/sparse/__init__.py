"""DeepSeek Sparse Attention's pieces both backend kinds share: the index checks, the torch
reference of sparse attention over selected latent rows, and the lightning indexer (its contract
and a torch implementation). See each module's docstring; the kinds' ``run_sparse_decode`` /
``run_sparse_prefill`` verbs are the attention contract."""

from app.backends.sparse.attention import GATHER_BUDGET, sparse_attention_rows
from app.backends.sparse.checks import check_sparse_indices, check_sparse_rows
from app.backends.sparse.indexer import (
    SCORE_BUDGET,
    SparseIndexer,
    SparseIndexerMetadata,
    TorchSparseIndexer,
)

__all__ = ["GATHER_BUDGET", "SCORE_BUDGET", "SparseIndexer", "SparseIndexerMetadata",
           "TorchSparseIndexer", "check_sparse_indices", "check_sparse_rows",
           "sparse_attention_rows"]
