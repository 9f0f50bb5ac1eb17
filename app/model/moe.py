"""The feed-forward half of a decoder layer: a SwiGLU MLP, or DeepSeek's mixture of experts.

``SwiGLU``: ``down(silu(gate x) * up x)`` with ``gate_up [2I, D]`` in one matmul.

``MoE`` (per token, on the normed hidden state ``x [D]``):

1. router logits ``gate x`` in float32 (the gate weight is kept in float32);
2. scores: ``softmax`` (V2) or ``sigmoid`` (V3);
3. choice (``route``): V3 adds ``e_score_correction_bias`` to the scores *for choosing only*,
   keeps the ``topk_group`` groups whose best two choice scores sum highest, and takes the
   ``num_experts_per_tok`` best choice scores among their experts. V2 ``greedy`` takes the top
   experts; ``group_limited_greedy`` first keeps the groups with the highest single score;
4. weights: the chosen experts' plain scores, divided by their sum when ``norm_topk_prob``,
   times ``routed_scaling_factor``;
5. ``sum_k w_k expert_k(x) + shared(x)``.

Experts run grouped: the ``(token, expert)`` pairs are sorted by expert once, and each expert
with work runs one matmul over all its tokens (no per-token loop), accumulated in float32 (or
the compute dtype when wider). Grouping reads the per-expert counts on the host, a wait for
the device; off the CPU (``sync_free``) a small batch (a decode step: at most
``DENSE_EXPERT_ROWS`` token-expert rows) runs every expert on every token instead, weighted by
the routing weights (0 for the experts not chosen): two batched matmuls, no wait, the same
shapes every step (what a CUDA graph needs). A decode step reads every expert's weights
either way, so on a GPU the extra products cost little next to that.

For the float64 check (``app.model.reference``, ``app.mla.checks``): each row's routing margin
(``routing_margins``: how near its choice was to another), the margins within which an engine's
rounding may route otherwise (``ROUTING_TOLERANCES``, ``routing_tolerance``), and each row's
experts as one hash (``route_hash``: where a model in another dtype routed otherwise).
"""

from __future__ import annotations

import itertools

import attrs
import torch
import torch.nn.functional as F

from app.kvcache.cache_dtypes import canonical_kv_cache_dtype
from app.model.config import MoEConfig
from app.model.linear import Linear
from app.model.weights import MLPWeights, MoEWeights

__all__ = ["DENSE_EXPERT_ROWS", "FP8_CACHE_ROUTING_TOLERANCE", "ROUTE_PRIME", "ROUTING_TOLERANCES",
           "MoE", "Routing", "SwiGLU", "route", "route_hash", "routing_margins",
           "routing_tolerance", "swiglu"]

#: Off the CPU, a batch of at most this many (token, expert) rows runs every expert densely.
DENSE_EXPERT_ROWS = 8192


