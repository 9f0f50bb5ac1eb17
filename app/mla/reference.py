"""The dense float64 reference of the MLA layer on a whole sequence.

No cache, no chunks, no backend, no merge: the layer of ``app.mla.layer`` written out as plain
float64 matmuls and a causal softmax over the whole sequence. The engine's output for token ``i``
of a request must match row ``i`` of this, whatever chunking, paging, prefix-cache hits and
merging produced it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from app.mla.layer import MLALayerWeights, TokenEmbedding, apply_rope, rms_norm, rope_inv_freq

__all__ = [
    "REFERENCE_TOLERANCES",
    "ReferenceCheck",
    "check_against_reference",
    "reference_forward",
    "reference_tolerance",
]

#: Query rows per block of the blocked causal softmax (bounds the score matrix's memory).
_ROW_BLOCK = 128


def reference_forward(weights: MLALayerWeights, x: torch.Tensor, start: int = 0,
                      end: int | None = None) -> torch.Tensor:
    """Rows ``start:end`` of the layer's output on the whole sequence ``x [S, hidden]``.

    Token ``i`` is at position ``i``; rows attend causally to tokens ``0..i``. Only the keys up
    to ``end`` are computed (causality makes later ones irrelevant). Returns float64
    ``[end - start, hidden]`` on the CPU.
    """
    model = weights.model
    seq_len = int(x.shape[0])
    end = seq_len if end is None else end
    if not 0 <= start <= end <= seq_len:
        raise ValueError(f"reference_forward: need 0 <= start <= end <= {seq_len}, "
                         f"got start={start}, end={end}")
    h, p, r, lr, v = (model.num_heads, model.qk_nope_head_dim, model.qk_rope_head_dim,
                      model.kv_lora_rank, model.v_head_dim)
    x = x[:end].to(device="cpu", dtype=torch.float64)
    inv_freq = rope_inv_freq(r) if r else torch.zeros(0, dtype=torch.float64)
    freqs = torch.outer(torch.arange(end, dtype=torch.float64), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()

    c = x @ weights.w_kv_a.t()
    kv_c = rms_norm(c[:, :lr], weights.kv_a_norm)
    kv = (kv_c @ weights.w_kv_b.t()).view(end, h, p + v)
    k = torch.empty(end, h, p + r, dtype=torch.float64)
    k[..., :p] = kv[..., :p]
    if r:
        k[..., p:] = apply_rope(c[:, lr:], cos, sin)[:, None, :]
    k_h = k.transpose(0, 1).contiguous()          # [H, S, P+R]
    v_h = kv[..., p:].transpose(0, 1).contiguous()  # [H, S, V]

    q = (x[start:end] @ weights.w_q.t()).view(end - start, h, p + r)
    if r:
        q[..., p:] = apply_rope(q[..., p:], cos[start:end], sin[start:end])
    q_h = (q.transpose(0, 1) * model.scale).contiguous()  # [H, n, P+R]

    out = torch.empty(h, end - start, v, dtype=torch.float64)
    # _ROW_BLOCK query rows (all heads) at a time, in two reused buffers (scores and
    # probabilities): no large temporary is allocated (and page-faulted) per block, and each
    # block is three big ops (QK^T, softmax, PV) plus a mask on its diagonal part.
    rows_max = min(_ROW_BLOCK, end - start)
    scores_buf = torch.empty(h * rows_max * end, dtype=torch.float64)
    probs_buf = torch.empty(h * rows_max * end, dtype=torch.float64)
    for b0 in range(0, end - start, _ROW_BLOCK):
        b1 = min(b0 + _ROW_BLOCK, end - start)
        rows, first = b1 - b0, start + b0       # query rows first .. first + rows - 1
        kv_end = first + rows                   # causal: the last row sees keys up to here
        scores = scores_buf[:h * rows * kv_end].view(h, rows, kv_end)
        probs = probs_buf[:h * rows * kv_end].view(h, rows, kv_end)
        torch.bmm(q_h[:, b0:b1], k_h[:, :kv_end].transpose(1, 2), out=scores)
        # Keys before `first` are visible to every row; row i sees keys first..first + i.
        hidden = torch.ones(rows, rows, dtype=torch.bool).triu_(1)
        scores[:, :, first:].masked_fill_(hidden, float("-inf"))
        torch.ops.aten._softmax.out(scores, -1, False, out=probs)
        torch.bmm(probs, v_h[:, :kv_end], out=out[:, b0:b1])
    out = out.transpose(0, 1)
    return out.reshape(end - start, h * v) @ weights.w_o.t()


@attrs.frozen
class ReferenceCheck:
    """The error of one request's computed rows against the dense float64 reference."""

    request_id: str
    rows_checked: int
    max_abs_error: float
    ref_max_abs: float

    @property
    def relative_error(self) -> float:
        """``max_abs_error / ref_max_abs``: the error relative to the output's scale."""
        return self.max_abs_error / self.ref_max_abs if self.ref_max_abs > 0 else \
            self.max_abs_error


def check_against_reference(weights: MLALayerWeights, embedding: TokenEmbedding,
                            request_id: str, token_ids: Sequence[int], output: torch.Tensor,
                            computed_rows: torch.Tensor) -> ReferenceCheck:
    """Compare ``output [S, hidden]`` of a request on the rows in ``computed_rows`` (bool
    ``[S]``) with ``reference_forward`` of the whole sequence ``token_ids``."""
    seq_len = len(token_ids)
    if output.shape[0] != seq_len or computed_rows.shape != (seq_len,):
        raise ValueError(f"check_against_reference: output {list(output.shape)} and "
                         f"computed_rows {list(computed_rows.shape)} must have {seq_len} rows")
    rows = computed_rows.to("cpu")
    if not bool(rows.any()):
        return ReferenceCheck(request_id, 0, 0.0, 0.0)
    start = int(rows.nonzero()[0, 0])
    x = embedding.lookup(torch.as_tensor(list(token_ids), dtype=torch.int64))
    ref = reference_forward(weights, x, start)
    mask = rows[start:]
    got = output[start:].to(device="cpu", dtype=torch.float64)[mask]
    want = ref[mask]
    diff = (got - want).abs()
    # A NaN or inf anywhere is an infinite error (a NaN would compare as "within tolerance").
    error = float(diff.max()) if bool(torch.isfinite(diff).all()) else float("inf")
    return ReferenceCheck(request_id=request_id, rows_checked=int(mask.sum()),
                          max_abs_error=error,
                          ref_max_abs=float(want.abs().max()))


#: The largest ``ReferenceCheck.relative_error`` accepted per model dtype. The engine rounds to
#: the model dtype where a real engine stores it (latent cache, q/k/v, attention output, layer
#: output); the reference does not, so the budget is a few units of the dtype's rounding
#: (bf16 keeps 8 significant bits, fp16 11, fp32 24) over the layer's chain of roundings.
REFERENCE_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


def reference_tolerance(dtype: torch.dtype) -> float:
    """The accepted relative error for a model ``dtype`` (``ValueError`` for others)."""
    if dtype not in REFERENCE_TOLERANCES:
        raise ValueError(f"no reference tolerance for dtype {dtype}; known: "
                         f"{[str(d) for d in REFERENCE_TOLERANCES]}")
    return REFERENCE_TOLERANCES[dtype]
