"""Shared helpers of the model tests: a tiny random DeepSeek model, run fast on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from app.backends.prefill.base import MLAPrefillBackend
from app.config import EngineConfig, ModelConfig
from app.containers import create_container
from app.model import (
    DeepseekConfig,
    MLAAttention,
    MLAPrefillExecutor,
    ModelWeights,
    PagedLatentCache,
    PrefillSlice,
    RotaryEmbedding,
    random_config,
    random_weights,
    reference_attention,
)

#: A tiny DeepSeek-shaped attention: the same structure, small enough for fast tests.
TINY = {"num_heads": 2, "hidden_size": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16}
BLOCK = 4
VOCAB = 97
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def tiny_arch(dtype: torch.dtype = torch.float32, layers: int = 1, moe: bool = True
              ) -> DeepseekConfig:
    """The random model's architecture at the tiny dims."""
    return random_config(ModelConfig(dtype=dtype, **TINY), num_layers=layers,
                         vocab_size=VOCAB, moe=moe)


def tiny_model(dtype: torch.dtype = torch.float32, layers: int = 1, seed: int = 0,
               moe: bool = True) -> tuple[DeepseekConfig, ModelWeights]:
    """A tiny random model and its weights."""
    arch = tiny_arch(dtype, layers, moe)
    return arch, random_weights(arch, dtype, seed)


class Harness:
    """The prefill executor over layer 0 of a tiny model, block tables handed out by hand."""

    def __init__(self, dtype: torch.dtype = torch.float32, chunk_tokens: int = 65536,
                 seed: int = 0) -> None:
        arch, weights = tiny_model(dtype, seed=seed)
        config = EngineConfig(model=arch.model_config(dtype))
        backend = create_container(config).mla_prefill_backend()
        assert isinstance(backend, MLAPrefillBackend)
        self.dtype = dtype
        self.arch = arch
        self.weights = weights
        rope = RotaryEmbedding(arch.rope, arch.qk_rope_head_dim, dtype, torch.device("cpu"))
        self.layer = MLAAttention(arch, weights.layers[0].attention, dtype=dtype,
                                  compute_dtype=dtype, device=torch.device("cpu"), rope=rope)
        self.cache = PagedLatentCache(512, BLOCK, self.layer.latent_dim, dtype)
        self.executor = MLAPrefillExecutor(self.layer, self.cache, backend, chunk_tokens)
        self._next_block = 1
        self._gen = torch.Generator().manual_seed(seed + 1)

    def lookup(self, tokens: Sequence[int]) -> torch.Tensor:
        """The layer inputs of ``tokens``: embedding rows in the model dtype."""
        return self.weights.embed_tokens[torch.tensor(list(tokens))]

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
        x = torch.cat([self.lookup(t[c:c + n]) for t, _, c, n in items])
        out = self.executor.forward(x, [PrefillSlice(table, c, n) for _, table, c, n in items])
        return list(torch.split(out, [n for _, _, _, n in items]))

    def reference(self, tokens: list[int], start: int) -> torch.Tensor:
        """Reference rows ``start:`` of the whole sequence."""
        return reference_attention(self.arch, self.weights.layers[0].attention,
                                   self.lookup(tokens), start)

    def error(self, got: torch.Tensor, tokens: list[int], start: int) -> float:
        """Max abs error relative to the reference's scale."""
        ref = self.reference(tokens, start)
        return float((got.double() - ref).abs().max() / ref.abs().max())


@pytest.fixture
def harness() -> Harness:
    """A float32 harness with the default (large) chunk bound."""
    return Harness()
