"""The engine side of a DeepSeek MLA layer: projections, norms, rope, up-projection, absorption.

Per token ``x [D]`` (already RMS-normed by the decoder layer):

- ``q = q_proj x``, or with q LoRA ``q = q_b_proj RMSNorm(q_a_proj x)``; per head ``q_nope [P]``
  and ``q_pe [R]`` (roped);
- ``c = kv_a_proj x`` split into the latent ``kv_c = RMSNorm(c[:L])`` and the shared rope key
  ``k_pe = rope(c[L:])``; ``[kv_c, k_pe]`` is what the paged cache stores;
- prefill (non-absorbed): ``kv_b_proj kv_c`` gives per head ``k_nope [P]`` then ``v [V]``; the
  key is ``[k_nope, k_pe]``;
- decode (absorbed): ``q_nope`` is folded into the latent space by ``W_UK`` (``kv_b_proj``'s
  key rows) and the latent attention output unfolded by ``W_UV`` (its value rows);
- ``o_proj`` takes the attention output ``[H*V]`` back to ``D``.

Attention itself runs in the executors (``app.model.prefill``, ``app.model.decode``) through
the selected backends. Weights are used in place (``F.linear`` on ``[out, in]``; views for the
absorbed form) when they already have the compute dtype and device; otherwise a converted copy
is made once. Results are rounded to the model dtype where an engine holds them in it (the
latent cache, q/k/v handed to attention, the layer output).
"""

from __future__ import annotations

import math

import torch

from app.kvcache.cache_dtypes import fp8_power_of_two_scale
from app.model.config import DeepseekConfig
from app.model.linear import Linear, packed_linear_available
from app.model.rope import RotaryEmbedding
from app.model.weights import AttentionWeights, LayerWeights

__all__ = ["MLAAttention", "fp8_cache_scale", "latent_bound", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as transformers computes it: normalised in float32, rounded to
    ``x``'s dtype, then times ``weight`` (the result in their promoted dtype)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def latent_bound(weights: AttentionWeights, input_norm: torch.Tensor, kv_lora_rank: int,
                 rope_scale: float) -> float:
    """A bound on ``|value|`` of every latent value an MLA layer can write to the cache,
    whatever its input: what an ``fp8`` cache's per-layer scale is derived from, so that no
    later token is clipped (``app.kvcache.cache_dtypes``). ``input_norm``: the decoder layer's
    ``input_layernorm`` weight ``[D]`` (it normalises the attention's input ``x``);
    ``rope_scale``: the rope's cos/sin factor (yarn's attention factor).

    ``kv_c = RMSNorm(c[:L]) * w``: an RMS-normalised vector of ``L`` values has none beyond
    ``sqrt(L)``, so ``|kv_c_i| <= sqrt(L) max|w|``. ``k_pe`` rotates pairs of ``c_j = W_j . x``
    (each output at most the pair's norm) and scales them by ``rope_scale``; ``||x|| <=
    sqrt(D) max|input_norm|`` for the same reason, so ``|k_pe_j| <= rope_scale sqrt(2)
    max_j ||W_j|| sqrt(D) max|input_norm|`` (Cauchy-Schwarz). The result is raised by 2^-4 for
    the roundings on the way (each at most a 16-bit dtype's 2^-8). Infinite or NaN where the
    weights are."""
    dim = int(input_norm.shape[-1])
    x_norm = math.sqrt(dim) * float(input_norm.double().abs().max())
    latent = math.sqrt(kv_lora_rank) * float(weights.kv_a_layernorm.double().abs().max())
    rope_rows = weights.kv_a_proj[kv_lora_rank:].double()
    row_norm = float(rope_rows.norm(dim=1).max()) if rope_rows.numel() else 0.0
    rope = abs(rope_scale) * math.sqrt(2.0) * row_norm * x_norm
    return max(latent, rope) * (1.0 + 2.0**-4)