class SwiGLU:
    """A dense SwiGLU MLP on ``device`` in ``compute_dtype`` (weights used in place when they
    already are; reordered for the matmul path where ``app.model.linear`` says so)."""

    def __init__(self, weights: MLPWeights, compute_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.intermediate_size = weights.intermediate_size
        self._gate_up = Linear(weights.gate_up_proj.to(device=device, dtype=compute_dtype))
        self._down = Linear(weights.down_proj.to(device=device, dtype=compute_dtype))
        self.compute_dtype = compute_dtype

    def linears(self) -> list[Linear]:
        """The MLP's matmuls."""
        return [self._gate_up, self._down]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` -> ``[T, D]`` in the compute dtype."""
        return self._down(swiglu(self._gate_up(x.to(self.compute_dtype)),
                                 self.intermediate_size))


def swiglu(h: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``h [T, 2I]`` (gate columns first): ``[T, I]``."""
    return F.silu(h[:, :inter]) * h[:, inter:]


@attrs.frozen(eq=False)
class Routing:
    """The experts chosen per token: ``experts [T, k]`` int64 and their ``weights [T, k]``
    float32 (normalised and scaled as the config says)."""

    experts: torch.Tensor
    weights: torch.Tensor


def _group_mask(choice: torch.Tensor, moe: MoEConfig, best_two: bool) -> torch.Tensor:
    """Bool ``[T, E]``: experts in the ``topk_group`` best groups of ``choice [T, E]`` (a group
    scores its best two (V3) or its best one (V2))."""
    grouped = choice.view(choice.shape[0], moe.n_group, moe.experts_per_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if best_two else grouped.amax(dim=-1)
    keep = group_scores.topk(moe.topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)


def route(logits: torch.Tensor, moe: MoEConfig, score_bias: torch.Tensor | None) -> Routing:
    """The routing of router ``logits [T, E]`` (float32) under ``moe`` (module docstring)."""
    if moe.scoring_func == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if score_bias is None else scores + score_bias
        if moe.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, moe, best_two=True),
                                        float("-inf"))
    else:
        scores = logits.softmax(dim=-1)
        choice = scores
        if moe.topk_method == "group_limited_greedy" and moe.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, moe, best_two=False), 0.0)
    experts = choice.topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(experts=experts, weights=weights * moe.routed_scaling_factor)


class MoE:
    """A MoE layer on ``device``: router (float32), routed experts and shared experts in
    ``compute_dtype`` (each expert's two matmuls a ``Linear``)."""

    def __init__(self, moe: MoEConfig, weights: MoEWeights, compute_dtype: torch.dtype,
                 device: torch.device, sync_free: bool | None = None) -> None:
        """``sync_free``: small batches run every expert (module docstring); default: off the
        CPU."""
        self.config = moe
        self.sync_free = torch.device(device).type != "cpu" if sync_free is None else sync_free
        self.compute_dtype = compute_dtype
        self._gate = weights.gate.to(device=device, dtype=torch.float32)
        self._bias = None if weights.score_bias is None else weights.score_bias.to(
            device=device, dtype=torch.float32)
        gate_up = weights.experts_gate_up.to(device=device, dtype=compute_dtype)
        down = weights.experts_down.to(device=device, dtype=compute_dtype)
        self._gate_up = [Linear(w) for w in gate_up.unbind(0)]
        self._down = [Linear(w) for w in down.unbind(0)]
        # [E, 2I, D] and [E, D, I], the tensors the Linears view (no copy off the CPU).
        self._stacked = (gate_up, down)
        self.intermediate_size = int(down.shape[2])
        self.shared = None if weights.shared is None else SwiGLU(weights.shared, compute_dtype,
                                                                 device)

    def linears(self) -> list[Linear]:
        """The routed and shared experts' matmuls."""
        return [*self._gate_up, *self._down, *(self.shared.linears() if self.shared else [])]

    def route(self, x: torch.Tensor) -> Routing:
        """The routing of ``x [T, D]``."""
        return route(F.linear(x.float(), self._gate), self.config, self._bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` -> ``[T, D]`` in the compute dtype."""
        t = x.shape[0]
        xc = x.to(self.compute_dtype)
        if t == 0:
            return xc.new_zeros(xc.shape)
        routing = self.route(x)
        if self.sync_free and t * self.config.n_routed_experts <= DENSE_EXPERT_ROWS:
            return self._every_expert(xc, routing)
        k = routing.experts.shape[1]
        flat_experts = routing.experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.config.n_routed_experts).tolist()
        # Every (token, expert) pair's input, in expert order: one gather; each expert then
        # works on a contiguous run of rows.
        rows = xc.index_select(0, order // k)
        starts = itertools.accumulate(counts[:-1], initial=0)
        spans = [(e, a, a + n) for e, (a, n) in enumerate(zip(starts, counts, strict=True)) if n]
        hidden = torch.cat([self._gate_up[e](rows[a:b]) for e, a, b in spans])
        act = swiglu(hidden, self.intermediate_size)
        del hidden
        ys = torch.cat([self._down[e](act[a:b]) for e, a, b in spans])
        acc = torch.promote_types(self.compute_dtype, torch.float32)
        weights = routing.weights.reshape(-1).index_select(0, order)
        weighted = ys.to(acc).mul_(weights[:, None])
        # Back from expert order to (token, k) order (a gather by the inverse permutation),
        # then the sum over k in k order.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        out = weighted.index_select(0, inverse).view(t, k, -1).sum(dim=1)
        return self._plus_shared(out, xc)

    def _plus_shared(self, out: torch.Tensor, xc: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            out += self.shared(xc).to(out.dtype)
        return out.to(self.compute_dtype)

    def _every_expert(self, xc: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every expert on every token of ``xc [T, D]``, summed with the routing weights (0
        for an expert not chosen): static shapes, nothing read on the host."""
        gate_up, down = self._stacked
        hidden = torch.matmul(xc, gate_up.transpose(1, 2))                 # [E, T, 2I]
        experts, t = hidden.shape[0], hidden.shape[1]
        act = swiglu(hidden.view(experts * t, -1), self.intermediate_size)
        ys = torch.bmm(act.view(experts, t, -1), down.transpose(1, 2))     # [E, T, D]
        acc = torch.promote_types(self.compute_dtype, torch.float32)
        dense = torch.zeros(t, experts, dtype=acc, device=xc.device).scatter_(
            1, routing.experts, routing.weights.to(acc))
        out = torch.einsum("etd,te->td", ys.to(acc), dense)
        return self._plus_shared(out, xc)


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
