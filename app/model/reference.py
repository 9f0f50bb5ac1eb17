"""The dense float64 reference of the model: no cache, no chunks, no backend, no merge.

``ReferenceModel(weights).outputs(tokens, rows)`` runs the whole model, teacher-forced, on one
sequence in float64 (``outputs_many`` on several, the last layer's feed-forward batched; keys
and values up-projected, a causal softmax, every weight upcast) and returns the final normed
hidden state at ``rows`` with each row's *routing margin*: over the MoE layers, the smallest
gap between the last expert (or group) chosen and the first one not chosen, in the gate's
choice scores. Where that gap is within an engine's rounding, the engine may route differently
and still be right (a routing near-tie). Keys, values and hidden states of the previous
sequence are reused along the common prefix: check sequences sorted by their tokens and a
shared prompt is computed once. The first layer sees only the embedding, so its latent (and
from it its up-projected keys and values; the rope key also needs the position, applied after)
is a function of the token id: it is computed once per distinct token and kept, across
sequences, in a table of ``vocab`` rows where that table fits ``TOKEN_MEMO_BYTES`` (the same
float64 products, row for row; the main job's sequences repeat a 4096-token vocabulary, so this
removes most of the check's up-projections).

``ReferenceModel(weights, dtype=torch.bfloat16)`` is the same dense model computed in a 16-bit
dtype as transformers computes it (every product in that dtype; RMSNorm, the softmax and the
router in float32): what the dtype alone costs, without any engine. ``app.mla.checks`` measures
it on the rows it checks and derives the engine's tolerance from it.

``ReferenceModel(weights, dtype, kv_cache_dtype="fp8_ds_mla")`` (or ``"fp8"``) passes every
key's and value's latent through that FP8 cache dtype as the engine writes it (quantised, then
read back: ``app.kvcache.cache_dtypes``; the ``fp8`` scale the engine's): what the dtype and
the cache cost together, which the check measures to derive an FP8 engine's tolerance.

A sparse model (DeepSeek-V3.2, GLM-5) runs its indexer in the same dtype
(``app.model.sparse.reference``); each row attends only to its selected positions and gets its
smallest *selection margin*. Given the engine's selections (``outputs_many(...,
selections=...)``), it attends to those instead, so the attention is compared without the
selection's rounding, and compares them with its own (``ReferenceRows.selection_compared``).

``reference_attention`` is one MLA layer alone (for executor tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from app.kvcache.cache_dtypes import (
    canonical_kv_cache_dtype,
    dequantize_fp8_ds_mla,
    dequantize_fp8_per_layer,
    quantize_fp8_ds_mla,
    quantize_fp8_per_layer,
)
from app.model.attention import fp8_cache_scale
from app.model.config import DeepseekConfig
from app.model.moe import (
    FP8_CACHE_ROUTING_TOLERANCE,
    ROUTE_PRIME,
    ROUTING_TOLERANCES,
    route,
    route_hash,
    routing_margins,
    routing_tolerance,
)
from app.model.rope import apply_rope, rope_inv_freq
from app.model.sparse.reference import (
    SELECTION_TOLERANCES,
    SparseReference,
    accumulate_comparisons,
    checked_selections,
    selection_mask,
)
from app.model.weights import AttentionWeights, MLPWeights, ModelWeights, MoEWeights

__all__ = ["FP8_CACHE_ROUTING_TOLERANCE", "REFERENCE_CACHE_BYTES", "REFERENCE_TOLERANCES",
           "ROUTING_TOLERANCES", "SELECTION_TOLERANCES", "TOKEN_MEMO_BYTES", "ReferenceModel",
           "ReferenceRows", "reference_attention", "reference_tolerance", "routing_margins",
           "routing_tolerance"]

#: Query rows per block of the blocked causal softmax.
_ROW_BLOCK = 128
#: float64 copies kept at most (bytes); larger models upcast on every use.
REFERENCE_CACHE_BYTES = 2 << 30
#: The first layer's per-token table is kept only when it fits this many bytes.
TOKEN_MEMO_BYTES = 256 << 20

#: The relative error (max abs error / the reference's max abs) always accepted per model
#: dtype: a few units of the dtype's rounding over the model's chain of roundings. Measured on
#: the main job's random model (bf16): 9.7e-3 at most over 1,520 rows. The floor of
#: ``app.mla.checks.derived_tolerance``, which widens it where the model's own rounding in its
#: dtype, measured, is larger.
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


_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in _SIXTEEN_BIT:   # normalised in float32, as transformers' RMSNorm does
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    if scores.dtype in _SIXTEEN_BIT:   # in float32, rounded back (transformers' eager path)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    return torch.softmax(scores, dim=-1)


class _Weights64:
    """A model's tensors in the reference's ``dtype`` (float64 by default): copies cached up
    to ``REFERENCE_CACHE_BYTES`` (a tensor already in ``dtype`` is used as it is)."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}
        self._bytes = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._cache.get(id(t))
        if hit is not None:
            return hit
        out = t.to(device="cpu", dtype=self.dtype)
        size = out.numel() * out.element_size()
        if out is not t and self._bytes + size <= REFERENCE_CACHE_BYTES:
            self._cache[id(t)] = out
            self._bytes += size
        return out