def fp8_cache_scale(config: DeepseekConfig, layer: LayerWeights) -> float:
    """A layer's ``fp8`` cache scale: the smallest power of two at or above its
    ``latent_bound`` over 448, so that no value the layer writes is clipped (1 where the bound
    is not finite: NaN weights make NaN values anyway). The engine's caches and the
    reference's quantised latent (``app.model.ReferenceModel``) use the same."""
    bound = latent_bound(layer.attention, layer.input_layernorm, config.kv_lora_rank,
                         float(config.rope.cos_sin_scale))
    if not math.isfinite(bound):
        return 1.0
    return float(fp8_power_of_two_scale(torch.tensor(bound, dtype=torch.float64)))


def _on(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if t is None:  # pragma: no cover - guarded by the config's q_lora_rank
        raise ValueError("missing attention weight")
    return t.to(device=device, dtype=dtype)


class MLAAttention:
    """One layer's MLA projections on ``device`` in ``compute_dtype``; the model ``dtype`` is
    what the cache and the attention kernels hold. All methods take and return tensors on
    ``device``."""

    def __init__(self, config: DeepseekConfig, weights: AttentionWeights, *,
                 dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device,
                 rope: RotaryEmbedding) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.num_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
        self.eps = config.rms_norm_eps
        self.rope = rope
        cd, dev = compute_dtype, device
        self.q_lora = config.q_lora_rank is not None
        kv_a = weights.kv_a_proj.to(device=dev, dtype=cd)
        self._kv_a_norm = weights.kv_a_layernorm.to(device=dev, dtype=cd)
        self._kv_b_weight = weights.kv_b_proj.to(device=dev, dtype=cd)
        self._kv_b = Linear(self._kv_b_weight)
        self._o = Linear(weights.o_proj.to(device=dev, dtype=cd))
        q_in = _on(weights.q_a_proj, dev, cd) if self.q_lora else _on(weights.q_proj, dev, cd)
        if self.q_lora:
            self._q_a_norm = _on(weights.q_a_layernorm, dev, cd)
            self._q_b = Linear(_on(weights.q_b_proj, dev, cd))
        # Both projections of x (q or q_a, then kv_a) in one matmul where the weights are
        # reordered anyway (the copy is made once; no second one for the concatenation).
        self._q_width = int(q_in.shape[0])
        self._x_proj: Linear | None = None
        if packed_linear_available(cd, dev):
            self._x_proj = Linear(torch.cat([q_in, kv_a]))
        else:
            self._q_in, self._kv_a = Linear(q_in), Linear(kv_a)
        # The absorbed form splits kv_b [H*(P+V), L] per head into W_UK [H, P, L] and
        # W_UV [H, V, L]. Both are kept as [H, out, in] copies (W_UK^T [H, L, P] and W_UV
        # [H, V, L]) and multiplied through their transposed views: oneDNN's bf16 bmm then
        # reads the weight as it reads a linear's (measured 1.4x (W_UK) and 2x (W_UV) faster
        # at 1-16 rows than row-major operands; bmm also copied the strided views per call).
        per_head = self._kv_b_weight.view(self.num_heads,
                                          self.qk_nope_head_dim + self.v_head_dim,
                                          self.kv_lora_rank)
        self._w_uk_t = per_head[:, :self.qk_nope_head_dim].transpose(1, 2).contiguous()
        self._w_uv = per_head[:, self.qk_nope_head_dim:].contiguous()
        self._weights = weights

    def latent_bound(self, input_norm: torch.Tensor) -> float:
        """``latent_bound`` of this layer (``input_norm``: its decoder layer's
        ``input_layernorm`` weight)."""
        return latent_bound(self._weights, input_norm, self.kv_lora_rank,
                            float(self.rope.scale))

    def linears(self) -> list[Linear]:
        """The layer's matmuls (the absorbed form's per-head products are ``bmm`` s)."""
        first = [self._x_proj] if self._x_proj is not None else [self._q_in, self._kv_a]
        return [*first, *([self._q_b] if self.q_lora else []), self._kv_b, self._o]

    def _project_x(self, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q or q_a, kv_a) of ``xc [T, D]`` in the compute dtype."""
        if self._x_proj is not None:
            both = self._x_proj(xc)
            return both[:, :self._q_width], both[:, self._q_width:]
        return self._q_in(xc), self._kv_a(xc)

    def project(self, x: torch.Tensor, positions: torch.Tensor, max_position: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' query and latent.

        ``x [T, D]`` (normed), ``positions [T]`` int64 (absolute, on ``device``),
        ``max_position`` their host-side maximum. Returns ``q [T, H, P+R]`` and
        ``latent [T, L+R]`` (``kv_c`` normed, ``k_pe`` roped), both in the model dtype.
        """
        q, latent, _ = self.project_with_residual(x, positions, max_position)
        return q, latent

    def project_with_residual(self, x: torch.Tensor, positions: torch.Tensor,
                              max_position: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``project``, and the q LoRA's normed residual ``RMSNorm(q_a_proj x) [T, Q]`` in the
        compute dtype (what a sparse layer's indexer reads; None without a q LoRA)."""
        cd = self.compute_dtype
        xc = x.to(cd)
        t = xc.shape[0]
        p, r, lr = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q, c = self._project_x(xc)
        residual = None
        if self.q_lora:
            residual = rms_norm(q, self._q_a_norm, self.eps)
            q = self._q_b(residual)
        q = q.reshape(t, self.num_heads, p + r)
        latent = torch.empty(t, lr + r, dtype=self.dtype, device=self.device)
        latent[:, :lr] = rms_norm(c[:, :lr], self._kv_a_norm, self.eps)
        if r:
            cos, sin = self.rope.cos_sin(positions, max_position)
            q[..., p:] = self.rope.apply(q[..., p:], cos, sin)
            latent[:, lr:] = self.rope.apply(c[:, lr:], cos, sin)
        return q.to(self.dtype), latent, residual

    def up_project(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cached or new tokens from their latent ``[N, L+R]``.

        Returns ``k [N, H, P+R]`` (contiguous: ``[k_nope, k_pe]``) and ``v [N, H, V]`` (a
        non-contiguous view into the up-projection), in the model dtype.
        """
        n = latent.shape[0]
        p, r, lr = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        kv = self._kv_b(latent[:, :lr].to(self.compute_dtype)).view(
            n, self.num_heads, p + self.v_head_dim)
        if kv.dtype != self.dtype:
            kv = kv.to(self.dtype)
        k = torch.empty(n, self.num_heads, p + r, dtype=self.dtype, device=self.device)
        k[..., :p] = kv[..., :p]
        if r:
            k[..., p:] = latent[:, None, lr:]
        return k, kv[..., p:]

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """The absorbed decode query: ``q [T, H, P+R]`` (model dtype) -> ``[T, H, L+R]`` in the
        model dtype: ``q_nope @ W_UK`` per head (into the latent space), then ``q_pe``."""
        t = q.shape[0]
        p, lr = self.qk_nope_head_dim, self.kv_lora_rank
        q_latent = torch.bmm(q[..., :p].transpose(0, 1).to(self.compute_dtype),
                             self._w_uk_t.transpose(1, 2))
        out = torch.empty(t, self.num_heads, lr + self.qk_rope_head_dim, dtype=self.dtype,
                          device=self.device)
        out[..., :lr] = q_latent.transpose(0, 1)
        out[..., lr:] = q[..., p:]
        return out

    def unabsorb_output(self, latent_out: torch.Tensor) -> torch.Tensor:
        """``W_UV`` per head over the latent attention output ``[T, H, L]``: ``[T, H, V]`` in
        the model dtype."""
        # out [H, T, L] @ W_UV^T [H, L, V] (see __init__).
        out_h = latent_out.to(self.compute_dtype).transpose(0, 1)
        return torch.bmm(out_h, self._w_uv.transpose(1, 2)).transpose(0, 1).to(self.dtype)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """``o_proj`` over the attention output ``[T, H, V]``: ``[T, D]`` in the model dtype."""
        flat = attn.reshape(attn.shape[0], self.num_heads * self.v_head_dim)
        return self._o(flat.to(self.compute_dtype)).to(self.dtype)
