"""Compatibility: the names that moved to ``app.backends.kernel_base`` and
``app.backends.lse``."""

from app.backends.kernel_base import (
    KernelWorkspaces,
    RaggedKernelBackend,
    RaggedLayout,
    StepLayouts,
    check_attention_inputs,
    check_cu_seqlens,
    empty_rows_mask,
    unit_stride,
    zero_empty_rows,
)
from app.backends.lse import LN2, LOG2E, lse_rows_to_heads_tokens

__all__ = [
    "LN2",
    "LOG2E",
    "KernelWorkspaces",
    "RaggedKernelBackend",
    "RaggedLayout",
    "StepLayouts",
    "check_attention_inputs",
    "check_cu_seqlens",
    "empty_rows_mask",
    "lse_rows_to_heads_tokens",
    "unit_stride",
    "zero_empty_rows",
]
