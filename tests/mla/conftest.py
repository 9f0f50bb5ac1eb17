"""Shared helpers of the MLA executor and engine tests: a tiny layer, run fast on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from app.backends.prefill.base import MLAPrefillBackend
from app.config import EngineConfig, ModelConfig
from app.containers import Application, create_container
from app.mla.cache import PagedLatentCache
from app.mla.executor import MLAPrefillExecutor, PrefillSlice
from app.mla.layer import MLALayer, MLALayerWeights, TokenEmbedding
from app.mla.reference import reference_forward
from app.seed_api import get_mla_prefill_backend

#: A tiny DeepSeek-shaped layer: the same structure, small enough for fast tests.
TINY = {"num_heads": 2, "hidden_size": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16}
BLOCK = 4
VOCAB = 97
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def tiny_config(dtype: str = "float32", num_blocks: int = 256, chunk_tokens: int = 65536,
                block_size: int = BLOCK, prefix_caching: bool = True) -> EngineConfig:
    """An ``EngineConfig`` of the tiny layer."""
    return EngineConfig.from_dict({
        "model": {**TINY, "dtype": dtype},
        "attention": {"context_chunk_tokens": chunk_tokens},
        "cache": {"block_size": block_size, "num_blocks": num_blocks,
                  "enable_prefix_caching": prefix_caching}})


def tiny_container(config: EngineConfig) -> Application:
    """A fresh container for ``config`` (CPU)."""
    return create_container(config)


class Harness:
    """The executor over the tiny layer, with block tables handed out by hand."""

    def __init__(self, dtype: torch.dtype = torch.float32, chunk_tokens: int = 65536,
                 seed: int = 0) -> None:
        model = ModelConfig(dtype=dtype, **TINY)
        config = EngineConfig(model=model)
        container = tiny_container(config)
        backend_cls: type[MLAPrefillBackend] = get_mla_prefill_backend(config,
                                                                       container=container)
        self.dtype = dtype
        self.weights = MLALayerWeights.generate(model, seed)
        self.embedding = TokenEmbedding.generate(VOCAB, model.hidden_size, dtype, seed)
        self.layer = MLALayer(self.weights)
        self.cache = PagedLatentCache(512, BLOCK, self.layer.latent_dim, dtype)
        self.executor = MLAPrefillExecutor(self.layer, self.cache,
                                           backend_cls.from_config(config), chunk_tokens)
        self._next_block = 1
        self._gen = torch.Generator().manual_seed(seed + 1)

    def tokens(self, n: int) -> list[int]:
        """``n`` random token ids."""
        return torch.randint(0, VOCAB, (n,), generator=self._gen).tolist()

    def blocks(self, n_tokens: int, shared: Sequence[int] = ()) -> torch.Tensor:
        """A block table for ``n_tokens`` starting with the ``shared`` block ids."""
        need = -(-n_tokens // BLOCK) - len(shared)
        ids = list(shared) + list(range(self._next_block, self._next_block + need))
        self._next_block += need
        return torch.tensor(ids, dtype=torch.int64)

    def step(self, items: Sequence[tuple[list[int], torch.Tensor, int, int]]
             ) -> list[torch.Tensor]:
        """One executor step over ``(tokens, table, context, new)`` items; per-item outputs."""
        x = torch.cat([self.embedding.lookup(torch.tensor(t[c:c + n]), self.dtype)
                       for t, _, c, n in items])
        out = self.executor.forward(x, [PrefillSlice(table, c, n) for _, table, c, n in items])
        sizes = [n for _, _, _, n in items]
        return list(torch.split(out, sizes))

    def reference(self, tokens: list[int], start: int) -> torch.Tensor:
        """Reference rows ``start:`` of the whole sequence."""
        return reference_forward(self.weights, self.embedding.lookup(torch.tensor(tokens)),
                                 start)

    def error(self, got: torch.Tensor, tokens: list[int], start: int) -> float:
        """Max abs error relative to the reference's scale."""
        ref = self.reference(tokens, start)
        return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.fixture
def harness() -> Harness:
    """A float32 harness with the default (large) chunk bound."""
    return Harness()