def _q_lora(a: AttentionWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The q LoRA's down projection and norm (empty for a model without one: a sparse model
    always has one)."""
    if a.q_a_proj is None or a.q_a_layernorm is None:
        return torch.empty(0), torch.empty(0)
    return a.q_a_proj, a.q_a_layernorm


def _queries(c: DeepseekConfig, a: AttentionWeights, f: _Weights64, x: torch.Tensor
             ) -> torch.Tensor:
    if a.q_proj is not None:
        return x @ f(a.q_proj).t()
    if a.q_a_proj is None or a.q_a_layernorm is None or a.q_b_proj is None:
        raise ValueError("attention weights have neither q_proj nor the q LoRA")
    return _rms(x @ f(a.q_a_proj).t(), f(a.q_a_layernorm), c.rms_norm_eps) @ f(a.q_b_proj).t()


class _Layer64:
    """One decoder layer's maths in the reference's dtype (float64 unless asked otherwise)."""

    def __init__(self, config: DeepseekConfig, weights: ModelWeights, index: int,
                 f: _Weights64, kv_cache_dtype: str = "auto") -> None:
        self.c = config
        self.w = weights.layers[index]
        self.f = f
        self.dt = f.dtype
        self.cache = canonical_kv_cache_dtype(kv_cache_dtype)
        self.fp8_scale = fp8_cache_scale(config, self.w) if self.cache == "fp8_e4m3" else 1.0
        c = config
        self.h, self.p, self.r, self.lr, self.v = (c.num_attention_heads, c.qk_nope_head_dim,
                                                   c.qk_rope_head_dim, c.kv_lora_rank,
                                                   c.v_head_dim)
        self.inv_freq = rope_inv_freq(c.rope, self.r)
        self.rope_scale = c.rope.cos_sin_scale

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.to(torch.float64), self.inv_freq)
        return ((freqs.cos() * self.rope_scale).to(self.dt),
                (freqs.sin() * self.rope_scale).to(self.dt))

    def keys_values(self, h: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer inputs ``h [n, D]`` at positions ``start..`` -> ``k [H, n, P+R]``,
        ``v [H, n, V]``."""
        return self.place(self.up_project(h), start)

    def up_project(self, h: torch.Tensor) -> torch.Tensor:
        """Layer inputs ``h [n, D]`` -> ``[n, H*(P+V) + R]``: each position's up-projected key
        (nope part) and value per head, then its rope key before rotation."""
        a, f = self.w.attention, self.f
        x = _rms(h, f(self.w.input_layernorm), self.c.rms_norm_eps)
        c = x @ f(a.kv_a_proj).t()
        latent = self._cached(_rms(c[:, :self.lr], f(a.kv_a_layernorm), self.c.rms_norm_eps),
                              rope=False)
        kv = latent @ f(a.kv_b_proj).t()
        return torch.cat([kv, c[:, self.lr:]], dim=1)

    def _cached(self, values: torch.Tensor, rope: bool) -> torch.Tensor:
        """``values`` as an FP8 latent cache gives them back (``kv_cache_dtype``; the latent
        part position-free, the rope part after rotation), in this layer's dtype."""
        if self.cache == "auto":
            return values
        if self.cache == "fp8_e4m3":
            q8, _ = quantize_fp8_per_layer(values, self.fp8_scale)
            return dequantize_fp8_per_layer(q8, self.fp8_scale, self.dt)
        if rope:                                     # fp8_ds_mla keeps the rope in bf16
            return values.to(torch.bfloat16).to(self.dt)
        return dequantize_fp8_ds_mla(quantize_fp8_ds_mla(values, self.lr), self.lr, 0, self.dt)

    def place(self, rows: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``up_project`` rows at positions ``start..`` -> ``k [H, n, P+R]`` (rope applied),
        ``v [H, n, V]``."""
        n, width = rows.shape[0], self.h * (self.p + self.v)
        kv = rows[:, :width].view(n, self.h, self.p + self.v)
        k = torch.empty(n, self.h, self.p + self.r, dtype=self.dt)
        k[..., :self.p] = kv[..., :self.p]
        if self.r:
            cos, sin = self._cos_sin(torch.arange(start, start + n))
            k[..., self.p:] = self._cached(apply_rope(rows[:, width:], cos, sin,
                                                      self.c.rope_interleave),
                                           rope=True)[:, None, :]
        return k.transpose(0, 1), kv[..., self.p:].transpose(0, 1)

    def attend(self, h_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, selected: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after attention ``[n, D]`` at the sorted positions ``rows``
        (inputs ``h_rows``) over keys/values of every earlier position (a sparse layer: only
        those ``selected [n, topk]`` names)."""
        a, f, n = self.w.attention, self.f, h_rows.shape[0]
        x = _rms(h_rows, f(self.w.input_layernorm), self.c.rms_norm_eps)
        q = _queries(self.c, a, f, x).view(n, self.h, self.p + self.r)
        if self.r:
            cos, sin = self._cos_sin(rows)
            q[..., self.p:] = apply_rope(q[..., self.p:], cos, sin, self.c.rope_interleave)
        q_h = (q.transpose(0, 1) * self.c.softmax_scale).contiguous()
        out = torch.empty(self.h, n, self.v, dtype=self.dt)
        for b0 in range(0, n, _ROW_BLOCK):
            pos = rows[b0:b0 + _ROW_BLOCK]
            end = int(pos[-1]) + 1
            scores = torch.bmm(q_h[:, b0:b0 + _ROW_BLOCK], k[:, :end].transpose(1, 2))
            scores.masked_fill_(torch.arange(end).view(1, -1) > pos.view(-1, 1), float("-inf"))
            if selected is not None:
                keep = selection_mask(selected[b0:b0 + _ROW_BLOCK], end)
                scores.masked_fill_(~keep.unsqueeze(0), float("-inf"))
            torch.bmm(_softmax(scores), v[:, :end], out=out[:, b0:b0 + _ROW_BLOCK])
        return h_rows + out.transpose(0, 1).reshape(n, self.h * self.v) @ f(a.o_proj).t()

    def feed_forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h + mlp(RMSNorm(h))`` of rows ``h [n, D]`` (any rows, any sequences), their
        routing margins and the experts they chose (``_routes``)."""
        x = _rms(h, self.f(self.w.post_attention_layernorm), self.c.rms_norm_eps)
        mlp, margins, routes = self._mlp(x)
        return h + mlp, margins, routes

    def forward(self, h_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, selected: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``attend`` then ``feed_forward``: the layer's outputs, the rows' margins and
        routes."""
        return self.feed_forward(self.attend(h_rows, rows, k, v, selected))

    def _swiglu(self, m: MLPWeights, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.f(m.gate_up_proj).t()
        inter = m.intermediate_size
        return (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ self.f(m.down_proj).t()

    def _mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = self.w.mlp
        inf = torch.full((x.shape[0],), float("inf"), dtype=torch.float64)
        if not isinstance(m, MoEWeights) or self.c.moe is None:
            return (self._swiglu(m, x), inf,  # type: ignore[arg-type]
                    torch.zeros(x.shape[0], dtype=torch.int64))
        moe = self.c.moe
        if self.dt == torch.float64:
            logits = x @ self.f(m.gate).t()
            bias = None if m.score_bias is None else self.f(m.score_bias)
        else:   # the router in float32, as transformers runs it
            logits = x.float() @ m.gate.float().t()
            bias = None if m.score_bias is None else m.score_bias.float()
        routing = route(logits, moe, bias)
        inter = moe.moe_intermediate_size
        # One expert at a time through two reused float64 buffers, not float64 copies of the
        # whole stacks: those were most of a check's fresh memory (the main job's 16 experts:
        # 400 MB, some 100k page faults a run); the values are the same.
        gate_up = torch.empty(m.experts_gate_up.shape[1:], dtype=self.dt)
        down = torch.empty(m.experts_down.shape[1:], dtype=self.dt)
        # Grouped by expert, then back to (row, k) order and summed over k (no index_add_:
        # it enters a parallel region per call, slow when threads contend).
        n, k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=moe.n_routed_experts).tolist()
        weights = routing.weights.reshape(-1).index_select(0, order).to(self.dt)
        rows_of = order // k
        pieces, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                rows = rows_of[start:start + count]
                gate_up.copy_(m.experts_gate_up[expert])
                down.copy_(m.experts_down[expert])
                h = x.index_select(0, rows) @ gate_up.t()
                y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down.t()
                pieces.append(y * weights[start:start + count, None])
                start += count
        routed = torch.empty(n * k, x.shape[1], dtype=self.dt)
        routed.index_copy_(0, order, torch.cat(pieces))
        out = routed.view(n, k, -1).sum(dim=1)
        if m.shared is not None:
            out += self._swiglu(m.shared, x)
        return (out, routing_margins(logits.double(), moe, None if bias is None else bias.double()),
                route_hash(routing.experts))


@attrs.frozen(eq=False)
class ReferenceRows:
    """``hidden [n, D]`` (final normed; the reference's dtype) at the rows asked for, and each
    row's smallest routing margin over the MoE layers (``margins [n]``, inf for a dense
    model)."""

    hidden: torch.Tensor
    margins: torch.Tensor
    #: A sparse model's: each row's smallest selection margin (None for a dense model).
    selection_margins: torch.Tensor | None = None
    #: Each row's experts in every MoE layer, hashed (``route_hash``; None: not computed).
    routes: torch.Tensor | None = None
    #: Given the engine's selections: ``[n, 3]`` float64 per row over its indexer layers: keys
    #: both selected, keys the reference selected (0: the engine gave none, not compared) and
    #: the largest violation (``compare_selection``). None when no selection was given.
    selection_compared: torch.Tensor | None = None


def _fit(buffer: torch.Tensor | None, dim: int, n: int, keep: int,
         shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``buffer`` with room for ``n`` positions along ``dim`` (its first ``keep`` kept)."""
    if buffer is not None and buffer.shape[dim] >= n:
        return buffer
    size = list(shape)
    size[dim] = max(n, 2 * (0 if buffer is None else buffer.shape[dim]))
    grown = torch.empty(size, dtype=dtype)
    if buffer is not None and keep:
        grown.narrow(dim, 0, keep).copy_(buffer.narrow(dim, 0, keep))
    return grown


class ReferenceModel:
    """The dense model of ``weights`` in float64 (see the module docstring); ``dtype``
    bfloat16, float16 or float32 computes it in that dtype instead (what the dtype alone
    costs)."""

    def __init__(self, weights: ModelWeights, dtype: torch.dtype = torch.float64, *,
                 kv_cache_dtype: str = "auto") -> None:
        if dtype not in (torch.float64, torch.float32, *_SIXTEEN_BIT):
            raise ValueError(f"ReferenceModel: dtype must be float64, float32, bfloat16 or "
                             f"float16, got {dtype}")
        self.weights = weights
        self.config = weights.config
        self.dtype = dtype
        #: The latent cache dtype the keys and values pass through (``"auto"``: none).
        self.kv_cache_dtype = canonical_kv_cache_dtype(kv_cache_dtype)
        self._f = _Weights64(dtype)
        self.layers = [_Layer64(self.config, weights, i, self._f, self.kv_cache_dtype)
                       for i in range(weights.num_layers)]
        self._tokens: tuple[int, ...] = ()
        self._keys: list[torch.Tensor | None] = [None] * len(self.layers)
        self._values: list[torch.Tensor | None] = [None] * len(self.layers)
        # Per layer but the last: its output, and the smallest routing margin so far, at every
        # position of the previous sequence.
        self._hidden: list[torch.Tensor | None] = [None] * len(self.layers)
        self._margins: list[torch.Tensor | None] = [None] * len(self.layers)
        self._routes: list[torch.Tensor | None] = [None] * len(self.layers)
        self.reused_tokens = 0
        self.computed_tokens = 0
        self._lm_head_f32: torch.Tensor | None = None
        first = self.layers[0] if self.layers else None
        self._memo_width = 0 if first is None else first.h * (first.p + first.v) + first.r
        self._memo: torch.Tensor | None = None
        self._memo_known: torch.Tensor | None = None
        self._sparse = None if self.config.indexer is None else SparseReference(
            self.config, [layer.attention.indexer for layer in weights.layers],
            [layer.input_layernorm for layer in weights.layers],
            [_q_lora(layer.attention) for layer in weights.layers], self._f, _rms, dtype)
        # A sparse model: per layer but the last, the smallest selection margin so far at every
        # position of the previous sequence.
        self._selection: list[torch.Tensor | None] = [None] * len(self.layers)
        # ... and the comparison with the engine's selections so far (``ReferenceRows``).
        self._compared: list[torch.Tensor | None] = [None] * len(self.layers)

    def _first_layer_keys_values(self, tokens: Sequence[int], start: int
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's ``keys_values`` of ``tokens`` at positions ``start..``, from the
        per-token table (see the module docstring) where it fits, else computed directly."""
        first = self.layers[0]
        vocab = int(self.weights.embed_tokens.shape[0])
        if vocab * self._memo_width * 8 > TOKEN_MEMO_BYTES:
            return first.keys_values(self.embed(tokens), start)
        if self._memo is None or self._memo_known is None:
            self._memo = torch.empty(vocab, self._memo_width, dtype=self.dtype)
            self._memo_known = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor(list(tokens), dtype=torch.int64)
        new = torch.unique(ids[~self._memo_known[ids]])
        if new.numel():
            self._memo[new] = first.up_project(self.embed(new.tolist()))
            self._memo_known[new] = True
        return first.place(self._memo.index_select(0, ids), start)

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Embedding rows of ``tokens`` in the reference's dtype."""
        table = self.weights.embed_tokens
        ids = torch.tensor(list(tokens), dtype=torch.int64)
        return table.index_select(0, ids).to(self.dtype)

    def lm_head_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """float64 LM-head rows ``[len(tokens), D]``."""
        return self.weights.lm_head.index_select(0, tokens).double()

    def best_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each float64 row ``hidden [n, D]`` (found in float32)."""
        if self._lm_head_f32 is None:
            self._lm_head_f32 = self.weights.lm_head.float()
        return (hidden.float() @ self._lm_head_f32.t()).argmax(dim=1)

    def outputs(self, token_ids: Sequence[int], rows: torch.Tensor,
                selections: torch.Tensor | None = None) -> ReferenceRows:
        """The final normed hidden state and routing margin at ``rows`` (sorted int64);
        ``selections``: see ``outputs_many``."""
        return self.outputs_many([(token_ids, rows)], None if selections is None
                                 else [selections])[0]

    def outputs_many(self, items: Sequence[tuple[Sequence[int], torch.Tensor]],
                     selections: Sequence[torch.Tensor | None] | None = None
                     ) -> list[ReferenceRows]:
        """``outputs`` of each ``(token_ids, rows)`` in order (sort them by tokens for prefix
        reuse); the last layer's feed-forward runs once over every sequence's rows (its
        experts' weights are read once, not once per sequence). A sparse model's
        ``selections`` (one per item, or None): the engine's selections as bitmasks ``[indexer
        layers, len(token_ids), ceil(len / 8)]`` uint8 (``RequestOutput.selections``,
        ``app.model.sparse.selections``), attended to instead of the reference's own and
        compared with them (an all-zero row: none)."""
        last = self.layers[-1]
        forced: list[torch.Tensor | None] = [None] * len(items) if selections is None \
            else checked_selections([len(tokens) for tokens, _ in items], selections,
                                    None if self._sparse is None else self._sparse.layers)
        self._reserve(max((len(tokens) for tokens, _ in items), default=0))
        attended = [self._attend_last(tuple(tokens), rows, given)
                    for (tokens, rows), given in zip(items, forced, strict=True)]
        if not attended:
            return []
        out, margins, routes = last.feed_forward(torch.cat([a[0] for a in attended]))
        normed = _rms(out, self._f(self.weights.norm), self.config.rms_norm_eps)
        results, start = [], 0
        for (h, (before, routed), selection, compared), given in zip(attended, forced,
                                                                     strict=True):
            end = start + h.shape[0]
            results.append(ReferenceRows(hidden=normed[start:end],
                                         margins=torch.minimum(before, margins[start:end]),
                                         routes=routed * ROUTE_PRIME + routes[start:end],
                                         selection_margins=selection,
                                         selection_compared=None if given is None
                                         else compared))
            start = end
        return results

    def _reserve(self, n: int) -> None:
        """Room for ``n`` positions in every per-position buffer, made once: grown by doubling
        as the sequences came, they were allocated about twice over (fresh memory, each page a
        fault)."""
        if n <= 0:
            return
        for i in range(len(self.layers)):
            self._keys_values_room(i, n, len(self._tokens) if self._keys[i] is not None else 0)

    def _keys_values_room(self, i: int, n: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s key and value buffers with room for ``n`` positions (their first
        ``keep`` kept), stored back and returned."""
        layer = self.layers[i]
        k = _fit(self._keys[i], 1, n, keep, (layer.h, n, layer.p + layer.r), self.dtype)
        v = _fit(self._values[i], 1, n, keep, (layer.h, n, layer.v), self.dtype)
        self._keys[i], self._values[i] = k, v
        return k, v

    def _attend_last(self, tokens: tuple[int, ...], rows: torch.Tensor,
                     forced: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor],
                                torch.Tensor | None, torch.Tensor]:
        """Every layer but the last on the whole sequence (reusing the common prefix), and the
        last layer's attention at ``rows``: the residual stream there, the routing margins and
        routes so far and (a sparse model) the selection margins of every layer and the
        comparison with ``forced`` (the engine's selections, attended to)."""
        common = 0
        if self._keys[0] is not None:
            limit = min(len(self._tokens), len(tokens))
            while common < limit and self._tokens[common] == tokens[common]:
                common += 1
        n, last, sparse = len(tokens), len(self.layers) - 1, self._sparse
        if sparse is not None and forced is not None:
            # the state kept was computed with the previous sequence's selections
            common = sparse.agreeing_prefix(forced, common)
        x = self.embed(tokens[common:])
        margins_new = torch.full((n - common,), float("inf"), dtype=torch.float64)
        selection_new = margins_new.clone()
        compared_new = torch.zeros(n - common, 3, dtype=torch.float64)
        routes_new = torch.zeros(n - common, dtype=torch.int64)
        for i, layer in enumerate(self.layers):
            if i == 0:
                k_new, v_new = self._first_layer_keys_values(tokens[common:], common)
            else:
                k_new, v_new = layer.keys_values(x, common)
            k, v = self._keys_values_room(i, n, common)
            k[:, common:n] = k_new
            v[:, common:n] = v_new
            if sparse is not None:
                sparse.add_keys(i, x, common, n)
            if i == last:
                break
            selected = None
            if sparse is not None:
                given = sparse.forced_rows(forced, i, torch.arange(common, n))
                selected, near, compared = sparse.select(i, x, torch.arange(common, n), common,
                                                         n, True, given)
                selection_new = torch.minimum(selection_new, near)
                compared_new = accumulate_comparisons(compared_new, compared)
                sm = _fit(self._selection[i], 0, n, common, (n,))
                sm[common:n] = selection_new
                self._selection[i] = sm
                cm = _fit(self._compared[i], 0, n, common, (n, 3))
                cm[common:n] = compared_new
                self._compared[i] = cm
            x, m, r = layer.forward(x, torch.arange(common, n), k, v, selected)
            margins_new = torch.minimum(margins_new, m)
            routes_new = routes_new * ROUTE_PRIME + r
            rt = _fit(self._routes[i], 0, n, common, (n,), torch.int64)
            rt[common:n] = routes_new
            self._routes[i] = rt
            h = _fit(self._hidden[i], 0, n, common, (n, x.shape[1]), self.dtype)
            mg = _fit(self._margins[i], 0, n, common, (n,))
            h[common:n], mg[common:n] = x, margins_new
            self._hidden[i], self._margins[i] = h, mg
        self._tokens = tokens
        self.reused_tokens += common
        self.computed_tokens += n - common
        prev_h = self._hidden[last - 1] if last else None
        prev_m = self._margins[last - 1] if last else None
        prev_r = self._routes[last - 1] if last else None
        if prev_h is not None and prev_m is not None and prev_r is not None:
            inputs, before = prev_h.index_select(0, rows), prev_m.index_select(0, rows)
            routed = prev_r.index_select(0, rows)
        else:
            inputs = self.embed([tokens[r] for r in rows.tolist()])
            before = torch.full((rows.numel(),), float("inf"), dtype=torch.float64)
            routed = torch.zeros(rows.numel(), dtype=torch.int64)
        keys, values = self._keys[last], self._values[last]
        if keys is None or values is None:  # pragma: no cover - filled above
            raise RuntimeError("no keys")
        compared = torch.zeros(rows.numel(), 3, dtype=torch.float64)
        if sparse is None:
            return (self.layers[last].attend(inputs, rows, keys, values), (before, routed), None,
                    compared)
        selected, near, compared = sparse.select(last, inputs, rows, common, n, False,
                                                 sparse.forced_rows(forced, last, rows))
        prev_s = self._selection[last - 1] if last else None
        prev_c = self._compared[last - 1] if last else None
        if prev_s is not None and prev_c is not None:
            near = torch.minimum(near, prev_s.index_select(0, rows))
            compared = accumulate_comparisons(prev_c.index_select(0, rows), compared)
        return (self.layers[last].attend(inputs, rows, keys, values, selected), (before, routed),
                near, compared)


def reference_attention(config: DeepseekConfig, weights: AttentionWeights, x: torch.Tensor,
                        start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows ``start:end`` of one MLA layer's output (``o_proj`` included) on the whole
    sequence of already-normed inputs ``x [S, D]`` (token ``i`` at position ``i``, causal).
    float64 ``[end - start, D]`` on the CPU."""
    seq_len = int(x.shape[0])
    end = seq_len if end is None else end
    if not 0 <= start <= end <= seq_len:
        raise ValueError(f"reference_attention: need 0 <= start <= end <= {seq_len}, "
                         f"got start={start}, end={end}")
    f = _Weights64()
    c = config
    h, p, r, lr, v = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                      c.kv_lora_rank, c.v_head_dim)
    x = x[:end].to(device="cpu", dtype=torch.float64)
    inv_freq = rope_inv_freq(c.rope, r)
    freqs = torch.outer(torch.arange(end, dtype=torch.float64), inv_freq)
    cos, sin = freqs.cos() * c.rope.cos_sin_scale, freqs.sin() * c.rope.cos_sin_scale
    lat = x @ f(weights.kv_a_proj).t()
    kv = (_rms(lat[:, :lr], f(weights.kv_a_layernorm), c.rms_norm_eps)
          @ f(weights.kv_b_proj).t()).view(end, h, p + v)
    k = torch.empty(end, h, p + r, dtype=torch.float64)
    k[..., :p] = kv[..., :p]
    if r:
        k[..., p:] = apply_rope(lat[:, lr:], cos, sin, c.rope_interleave)[:, None, :]
    q = _queries(c, weights, f, x[start:end]).view(end - start, h, p + r)
    if r:
        q[..., p:] = apply_rope(q[..., p:], cos[start:end], sin[start:end], c.rope_interleave)
    scores = torch.einsum("qhd,khd->hqk", q, k) * c.softmax_scale
    mask = torch.arange(end).view(1, -1) > torch.arange(start, end).view(-1, 1)
    scores.masked_fill_(mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), kv[..., p:])
    return out.reshape(end - start, h * v) @ f(weights.o_proj).t()
