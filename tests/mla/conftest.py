"""Shared helpers of the engine tests: a tiny random DeepSeek model, run fast on the CPU."""

from __future__ import annotations

import torch

from app.config import EngineConfig
from app.containers import Application, create_container
from app.mla.engine import MLAEngine
from app.model import ModelWeights
from tests.model.conftest import BLOCK, TINY, TOL, VOCAB, tiny_model

__all__ = ["BLOCK", "TINY", "TOL", "VOCAB", "tiny_config", "tiny_container", "tiny_engine"]


def tiny_config(dtype: str = "float32", num_blocks: int = 256, chunk_tokens: int = 65536,
                block_size: int = BLOCK, prefix_caching: bool = True, layers: int = 1
                ) -> tuple[EngineConfig, ModelWeights]:
    """An ``EngineConfig`` of the tiny random model, and its weights (seed 0)."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    arch, weights = tiny_model(torch_dtype, layers=layers)
    config = EngineConfig.from_dict({
        "attention": {"context_chunk_tokens": chunk_tokens},
        "cache": {"block_size": block_size, "num_blocks": num_blocks,
                  "enable_prefix_caching": prefix_caching}})
    return EngineConfig(model=arch.model_config(torch_dtype), attention=config.attention,
                        cache=config.cache), weights


def tiny_container(config: EngineConfig) -> Application:
    """A fresh container for ``config`` (CPU)."""
    return create_container(config)


def tiny_engine(step_tokens: int = 64, layers: int = 1, spec: int = 0,
                **config: object) -> MLAEngine:
    """An engine over the tiny random model."""
    cfg, weights = tiny_config(layers=layers, **config)  # type: ignore[arg-type]
    return MLAEngine(tiny_container(cfg), weights=weights, step_tokens=step_tokens,
                     num_speculative_tokens=spec)
