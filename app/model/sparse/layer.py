"""The engine side of one layer's lightning indexer: its query, key and per-head weights.

Per token (``x`` the layer's normed input, ``q_resid = RMSNorm(q_a_proj x)`` the MLA's q LoRA
residual): ``q = wq_b q_resid`` as ``index_n_heads`` heads of ``index_head_dim``; ``k =
LayerNorm(wk x)`` (weight and bias, eps 1e-6); the first ``qk_rope_head_dim`` values of each
head and of the key roped with the model's rope tables (halves for DeepSeek-V3.2, adjacent pairs
for GLM-5); ``weights = weights_proj x`` in float32 times ``IndexerConfig.weights_scale``. The
key goes to the layer's paged key cache (model dtype); ``app.backends.sparse.SparseIndexer``
scores the queries against the cached keys and keeps the top-k. Projections run in the compute
dtype and are rounded to the model dtype where transformers holds them in it (q, k), as
``MLAAttention`` does.
"""

from __future__ import annotations

import torch

from app.model.linear import Linear
from app.model.rope import RotaryEmbedding, apply_rope
from app.model.sparse.config import IndexerConfig
from app.model.sparse.weights import IndexerWeights

__all__ = ["INDEXER_NORM_EPS", "LayerIndexer"]

#: The key LayerNorm's epsilon (transformers' ``nn.LayerNorm(index_head_dim, eps=1e-6)``).
INDEXER_NORM_EPS = 1e-6


class LayerIndexer:
    """One layer's indexer projections on ``device`` (see the module docstring)."""

    def __init__(self, config: IndexerConfig, weights: IndexerWeights, *, rope_dim: int,
                 rope: RotaryEmbedding, dtype: torch.dtype, compute_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.rope_dim = rope_dim
        self.rope = rope
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.device = device
        self.heads, self.head_dim = config.index_n_heads, config.index_head_dim
        cd = compute_dtype
        self._wq_b = Linear(weights.wq_b.to(device=device, dtype=cd))
        self._wk = Linear(weights.wk.to(device=device, dtype=cd))
        self._norm_weight = weights.k_norm_weight.to(device=device, dtype=torch.float32)
        self._norm_bias = weights.k_norm_bias.to(device=device, dtype=torch.float32)
        self._weights_proj = weights.weights_proj.to(device=device, dtype=torch.float32)

    def linears(self) -> list[Linear]:
        """The indexer's matmuls in the compute dtype (``weights_proj`` runs in float32)."""
        return [self._wq_b, self._wk]

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                max_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D]`` (normed), ``q_resid [T, Q]``, ``positions [T]`` int64 ->
        ``q [T, Hi, Di]`` and ``k [T, Di]`` in the model dtype (roped), ``weights [T, Hi]``
        float32 (scales folded in)."""
        t, r = x.shape[0], self.rope_dim
        xc = x.to(self.compute_dtype)
        q = self._wq_b(q_resid.to(self.compute_dtype)).view(t, self.heads, self.head_dim)
        k = torch.nn.functional.layer_norm(
            self._wk(xc).float(), (self.head_dim,), self._norm_weight, self._norm_bias,
            INDEXER_NORM_EPS).to(self.compute_dtype)
        if r:
            cos, sin = self.rope.cos_sin(positions, max_position)
            interleaved = self.config.rope_interleave
            q = torch.cat([apply_rope(q[..., :r], cos, sin, interleaved), q[..., r:]], dim=-1)
            k = torch.cat([apply_rope(k[:, :r], cos, sin, interleaved), k[:, r:]], dim=-1)
        weights = torch.nn.functional.linear(x.float(), self._weights_proj)
        return (q.to(self.dtype), k.to(self.dtype),
                weights.mul_(self.config.weights_scale))
