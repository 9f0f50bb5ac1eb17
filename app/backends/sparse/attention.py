"""Sparse MLA attention over selected latent rows in plain torch: the reference both kinds'
TORCH_SPARSE backends run, and what a native kernel is compared with.

Absorbed MLA (one latent KV head of ``D = kv_lora_rank + qk_rope_head_dim`` values per token, the
first ``kv_lora_rank`` of which are also the value): query row ``t`` attends to the rows
``indices[t]`` of ``kv`` names; ``-1`` entries are padding and take no part. Each entry is one
term of the softmax: a row named twice counts twice (as FlashMLA's sparse kernels do; the indexer
never names a row twice, so a kernel need not deduplicate). A row whose entries are all padding
gets output 0 and LSE ``-inf``. NaN and inf follow the dense rule: a non-finite value in a row a
query attends to reaches that query; one in a row it does not name never does.

The rows a chunk of queries names are gathered (``[chunk, topk, D]`` float32) and attended in
float32; chunks keep that gather under ``GATHER_BUDGET`` floats whatever the step's size, so no
``[T, T]`` or ``[T, N]`` matrix is ever made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["GATHER_BUDGET", "sparse_attention_rows"]

#: Most float32 values one chunk gathers and scores at once (64 MiB).
GATHER_BUDGET = 1 << 24


def sparse_attention_rows(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                          kv_lora_rank: int, scale: float, value_scale: float = 1.0,
                          decode_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [T, H, D]`` over the rows of ``kv [N, D]`` that ``indices [T, topk]``
    (int32, ``-1`` padding, checked to be in ``[-1, N)``) names, in float32.

    Logits are ``scale * (q . k)``, the output ``value_scale * sum(p * v)`` with ``v`` the first
    ``kv_lora_rank`` values of each row. ``decode_rows``: stored rows -> ``[n, D]`` values, for a
    cache whose rows are not the values themselves (``kv [N, row_width]`` of an ``fp8_ds_mla``
    cache: only the named rows are dequantised, as they are gathered; an ``fp8_e4m3`` cache
    needs none: its values times ``k_scale``, which the caller puts in both scales). Returns
    ``(out [T, H, kv_lora_rank], lse [T, H])``, both float32 (natural log; ``-inf`` where a row
    names nothing)."""
    tokens, heads, dim = q.shape
    topk = int(indices.shape[1])
    out = torch.empty(tokens, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if kv.shape[0] == 0:            # nothing to name: every index is padding
        return out.zero_(), lse.fill_(float("-inf"))
    chunk = max(1, GATHER_BUDGET // max(topk * (dim + heads), 1))
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        idx = indices[start:end].to(torch.long)
        pad = idx < 0
        rows = kv.index_select(0, idx.clamp(min=0).reshape(-1))
        if decode_rows is not None:
            rows = decode_rows(rows)
        rows = rows.view(end - start, topk, dim).to(torch.float32)
        rows.masked_fill_(pad.unsqueeze(-1), 0.0)
        scores = torch.bmm(q[start:end].to(torch.float32), rows.transpose(1, 2)).mul_(scale)
        scores.masked_fill_(pad.unsqueeze(1), float("-inf"))
        lg = torch.logsumexp(scores, dim=-1)                        # [c, H]
        probs = torch.exp(scores - lg.unsqueeze(-1))
        # A row that names nothing: -inf - -inf is NaN; its probabilities are 0.
        probs.masked_fill_(torch.isneginf(lg).unsqueeze(-1), 0.0)
        torch.bmm(probs, rows[..., :kv_lora_rank], out=out[start:end])
        lse[start:end] = lg
    if value_scale != 1.0:
        out.mul_(value_scale)
    return out, lse
