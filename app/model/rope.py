"""Rotary position embedding of the rope dims, in the checkpoint's layout.

DeepSeek rotates *adjacent pairs* ``(x[2i], x[2i+1])`` of the ``qk_rope_head_dim`` dims by
angle ``position * inv_freq[i]`` (``interleaved=True``, what its checkpoints and
``rope_interleave`` mean); ``interleaved=False`` rotates ``(x[i], x[i + R/2])`` (rotate-half).
Either way the output keeps the input's layout, so queries and keys stay comparable.

``inv_freq`` follows the config's ``RopeConfig``: plain ``theta ** (-2i / R)``, ``linear``
(divided by ``factor``) or ``yarn`` (a ramp between interpolated and extrapolated frequencies
over the dims whose rotations fall between ``beta_slow`` and ``beta_fast`` in the original
context). cos and sin are multiplied by ``RopeConfig.cos_sin_scale`` (yarn's attention factor).
"""

from __future__ import annotations

import math

import torch

from app.model.config import RopeConfig

__all__ = ["RotaryEmbedding", "apply_rope", "rope_inv_freq"]


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    original = rope.original_max_position_embeddings or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """float64 inverse frequencies ``[dim // 2]`` of ``rope`` over ``dim`` rope dims."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    base = rope.theta ** exponents
    extrapolated = 1.0 / base
    if rope.rope_type == "default" or dim == 0:
        return extrapolated
    interpolated = 1.0 / (rope.factor * base)
    if rope.rope_type == "linear":
        return interpolated
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1.0 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = True) -> torch.Tensor:
    """Rotate the last dim of ``x [T, ..., R]`` by ``cos``/``sin`` ``[T, R/2]`` (broadcast over
    the middle dims): adjacent pairs when ``interleaved``, else halves. A new tensor in
    ``x``'s dtype and layout."""
    half = x.shape[-1] // 2
    if x.dim() == 2:
        c, s = cos, sin
    else:
        # The tables over the middle dims, materialised: a product whose broadcast dim sits
        # between the rows and the rope dims runs R/2 elements per inner loop (4x slower).
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        full = (*x.shape[:-1], half)
        c = cos.reshape(shape).expand(full).contiguous()
        s = sin.reshape(shape).expand(full).contiguous()
    # Both members of each pair, split apart once: [T, 2, ..., R/2], each half contiguous.
    pairs = (x.reshape(*x.shape[:-1], half, 2).movedim(-1, 1) if interleaved
             else x.reshape(*x.shape[:-1], 2, half).movedim(-2, 1)).contiguous()
    x1, x2 = pairs[:, 0], pairs[:, 1]
    out = torch.empty_like(pairs)
    torch.sub(x1 * c, x2 * s, out=out[:, 0])
    torch.add(x2 * c, x1 * s, out=out[:, 1])
    return (out.movedim(1, -1) if interleaved else out.movedim(1, -2)).flatten(-2)


class RotaryEmbedding:
    """cos/sin tables ``[positions, R/2]`` of a ``RopeConfig``, computed in float64 and kept in
    ``dtype`` on ``device``; grown on demand (doubling) so a lookup never recomputes them."""

    def __init__(self, rope: RopeConfig, rope_dim: int, dtype: torch.dtype,
                 device: torch.device, interleaved: bool = True,
                 initial_positions: int = 4096) -> None:
        self.rope = rope
        self.rope_dim = rope_dim
        self.dtype = dtype
        self.device = device
        self.interleaved = interleaved
        self.scale = rope.cos_sin_scale
        self.inv_freq = rope_inv_freq(rope, rope_dim)
        self._cos = torch.empty(0, rope_dim // 2, dtype=dtype, device=device)
        self._sin = torch.empty(0, rope_dim // 2, dtype=dtype, device=device)
        self._grow(initial_positions)

    def tables64(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 cos/sin ``[T, R/2]`` (scaled) at ``positions`` (int64, any device)."""
        freqs = torch.outer(positions.to(device="cpu", dtype=torch.float64), self.inv_freq)
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def _grow(self, num_positions: int) -> None:
        cos, sin = self.tables64(torch.arange(num_positions))
        self._cos = cos.to(device=self.device, dtype=self.dtype)
        self._sin = sin.to(device=self.device, dtype=self.dtype)

    def cos_sin(self, positions: torch.Tensor, max_position: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` (int64 on ``device``); ``max_position`` bounds them (host)."""
        if max_position >= self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], max_position + 1))
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rope`` in this embedding's layout."""
        return apply_rope(x, cos, sin, self.interleaved)
