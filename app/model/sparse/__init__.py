"""DeepSeek Sparse Attention in the model: DeepSeek-V3.2 (``deepseek_v32``) and GLM-5
(``glm_moe_dsa``).

- ``config``: the indexer in a ``config.json`` (``IndexerConfig``, ``read_indexer``).
- ``weights``: its tensors (``IndexerWeights``).
- ``layer``: its projections on the engine's device (``LayerIndexer``).
- ``executors``: the sparse MLA layer over the paged caches, prefill and decode
  (``SparseMLAExecutor``, the plans with the indexer's layout).
- ``kv_spec``: its key cache as a KV-cache spec (``IndexerKeyCacheSpec``), bound through the
  spec registry, in the latent layers' KV-cache group.
- ``reference``: the indexer in float64 for ``ReferenceModel``.

The public names are re-exported by ``app.model``.
"""

# Nothing is imported here: ``app.model.config`` reads ``app.model.sparse.config`` while
# ``app.model`` itself is still being imported. ``app.model`` re-exports the public names.
__all__: list[str] = []
