"""Plain matmul-softmax-matmul attention for one request, with the package's rule for
non-finite inputs, and a cheap test for them.

The rule (every CPU path of TORCH_SDPA follows it, the native kernel included), as IEEE
arithmetic gives it when masked keys are left out: a NaN or inf in a key a row sees makes
that row's score non-finite, and the whole output row and its LSE NaN; a NaN or inf in
column ``c`` of a value a row sees makes column ``c`` of that row non-finite (here NaN; the
native kernel gives inf for an inf); a key a row does not see (causal mask) never
contributes to it; a row that sees no key gets out 0 and LSE ``-inf``. Fused kernels break
it two ways: a masked key's NaN leaks through ``score + (-inf)`` and ``0 * NaN`` into rows
that must not see it, and a clamped ``exp`` turns a visible NaN score into a tiny weight,
hiding it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["all_finite", "attend_dense"]

#: Score elements per block of query rows (bounds the [H, rows, keys] temporaries).
_BLOCK_ELEMENTS = 1 << 24


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite: one reduction pass over each, in which
    a NaN or inf always shows. float32 / bfloat16 use a sum (the cheapest pass; a sum that
    overflows from finite values says "not finite" too, and the caller takes its exact,
    slower path); other dtypes (float16's sum would overflow at 65504) a min/max pass."""
    for t in tensors:
        if not t.numel():
            continue
        if t.dtype in (torch.float32, torch.bfloat16):
            values = [t.sum().item()]
        else:
            lo, hi = torch.aminmax(t)
            values = [lo.item(), hi.item()]
        if not all(math.isfinite(x) for x in values):
            return False
    return True


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One request's attention in float32, following the module's rule for NaN and inf.

    ``q: [q_len, H, D]``, ``k: [kv_len, H, D]``, ``v: [kv_len, H, Dv]`` (any float dtype,
    any strides); writes ``out: [q_len, H, Dv]`` and ``lse: [H, q_len]`` (natural log).
    ``causal`` is bottom-right aligned: row ``r`` sees keys ``j <= r + kv_len - q_len``.
    Query rows run in blocks so the score temporaries stay ~64 MiB.
    """
    q_len, heads, _ = q.shape
    kv_len = k.shape[0]
    kb = k.float().transpose(0, 1)                  # [H, kv, D]
    vb = v.float().transpose(0, 1)                  # [H, kv, Dv]
    bad_v: torch.Tensor | None = None  # [H, kv, Dv] float 0/1: where v is not finite
    bad_elements = ~torch.isfinite(vb)
    if bool(bad_elements.any()):
        vb = vb.masked_fill(bad_elements, 0.0)  # their (row, column)s are set NaN below
        bad_v = bad_elements.float()
    step = max(1, min(q_len, _BLOCK_ELEMENTS // max(1, heads * kv_len)))
    keys = torch.arange(kv_len)
    for a in range(0, q_len, step):
        b = min(q_len, a + step)
        qb = q[a:b].float().transpose(0, 1)         # [H, rows, D]
        scores = torch.matmul(qb, kb.transpose(1, 2)).mul_(scale)
        nonfinite = ~torch.isfinite(scores)
        hidden = None
        if causal:
            hidden = keys.unsqueeze(0) > (torch.arange(a, b) + (kv_len - q_len)).unsqueeze(1)
            nonfinite &= ~hidden
            scores.masked_fill_(hidden, float("-inf"))  # a masked NaN or inf is gone
        bad_score = nonfinite.any(-1)               # [H, rows]
        lg = torch.logsumexp(scores, -1)
        probs = torch.exp(scores - lg.unsqueeze(-1))
        if hidden is not None:
            probs.masked_fill_(hidden, 0.0)         # rows that see no key: NaN -> 0
        rows = torch.matmul(probs, vb)              # [H, rows, Dv]
        rows.masked_fill_(bad_score.unsqueeze(-1), float("nan"))
        if bad_v is not None:  # column c of a row that sees a key whose v[c] is not finite
            sees = (torch.ones(b - a, kv_len) if hidden is None else (~hidden).float())
            rows.masked_fill_(torch.matmul(sees, bad_v) > 0, float("nan"))
        lg.masked_fill_(bad_score, float("nan"))
        out[a:b].copy_(rows.transpose(0, 1))
        lse[:, a:b].copy_(lg)
