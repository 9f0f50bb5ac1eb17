"""TORCH_SDPA decode: absorbed MLA decode in plain torch, on any device (fallback and baseline).

Per request it gathers the pages the request reads (``index_select`` through the block
table: pages in any order, shared or not; rows past ``seq_len`` are sliced off before any
math), then runs matmul -> softmax -> matmul in float32. FP8 caches (``fp8`` / ``fp8_e4m3``,
``fp8_ds_mla``: ``app.kvcache.cache_dtypes``) are dequantised to float32 as they are gathered
(exact: e4m3 times a power-of-two scale, or times vLLM's ``amax / 448``, is computed in
float32), so this is the reference the CPU kernel's FP8 paths are checked against.
Memory per call is one request's context in float32 (``seq_len * (kv_lora_rank +
qk_rope_head_dim) * 4`` bytes), released before the next request: fine for a fallback, and the
reason the native CPU kernel exists.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.kvcache.cache_dtypes import dequantize_fp8_ds_mla

__all__ = ["TorchSDPADecodeBackend", "decode_one_request"]


def decode_one_request(q: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int,
                       scale: float, value_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of one request in float32.

    ``q [query_len, H, D]`` and ``latent [seq_len, D]`` (any float dtype, ``D = kv_lora_rank +
    qk_rope_head_dim``, ``seq_len >= query_len``). Query row ``i`` sees keys ``[0, seq_len -
    query_len + i]``. Returns ``(out [query_len, H, kv_lora_rank], lse [query_len, H])``, both
    float32; logits are ``scale * (q . k)`` and the output is ``value_scale * sum(p * v)``.
    """
    qlen, heads, dim = q.shape
    seq_len = int(latent.shape[0])
    kv = latent.to(torch.float32)
    qf = q.to(torch.float32).reshape(qlen * heads, dim)
    scores = torch.matmul(qf, kv.t()).mul_(scale).view(qlen, heads, seq_len)
    shared = seq_len - qlen + 1                     # keys every query row sees
    if qlen > 1:
        key = torch.arange(seq_len, device=q.device)
        last = torch.arange(qlen, device=q.device) + (shared - 1)
        scores.masked_fill_((key.view(1, 1, -1) > last.view(-1, 1, 1)), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)           # [Q, H]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    values = kv[:, :kv_lora_rank]
    out = torch.matmul(probs[..., :shared].reshape(qlen * heads, shared),
                       values[:shared]).view(qlen, heads, kv_lora_rank)
    if qlen > 1:
        # The step's own keys are hidden from earlier rows: p = 0 there, but 0 * NaN is NaN,
        # so a non-finite value in a hidden key must be dropped, not multiplied by 0.
        tail_p = probs[..., shared:]                # [Q, H, Q-1]
        row = torch.arange(qlen, device=q.device).view(-1, 1, 1)
        visible = torch.arange(qlen - 1, device=q.device).view(1, 1, -1) < row
        terms = tail_p.unsqueeze(-1) * values[shared:].view(1, 1, qlen - 1, -1)
        out += torch.where(visible.unsqueeze(-1), terms, 0.0).sum(dim=2)
    return out.mul_(value_scale), lse


class TorchSDPADecodeBackend(MLADecodeBackend):
    """Absorbed MLA decode in plain torch: any device, any block size, fp16/bf16/fp32 caches.

    Gathers each request's pages (no copy of the whole cache), computes in float32 and writes
    ``out [B, query_len, H, kv_lora_rank]`` in q's dtype and the natural-log LSE."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float16, torch.bfloat16, torch.float32)
    #: Every cache dtype: FP8 rows are dequantised to float32 as they are gathered.
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "fp8", "fp8_e4m3", "fp8_ds_mla")

    @classmethod
    def kernel_path(cls, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
        """On a CPU: float32 torch matmuls whatever the model and cache dtypes (no bf16 unit,
        AMX tiles or AVX512-BF16, is used: the gathered pages are converted to float32
        first; an FP8 cache's rows dequantised)."""
        name = (str(dtype).removeprefix("torch.") if kv_cache_dtype == "auto"
                else f"{kv_cache_dtype} rows")
        return ("float32 torch matmuls (oneDNN's float32 GEMM; the gathered pages converted "
                f"from {name}: neither AMX tiles nor AVX512-BF16 products are used)"
                if name != "float32" else "float32 torch matmuls (oneDNN's float32 GEMM)")

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        block_size = int(kv_cache.shape[1])
        block_table, _ = metadata.on_device(q.device)
        for b, seq_len in enumerate(metadata.seq_lens_list):
            blocks = block_table[b, :-(-seq_len // block_size)].to(torch.long)
            latent = kv_cache.index_select(0, blocks).reshape(
                -1, self.kv_cache_row_width)[:seq_len]
            if self.kv_cache_format == "fp8_ds_mla":
                latent = dequantize_fp8_ds_mla(latent, self.kv_lora_rank, self.qk_rope_head_dim)
            o, lg = decode_one_request(q[b], latent, self.kv_lora_rank,
                                       softmax_scale * k_scale, k_scale)
            out[b].copy_(o)
            if lse is not None:
                lse[b].copy_(lg)
