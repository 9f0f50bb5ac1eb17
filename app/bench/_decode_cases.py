"""The decode benchmark's cases and their inputs (``bench decode`` and its vLLM comparison).

Absorbed MLA decode over a paged latent cache: ``kv_lora_rank`` 512 + rope 64, one KV head,
pages handed out in a random (seeded) order, every request ``context`` tokens long including
the step's ``query_len`` new ones.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["OMP_SETTLE_S", "RANK", "ROPE", "Case", "Step", "default_cases", "make_step"]

RANK, ROPE = 512, 64
#: Seconds to wait after a call that ran on OpenMP threads (torch ops, vLLM's kernel) before
#: the next timed call: they spin for milliseconds after a parallel region, and a CPU_MLA call
#: timed right after a torch op measured 1.6x slower on a 2-core machine.
OMP_SETTLE_S = 0.03


@attrs.frozen
class Case:
    """One decode step: ``batch`` requests of ``context`` tokens (incl. the new ones)."""

    name: str
    batch: int
    context: int
    heads: int = 16
    query_len: int = 1

    def flops(self) -> float:
        """``2 * (2 * rank + rope) * H`` per (query row, visible key), causal in the step."""
        seen = sum(self.context - self.query_len + i + 1 for i in range(self.query_len))
        return 2.0 * (2 * RANK + ROPE) * self.heads * self.batch * seen

    def cache_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of cache the step reads (every request's rows once)."""
        return self.batch * self.context * (RANK + ROPE) * dtype.itemsize


def default_cases(quick: bool) -> list[Case]:
    """The issue's cases, or small ones with ``quick``."""
    if quick:
        return [Case("1x2k", 1, 2048), Case("4x512", 4, 512), Case("4x512 q4", 4, 512,
                                                                     query_len=4)]
    return [Case("1x32k", 1, 32768), Case("16x8k", 16, 8192), Case("64x4k", 64, 4096),
            Case("64x4k q4", 64, 4096, query_len=4), Case("16x8k h128", 16, 8192, heads=128)]


@attrs.frozen
class Step:
    """A case's inputs: ``block_table`` int32 ``[B, W]``, ``seq_lens`` int32 ``[B]``,
    ``q [B, query_len, H, 576]`` and ``cache [num_blocks, block_size, 576]`` of one dtype."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor
    cache: torch.Tensor


def make_step(case: Case, block_size: int, device: torch.device,
              dtype: torch.dtype = torch.bfloat16) -> Step:
    """The case's step: seeded random latents and queries, pages in a random order."""
    gen = torch.Generator().manual_seed(0)
    per = -(-case.context // block_size)
    blocks = case.batch * per
    table = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(case.batch, per)
    cache = torch.randn(blocks, block_size, RANK + ROPE, generator=gen).to(device, dtype)
    q = torch.randn(case.batch, case.query_len, case.heads, RANK + ROPE,
                    generator=gen).to(device, dtype)
    return Step(table.to(device), torch.full((case.batch,), case.context, dtype=torch.int32,
                                             device=device), q, cache)
