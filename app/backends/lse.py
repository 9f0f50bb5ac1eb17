"""Log-sum-exp conventions: every backend hands out ``[H, T]`` float32 natural-log LSE.

Kernels write base 2 (FlashInfer, TRT-LLM) or natural log, ``[T, H]`` or ``[H, T]``;
``lse_rows_to_heads_tokens`` converts any of those to the contract's layout and base.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LN2", "LOG2E", "lse_rows_to_heads_tokens"]

#: ``ln(2)``: multiply a base-2 LSE by it to get natural log.
LN2 = math.log(2.0)
#: ``log2(e)``: multiply a natural-log LSE by it to get base 2.
LOG2E = 1.0 / LN2


def lse_rows_to_heads_tokens(lse: torch.Tensor, num_heads: int, total_q: int, *,
                             tokens_first: bool, base2: bool,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """A kernel's LSE, ``[T, H]`` (``tokens_first``) or ``[H, T]``, as the contract's
    contiguous ``[H, T]`` float32 natural-log LSE (``base2``: multiplied by ``ln 2``)."""
    want = (total_q, num_heads) if tokens_first else (num_heads, total_q)
    if tuple(lse.shape) != want:
        raise ValueError(f"kernel LSE shape: expected {list(want)}, got {list(lse.shape)}")
    src = lse.t() if tokens_first else lse
    if out is None:
        out = torch.empty(num_heads, total_q, dtype=torch.float32, device=lse.device)
    if base2:
        torch.mul(src, LN2, out=out)
    elif src.data_ptr() != out.data_ptr() or src.stride() != out.stride():
        out.copy_(src)
    return out
