"""The generating model: a token embedding, ``N`` stacked MLA layers and a tied LM head.

``h_0 = E[tokens]``, ``h_{l+1} = layer_l(h_l)`` and ``logits = h_N @ E^T`` (the LM head is
the embedding table, tied), greedy argmax. Layer ``l``'s weights are drawn from ``seed + l``.
Every layer has its own paged latent cache; all of them share one block table (the layers form
one KV-cache group), so block ``b`` of a request is page ``b`` of every layer's cache.

Prefill runs the non-absorbed form through the prefill backend (``MLAPrefillExecutor``, one
per layer, one plan per step); decode the absorbed form through the decode backend
(``MLADecodeExecutor``). Both backend instances are built by the caller and shared by the
layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.config import EngineConfig
from app.mla.cache import PagedLatentCache
from app.mla.decode import DecodePlan, MLADecodeExecutor
from app.mla.executor import MLAPrefillExecutor, PrefillSlice
from app.mla.layer import MLALayer, MLALayerWeights, TokenEmbedding
from app.mla.profiling import NULL_TIMER, PhaseTimer

__all__ = ["MLAModel", "layer_names"]


def layer_names(num_layers: int) -> list[str]:
    """The attention layer names of the KV-cache group: ``model.layers.{i}.self_attn``."""
    return [f"model.layers.{i}.self_attn" for i in range(num_layers)]


class MLAModel:
    """Embedding, layers, caches and LM head on one device.

    ``weights`` are the layers' weights (one per layer, all of ``config.model``); the caches
    have ``num_blocks`` blocks of ``block_size`` tokens. ``compute_dtype`` is the projections'
    dtype (``default_compute_dtype``). The LM head runs in float32 whatever the model dtype.
    """

    def __init__(self, config: EngineConfig, weights: Sequence[MLALayerWeights],
                 embedding: TokenEmbedding, prefill_backend: MLAPrefillBackend,
                 decode_backend: MLADecodeBackend, *, num_blocks: int, block_size: int,
                 device: torch.device, compute_dtype: torch.dtype,
                 timer: PhaseTimer | None = None) -> None:
        if not weights:
            raise ValueError("MLAModel needs at least one layer")
        model = config.model
        self.config = config
        self.device = device
        self.dtype = model.dtype
        self.timer = timer if timer is not None else NULL_TIMER
        self.weights = list(weights)
        self.embedding = embedding
        self.layers = [MLALayer(w, device, compute_dtype=compute_dtype) for w in weights]
        self.caches = [PagedLatentCache(num_blocks, block_size, layer.latent_dim, model.dtype,
                                        device) for layer in self.layers]
        chunk = config.attention.context_chunk_tokens
        self.prefill_executors = [MLAPrefillExecutor(layer, cache, prefill_backend, chunk,
                                                     self.timer)
                                  for layer, cache in zip(self.layers, self.caches, strict=True)]
        self.decode_executors = [MLADecodeExecutor(layer, cache, decode_backend, self.timer)
                                 for layer, cache in zip(self.layers, self.caches, strict=True)]
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self._embedding_rows = embedding.table.to(device=device, dtype=model.dtype)
        # The tied LM head: E^T [hidden, vocab] in float32, laid out for ``h @ E^T``.
        self._lm_head_t = embedding.table.t().contiguous().to(device=device,
                                                              dtype=torch.float32)

    @property
    def num_layers(self) -> int:
        """Stacked layers."""
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (and of the LM head)."""
        return self.embedding.vocab_size

    @property
    def cache_bytes(self) -> int:
        """Bytes of every layer's cache storage."""
        return sum(cache.nbytes for cache in self.caches)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [T]`` int64 -> ``[T, hidden]`` in the model dtype on the device."""
        return self._embedding_rows.index_select(0, token_ids.to(self.device))

    def prefill(self, token_ids: torch.Tensor, batch: Sequence[PrefillSlice]) -> torch.Tensor:
        """A chunked-prefill step of every layer: ``token_ids [T]`` are the new tokens of
        ``batch`` (request by request). Returns the last layer's output ``[T, hidden]``."""
        first = self.prefill_executors[0]
        with self.timer.phase("metadata"):
            plan = first.plan(batch)
            if token_ids.dim() != 1 or token_ids.shape[0] != plan.metadata.total_q:
                raise ValueError(f"token_ids must be [{plan.metadata.total_q}], got "
                                 f"{list(token_ids.shape)}")
            self.prefill_backend.prepare_metadata(plan.metadata)
            h = self.embed(token_ids)
        for executor in self.prefill_executors:
            h = executor.run_planned(h, plan)
        return h

    def decode(self, token_ids: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """A decode step of every layer over a planned batch: ``token_ids [B * query_len]``
        (request-major). Returns the last layer's output ``[B * query_len, hidden]``."""
        with self.timer.phase("decode_metadata"):
            self.decode_backend.prepare_metadata(plan.block_table, plan.seq_lens,
                                                 plan.query_len)
            h = self.embed(token_ids)
        for executor in self.decode_executors:
            h = executor.run_planned(h, plan)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: ``hidden [N, hidden]`` -> float32 logits ``[N, vocab]``."""
        with self.timer.phase("lm_head"):
            return hidden.to(torch.float32) @ self._lm_head_t

    def greedy(self, hidden: torch.Tensor) -> tuple[list[int], list[float]]:
        """Greedy tokens of ``hidden [N, hidden]`` and each row's top-1 minus top-2 logit (how
        close the choice was: a margin within rounding is a near-tie)."""
        logits = self.logits(hidden)
        with self.timer.phase("sample"):
            if logits.shape[1] < 2:
                tokens = logits.argmax(dim=1)
                return tokens.tolist(), [float("inf")] * int(tokens.shape[0])
            top = torch.topk(logits, 2, dim=1)
            margins = (top.values[:, 0] - top.values[:, 1]).tolist()
            return top.indices[:, 0].tolist(), margins
