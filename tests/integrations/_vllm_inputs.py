"""vLLM's own prefill metadata objects and MLA inputs laid out as vLLM builds them.

Imported only by test modules that have already skipped where vLLM is missing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonPrefillMetadata,
    build_mla_chunked_context_metadata,
)

HEADS, NOPE, ROPE, V, KV_LORA_RANK = 8, 128, 64, 128, 512
SCALE = (NOPE + ROPE) ** -0.5
#: Per dtype: (atol, rtol) for the output, and atol for the float32 LSE.
TOLERANCE = {torch.float32: (1e-4, 1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1.6e-2, 1e-3)}


def backend_kwargs() -> dict[str, Any]:
    """The constructor arguments vLLM's ``MLAAttention`` passes (no ``VllmConfig`` needed)."""
    return {"num_heads": HEADS, "scale": SCALE, "kv_lora_rank": KV_LORA_RANK,
            "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V,
            "vllm_config": None}


def prefill_metadata(query_lens: Sequence[int], context_lens: Sequence[int] | None = None, *,
                     workspace_rows: int = 128, block_size: int = 16,
                     host_query_lens: bool = True) -> MLACommonPrefillMetadata:
    """vLLM's ``MLACommonPrefillMetadata`` for these prefills, its context chunks planned by
    vLLM's own ``build_mla_chunked_context_metadata`` (a workspace of ``workspace_rows``)."""
    start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    chunked = None
    if context_lens is not None:
        chunked = build_mla_chunked_context_metadata(
            context_lens_cpu=torch.tensor(context_lens, dtype=torch.int32),
            prefill_query_start_loc_cpu=start_loc,
            chunked_prefill_workspace=torch.empty(workspace_rows, KV_LORA_RANK + ROPE),
            chunked_prefill_workspace_size=workspace_rows, block_size=block_size,
            align_chunk_to_block=True, device=torch.device("cpu"), dcp_world_size=1,
            dcp_local_block_size=1, dcp_virtual_block_size=1)
    return MLACommonPrefillMetadata(
        block_table=torch.zeros(len(query_lens), 1, dtype=torch.int32),
        query_start_loc=start_loc, max_query_len=max(query_lens), chunked_context=chunked,
        query_lens_cpu=(start_loc[1:] - start_loc[:-1]) if host_query_lens else None)


def mla_qkv(tokens: int, dtype: torch.dtype, generator: torch.Generator, *,
            with_q: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``q [T, H, 192]``, ``k [T, H, 192]`` (per-head nope + a shared rope part, as vLLM's
    ``_concat_k_nope_k_pe`` builds it) and ``v [T, H, 128]`` (a split view of ``kv_nope``, not
    contiguous, as vLLM passes it)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q = rand(tokens, HEADS, NOPE + ROPE) if with_q else None
    kv_nope = rand(tokens, HEADS, NOPE + V)
    k_pe = rand(tokens, 1, ROPE)
    k_nope, v = kv_nope.split([NOPE, V], dim=-1)
    k = torch.empty(tokens, HEADS, NOPE + ROPE, dtype=dtype)
    k[..., :NOPE] = k_nope
    k[..., NOPE:] = k_pe
    return q, k, v
