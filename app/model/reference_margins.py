"""The float64 reference's tolerances and margins (``app.model.reference`` re-exports them): the
relative error accepted per dtype, the routing margins within which an engine may route either
way, each row's routing margin, and a hash of the experts a row chose (``route_hash``: where a
model in another dtype routed otherwise)."""

from __future__ import annotations

import torch

from app.kvcache.cache_dtypes import canonical_kv_cache_dtype
from app.model.config import MoEConfig

__all__ = ["FP8_CACHE_ROUTING_TOLERANCE", "REFERENCE_TOLERANCES", "ROUTE_PRIME",
           "ROUTING_TOLERANCES", "reference_tolerance", "route_hash", "routing_margins",
           "routing_tolerance"]

#: The relative error (max abs error / the reference's max abs) always accepted per model
#: dtype: a few units of the dtype's rounding over the model's chain of roundings (the engine
#: rounds the residual stream, the latent cache, q/k/v and each projection's output). Measured
#: on the main job's random model (bf16): 9.7e-3 at most over 1,520 rows. The floor of
#: ``app.mla.checks.derived_tolerance``, which widens it where the model's own rounding in its
#: dtype, measured, is larger.
REFERENCE_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}
#: Routing margins (choice-score units) within which an engine of the dtype may route either
#: way. Measured in bf16 on the main job's random model: every row whose experts differed from
#: the float64 choice had a margin below 4.4e-3 (17 of 1,520 rows); 7.5e-3 leaves out ~8%.
ROUTING_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 7.5e-3,
}


#: The routing margin within which an engine with an FP8 latent cache (``fp8``, ``fp8_e4m3``,
#: ``fp8_ds_mla``) may route either way, whatever its dtype: e4m3's 2^-4 moves each key and
#: value by percents, the layer outputs by ~2-3%, the router's choice scores by up to ~0.025.
#: Measured on the main job's random model in bf16 (3,600 rows of three sequences, the dense
#: model with its keys and values through the cache against float64): every row whose output
#: moved by more than 8% (a different expert set) had a margin below 0.0246 (fp8_ds_mla) /
#: 0.0243 (fp8); 0.04 leaves out ~35% of the rows (bf16 alone: ~8%).
FP8_CACHE_ROUTING_TOLERANCE = 0.04


def routing_tolerance(dtype: torch.dtype, kv_cache_dtype: str = "auto") -> float:
    """The routing margin within which an engine may route either way: its dtype's
    (``ROUTING_TOLERANCES``), or, with an FP8 latent cache, ``FP8_CACHE_ROUTING_TOLERANCE``
    when that is wider."""
    base = ROUTING_TOLERANCES.get(dtype, 0.0)
    if canonical_kv_cache_dtype(kv_cache_dtype) == "auto":
        return base
    return max(base, FP8_CACHE_ROUTING_TOLERANCE)


def reference_tolerance(dtype: torch.dtype) -> float:
    """The accepted relative error for a model ``dtype`` (``ValueError`` for others)."""
    if dtype not in REFERENCE_TOLERANCES:
        raise ValueError(f"no reference tolerance for dtype {dtype}; known: "
                         f"{[str(d) for d in REFERENCE_TOLERANCES]}")
    return REFERENCE_TOLERANCES[dtype]


def routing_margins(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    """Per row of float64 router ``logits [T, E]``: the smallest gap between chosen and
    unchosen groups and experts in the choice scores (inf when nothing was left out)."""
    if moe.scoring_func == "sigmoid":
        choice = logits.sigmoid() + (0 if bias is None else bias.double())
    else:
        choice = logits.softmax(dim=-1)
    margin = torch.full((logits.shape[0],), float("inf"), dtype=torch.float64)
    grouped = moe.topk_method != "greedy" and moe.n_group > moe.topk_group
    if grouped:
        g = choice.view(-1, moe.n_group, moe.experts_per_group)
        scores = g.topk(2, dim=-1).values.sum(-1) if moe.scoring_func == "sigmoid" \
            else g.amax(dim=-1)
        top = scores.topk(moe.topk_group + 1, dim=-1).values
        margin = torch.minimum(margin, top[:, -2] - top[:, -1])
        keep = scores.topk(moe.topk_group, dim=-1).indices
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, keep, True)
        allowed = mask.unsqueeze(-1).expand_as(g).reshape(choice.shape)
        choice = choice.masked_fill(~allowed, float("-inf"))
    k = moe.num_experts_per_tok
    candidates = moe.topk_group * moe.experts_per_group if grouped else moe.n_routed_experts
    if candidates > k:
        top = choice.topk(k + 1, dim=-1).values
        margin = torch.minimum(margin, top[:, -2] - top[:, -1])
    return margin


#: Folds one layer's routes into a row's hash (int64 arithmetic wraps: a hash).
ROUTE_PRIME = 1_000_003


def route_hash(experts: torch.Tensor) -> torch.Tensor:
    """Each row's set of ``experts [n, k]`` as one int64 (order-free; wrapping hash)."""
    ordered = experts.to(torch.int64).sort(dim=1).values + 1
    powers = torch.tensor([ROUTE_PRIME ** j % (1 << 61) for j in range(ordered.shape[1])],
                          dtype=torch.int64)
    return (ordered * powers).sum(dim=1)
