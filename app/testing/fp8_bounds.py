"""Error bounds of an MLA decode kernel reading an FP8 cache, against the float64 reference.

The question (issue 35): FLASHINFER_MLA (fa3, H100) with an e4m3 cache and a bf16 query was
0.0255 off the float64 reference in the LSE, against a fixed tolerance of 0.02. Is that the
quantisation, or a bug?

**What is compared.** The test quantises the cache once (``latent / base_scale`` to e4m3) and
passes the scale per call (``k_scale``); the reference (``reference_decode``) runs in float64
over the *dequantised* cache ``k = k8 * k_scale``, and over the query the kernel sees. So the
e4m3 quantisation error itself (up to 2^-4 relative per element) is in neither side: what is
left is how the kernel turns ``k8`` and ``k_scale`` into the numbers it multiplies.

**What the kernel does** (flashinfer 0.7.2, ``data/include/flashinfer/attention/mla_hopper.cuh``,
``repack_fp8_kv_to_bf16``): Hopper has no bf16 x e4m3 MMA, so each cache tile is dequantised
to bf16 in shared memory: e4m3 -> bf16 (exact), times the scale *converted to bf16*, the product
rounded to bf16. Then q.k in bf16 MMAs with float32 accumulation, the probabilities rounded
to bf16 for p.v (``convert_s_to_p``), the output written in bf16. In general, with ``u`` the
unit roundoff of the dequantisation dtype (bf16: 2^-8), the kernel's key is

    k'[j, d] = k[j, d] (1 + delta) (1 + eps[j, d]),   |delta| <= u,  |eps[j, d]| <= u,

``delta`` the scale's rounding (one number for the whole call: a *systematic* error),
``eps`` each product's rounding. A CPU emulation of exactly this arithmetic reproduces the H100's
LSE values to 4 decimals (3.2861, 4.6624, 9.5182 ...) and its maximum error (0.02554 vs
0.02555): ``k_scale = 0.010398`` is ``0.010376`` in bf16, ``delta = -0.21%``, and every score,
hence the LSE, comes out low. Not a bug of ours: the kernel's precision.

**The bound.** Per query row (request b, row i, head h), keys ``j`` it sees, ``D = 576``:
``s_j`` the reference scores, ``p = softmax(s)``, ``L = logsumexp(s)``, ``o = sum p_j v_j``
(``v_j = k[j, :kv_lora_rank]``), ``a_j = scale * ||q * k_j||_2``,
``z = sqrt(2 ln(2 / failure_probability))``, ``H_j = z u a_j``, ``H = max H_j``.
The kernel's scores are ``s'_j = (1 + delta)(s_j + eta_j)`` with
``eta_j = scale sum_d q_d k_jd eps_jd``. Model: the ``eps`` are independent, zero-mean (the
usual probabilistic model of rounding errors); then by Hoeffding ``|eta_j| <= H_j`` and
``|sum_j p_j eta_j| <= z u sqrt(sum_j p_j^2 a_j^2)``, each failing with probability at most
``failure_probability``.

- LSE: ``L' - L = [LSE((1+delta) x) - LSE(x)] + [LSE(x) - LSE(s)]``, ``x = s + eta``. The first
  is at most ``u max_j |x_j|`` (its derivative in ``delta`` is a p-average of ``x``); the second
  is ``sum_j p_j eta_j`` plus half a variance of ``eta`` (the Hessian of LSE), at most
  ``e^r sum_j p_j H_j^2 / 2`` (``r = u range(s) + 2H`` bounds how far the softmax moves). So::

      |L' - L| <= u (max|s| + H) + min(u sum_j p_j w_j, z u sqrt(sum_j p_j^2 a_j^2))
                  + e^r sum_j p_j H_j^2 / 2 + floor

  (``w_j = scale sum_d |q_d k_jd|``: the worst case, when fewer keys than the bound's ``z``
  carry the weight).
- Output, column c: ``o'_c - o_c`` is ``delta o_c`` (the values' scale) ``+ delta Cov_p(s, v_c)``
  (the scores' scale moving p) ``+ sum_j p_j eta_j (v_jc - o_c)`` (the scores' roundings moving
  p; Hoeffding) ``+ sum_j p_j v_jc eps_jc`` (the values' roundings) ``+ sum_j p_j v_jc rho_j``
  (the probabilities rounded to ``probability_dtype``, ``|rho_j| <= u_p``) ``+`` a second-order
  term ``e^r range(v_c) sum_j p_j (u |s_j - s_mean| + H_j)^2 / 2``; the output's own rounding
  adds ``u_out`` of its size, and ``floor`` times ``max_j |v_jc|`` covers the kernel's float32
  arithmetic (the bf16-cache runs on the H100 were 1e-5 off in the LSE).

How tight (the CPU emulation of the H100's arithmetic, ``tests/testing/test_fp8_bounds.py``,
at the GPU test's two scales): the largest error is 0.34 of its bound in the LSE and 0.21-0.39
in the output; the systematic ``delta`` alone, at its worst (``u``), is about a third of the
LSE bound, the rest covers the products' roundings at a failure probability of 1e-9. The
fixed 0.02 was below what the kernel's bf16 dequantisation does to a score of 10
(``0.21% * 10``), and the output's fixed
``3e-2 * k_scale / base_scale`` below what it does at twice the scale (0.063 in the emulation).

**Against the latent before it was quantised (issue 36).** With ``original=`` (what the model
wrote to the cache, before the FP8 write) the reference is the float64 decode over *those*
values, and each stored value's own error joins the kernel's: in general the kernel's key
element is ``k'_jd = k_jd + e_jd`` with ``|e_jd| <= E_jd``, the errors independent and
zero-mean (the same model), and the bound above holds with ``u |k_jd|`` replaced by ``E_jd``
throughout (``a_j -> sqrt(sum_d q_d^2 E_jd^2) / u``, ``w_j -> sum_d |q_d| E_jd / u``, the
values' term ``min(sum_j p_j E_jc, z sqrt(sum_j p_j^2 E_jc^2))``). What e4m3 with these
scales allows (``quantization_error``): a value ``x`` stored as ``e4m3(x / s) * s`` is off by
at most half e4m3's spacing at ``|x| / s``: ``2^(floor(log2(|x| / s)) - 4) s`` for a normal
one (2^-4 relative), ``2^-10 s`` below 2^-6 (e4m3's subnormals, whose spacing is 2^-9),
and ``|x| - 448 s`` more for a value a too-small scale saturated; a value stored in bf16 (the
``fp8_ds_mla`` rope part) by half bf16's spacing. ``E_jd`` adds the kernel's rounding of the
stored value (``u (|x| + Q)``). The scale itself enters exactly where the kernel keeps it in
float32 (``scale_rounded=False``: CPU_MLA multiplies by it in float32; FA3 rounds it to bf16,
the systematic ``delta`` above), and a kernel that normalises by the sum of its *rounded*
probabilities (``rounded_normaliser``, the CPU kernels' dot path) moves the output by
``sum_j p_j rho_j (v_jc - o_c)``, not ``sum_j p_j rho_j v_jc``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from app.kvcache.cache_dtypes import (
    DS_MLA_TILE,
    FP8_E4M3_MAX,
    dequantize_fp8_ds_mla,
    ds_mla_scales,
)

__all__ = ["DecodeErrorBounds", "fp8_cache_decode_bounds", "quantization_error",
           "unit_roundoff"]

#: Query rows x keys x heads worth of float64 per batch of heads (bounds the working memory).
_CHUNK_ELEMENTS = 1 << 22


def unit_roundoff(dtype: torch.dtype | None) -> float:
    """Half the machine epsilon of ``dtype`` (bf16 2^-8, fp16 2^-11, float32 2^-24, e4m3
    2^-4): the largest relative error of rounding to it; 0 for None (no rounding)."""
    if dtype is None:
        return 0.0
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"expected a floating torch.dtype or None, got {dtype!r}")
    return float(torch.finfo(dtype).eps) / 2


@attrs.frozen
class DecodeErrorBounds:
    """Per-element bounds on a decode kernel's error against ``reference_decode``.

    ``out [B, Q, H, kv_lora_rank]`` and ``lse [H, B, Q]`` (float64, the layouts
    ``reference_decode`` and ``run_decode`` use), with the reference itself
    (``reference_out``, ``reference_lse``) computed on the way."""

    out: torch.Tensor
    lse: torch.Tensor
    reference_out: torch.Tensor
    reference_lse: torch.Tensor

    def worst_ratios(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[float, float]:
        """The largest ``|error| / bound`` of a kernel's ``out`` and ``lse`` (any device and
        float dtype, the layouts above): both at most 1 when the kernel is inside its bounds.
        A non-finite value gives ``inf``."""
        ratios = []
        for got, want, bound in ((out, self.reference_out, self.out),
                                 (lse, self.reference_lse, self.lse)):
            if tuple(got.shape) != tuple(want.shape):
                raise ValueError(f"expected shape {list(want.shape)}, got {list(got.shape)}")
            error = (got.detach().to("cpu", torch.float64) - want).abs()
            # 0 / 0 (an exact result where the bound is 0) is 0; a NaN result is inf
            ratio = torch.where(error == 0, 0.0, error / bound).nan_to_num(nan=math.inf)
            ratios.append(float(ratio.max()) if ratio.numel() else 0.0)
        return ratios[0], ratios[1]


def _half_spacing(x: torch.Tensor, bits: int, min_exponent: int) -> torch.Tensor:
    """Half the spacing of a binary format with ``bits`` mantissa bits at ``|x|`` (float64),
    its normal range starting at ``2^min_exponent`` (below: the subnormal spacing)."""
    _, exponent = torch.frexp(x.abs())                   # |x| = m 2^e, m in [0.5, 1)
    binade = torch.clamp(exponent - 1, min=min_exponent).to(torch.float64)
    return torch.exp2(binade - bits - 1)


def quantization_error(original: torch.Tensor, kv_lora_rank: int, kv_cache_format: str = "auto",
                       *, k_scale: float = 1.0, stored: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """The most each value of ``original [..., D]`` (float) can be off once stored in an FP8
    cache, float64 ``[..., D]`` (see the module docstring): ``"fp8_e4m3"`` (every value e4m3
    with scale ``k_scale``) or ``"fp8_ds_mla"`` (the latent in e4m3 with the tile scales of
    ``stored``, the ``fp8_ds_mla`` rows written from ``original`` by whichever writer; the rope
    part in bf16)."""
    x = original.detach().to("cpu", torch.float64)
    dim = int(x.shape[-1])
    if kv_cache_format == "fp8_e4m3":
        scales = torch.full_like(x, float(k_scale))
    elif kv_cache_format == "fp8_ds_mla":
        if stored is None:
            raise ValueError("quantization_error: fp8_ds_mla needs the stored rows (their "
                             "tile scales)")
        tiles = ds_mla_scales(stored.detach().cpu(), kv_lora_rank, dim - kv_lora_rank)
        scales = tiles.to(torch.float64).repeat_interleave(DS_MLA_TILE, dim=-1)
    else:
        raise ValueError(f"quantization_error: kv_cache_format must be 'fp8_e4m3' or "
                         f"'fp8_ds_mla', got {kv_cache_format!r}")
    width = scales.shape[-1]
    fp8 = x[..., :width]
    error = x.abs().new_zeros(x.shape)
    error[..., :width] = _half_spacing(fp8 / scales, 3, -6) * scales + (
        fp8.abs() - FP8_E4M3_MAX * scales).clamp_min(0)
    if width < dim:                                        # the rope part, stored in bf16
        error[..., width:] = _half_spacing(x[..., width:], 7, -126)
    return error


def _stored_values(kv_cache: torch.Tensor, kv_cache_format: str, kv_lora_rank: int,
                   dim: int) -> torch.Tensor:
    """The values a cache holds, float64 ``[blocks, block_size, D]`` (before ``k_scale``)."""
    if kv_cache_format == "fp8_ds_mla":
        return dequantize_fp8_ds_mla(kv_cache.detach().cpu(), kv_lora_rank, dim - kv_lora_rank,
                                     torch.float64)
    if kv_cache_format != "auto":
        raise ValueError(f"kv_cache_format must be 'auto' or 'fp8_ds_mla', got "
                         f"{kv_cache_format!r}")
    return kv_cache.detach().to("cpu", torch.float64)


def fp8_cache_decode_bounds(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: Sequence[int], kv_lora_rank: int, scale: float,
                            k_scale: float, *,
                            dequant_dtype: torch.dtype | None = torch.bfloat16,
                            probability_dtype: torch.dtype | None = torch.bfloat16,
                            output_dtype: torch.dtype = torch.bfloat16,
                            failure_probability: float = 1e-9,
                            floor: float = 1e-4, kv_cache_format: str = "auto",
                            original: torch.Tensor | None = None,
                            element_error: torch.Tensor | None = None,
                            scale_rounded: bool = True,
                            rounded_normaliser: bool = False) -> DecodeErrorBounds:
    """Bounds on the error of a kernel that dequantises ``kv_cache`` (times ``k_scale``) into
    ``dequant_dtype`` (None: exactly), rounds its probabilities to ``probability_dtype`` (None:
    it does not) and writes ``output_dtype``; derivation in the module docstring.

    Arguments as ``reference_decode``'s: ``q [B, Q, H, D]`` as the kernel sees it (an FP8
    query: its dequantised values), ``kv_cache [blocks, block_size, D]`` (any dtype; with
    ``kv_cache_format="fp8_ds_mla"``, uint8 FlashMLA rows), ``block_table [B, *]``, row i of
    request b sees keys ``[0, seq_lens[b] - Q + i]``. ``original`` (``[blocks, block_size,
    D]``, the latent before the cache quantised it) makes the reference the decode over it
    and adds each value's quantisation error (``element_error``, default
    ``quantization_error``; with ``kv_cache_format="auto"`` an FP8 ``kv_cache`` is taken as
    ``fp8_e4m3`` with scale ``k_scale``). ``scale_rounded``: the kernel rounds ``k_scale`` to
    ``dequant_dtype`` (FA3 does; the CPU kernels keep it in float32); ``rounded_normaliser``:
    it divides by the sum of its rounded probabilities. ``ValueError`` for a bad probability or
    floor, or shapes that disagree."""
    if not 0.0 < failure_probability < 1.0:
        raise ValueError(f"failure_probability must be in (0, 1), got {failure_probability!r}")
    if not (math.isfinite(floor) and floor >= 0.0):
        raise ValueError(f"floor must be a finite number >= 0, got {floor!r}")
    batch, qlen, heads, dim = q.shape
    if len(seq_lens) != batch or not 0 < kv_lora_rank <= dim or (
            kv_cache_format == "auto" and int(kv_cache.shape[-1]) != dim):
        raise ValueError(f"q {list(q.shape)}, kv_cache {list(kv_cache.shape)}, "
                         f"{len(seq_lens)} seq_lens and kv_lora_rank {kv_lora_rank} disagree")
    u = unit_roundoff(dequant_dtype)
    model = _Model(u_scale=u if scale_rounded else 0.0, u_p=unit_roundoff(probability_dtype),
                   u_out=unit_roundoff(output_dtype), scale=scale, floor=floor,
                   z=math.sqrt(2 * math.log(2 / failure_probability)), rank=kv_lora_rank,
                   rounded_normaliser=rounded_normaliser)
    stored = _stored_values(kv_cache, kv_cache_format, kv_lora_rank, dim)
    if original is None:
        values = stored
        errors = u * stored.abs() if element_error is None else element_error.double()
    else:
        values = original.detach().to("cpu", torch.float64)
        if element_error is None:
            fmt = "fp8_e4m3" if kv_cache_format == "auto" else kv_cache_format
            element_error = quantization_error(original, kv_lora_rank, fmt, k_scale=k_scale,
                                               stored=kv_cache)
        quantized = element_error.to(torch.float64)
        errors = quantized + u * (values.abs() + quantized)
    out_bound = torch.zeros(batch, qlen, heads, kv_lora_rank, dtype=torch.float64)
    lse_bound = torch.zeros(batch, qlen, heads, dtype=torch.float64)
    ref_out, ref_lse = torch.zeros_like(out_bound), torch.zeros_like(lse_bound)
    table = block_table.detach().to("cpu", torch.long)
    bs = int(values.shape[1])
    k_mult = 1.0 if original is not None else k_scale
    for b, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        where = (table[b][pos // bs], pos % bs)
        keys = values[where] * k_mult                                          # [L, D]
        errs = errors[where] * abs(k_mult)
        for i in range(qlen):
            seen, seen_err = keys[:seq_len - qlen + i + 1], errs[:seq_len - qlen + i + 1]
            qi = q[b, i].detach().to("cpu", torch.float64)                      # [H, D]
            step = max(1, _CHUNK_ELEMENTS // max(1, seen.shape[0] * dim))
            err_sq, err_t = seen_err.square().t(), seen_err.t()
            for h in range(0, heads, step):
                row = model.row(qi[h:h + step], seen, seen_err, err_sq, err_t)
                out_bound[b, i, h:h + step], lse_bound[b, i, h:h + step] = row[0], row[1]
                ref_out[b, i, h:h + step], ref_lse[b, i, h:h + step] = row[2], row[3]
    return DecodeErrorBounds(out=out_bound, lse=lse_bound.permute(2, 0, 1).contiguous(),
                             reference_out=ref_out,
                             reference_lse=ref_lse.permute(2, 0, 1).contiguous())


@attrs.frozen
class _Model:
    """The rounding model's constants; ``row`` evaluates the bounds of one query row."""

    u_scale: float
    u_p: float
    u_out: float
    scale: float
    floor: float
    z: float
    rank: int
    rounded_normaliser: bool = False

    def row(self, q: torch.Tensor, keys: torch.Tensor, errors: torch.Tensor,
            errors_sq_t: torch.Tensor, errors_t: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(out bound [h, R], lse bound [h], reference out [h, R], reference lse [h])`` of
        one query row over ``h`` heads (``q [h, D]``) and the ``keys [N, D]`` it sees, each
        element off by at most ``errors [N, D]`` (``errors_sq_t``, ``errors_t``: its square
        and itself, transposed)."""
        u, z = self.u_scale, self.z
        s = q @ keys.t() * self.scale                                          # [h, N]
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        a = (q.square() @ errors_sq_t).sqrt() * self.scale   # sqrt(sum_d q_d^2 E_jd^2)
        w = q.abs() @ errors_t * self.scale                  # sum_d |q_d| E_jd
        h_j = z * a
        h_max = h_j.max(dim=-1).values
        s_mean = (p * s).sum(dim=-1, keepdim=True)
        # log sum_j p_j e^(eta_j), |eta_j| <= h_j: between log(1 - B1) and log(1 + B1 + B2),
        # B1 bounding |sum_j p_j eta_j|, B2 = sum_j p_j phi(h_j), phi(x) = e^x - 1 - x (the
        # convexity remainder), and never beyond max_j h_j
        first = torch.minimum((p * w).sum(dim=-1),
                              z * (p.square() * a.square()).sum(dim=-1).sqrt())
        convex = (p * torch.expm1(h_j) - p * h_j).sum(dim=-1)
        moved_lse = torch.maximum(torch.log1p(first + convex),
                                  -torch.log1p(-first.clamp(max=1 - 1e-12)))
        moved_lse = torch.minimum(moved_lse, h_max)
        lse_bound = u * (s.abs().max(dim=-1).values + h_max) + moved_lse + self.floor
        v = keys[:, :self.rank]                                                # [N, R]
        e_v = errors[:, :self.rank]
        out = p @ v                                                            # [h, R]
        # Cov_p(s, v_c) and sum_j p_j^2 a_j^2 (v_jc - o_c)^2, expanded into matmuls
        cov = (p * s) @ v - s_mean * out
        pa = p.square() * a.square()
        moved = (pa @ v.square() - 2 * out * (pa @ v)
                 + out.square() * pa.sum(dim=-1, keepdim=True)).clamp_min(0).sqrt()
        value_err = torch.minimum(p @ e_v, z * (p.square() @ e_v.square()).sqrt())
        if self.rounded_normaliser:   # sum_j p_j rho_j (v_jc - o_c): the weights renormalised
            ps = p.square()
            abs_v = p @ v.abs() + out.abs()          # >= sum_j p_j |v_jc - o_c|
            sq_v = (ps @ v.square() - 2 * out * (ps @ v)
                    + out.square() * ps.sum(dim=-1, keepdim=True)).clamp_min(0).sqrt()
        else:
            abs_v, sq_v = p @ v.abs(), (p.square() @ v.square()).sqrt()
        # p'_j / p_j = e^(x_j), x_j = eta_j - log sum_k p_k e^(eta_k), |x_j| <= g_j: the
        # first order is the terms above, the rest sum_j p_j phi(x_j) (v_jc - o_c), and the
        # moved weights times the values' own errors
        lam = moved_lse + u * (s - s_mean).abs().max(dim=-1).values
        g = u * (s - s_mean).abs() + h_j + lam.unsqueeze(-1)
        remainder = p * (torch.expm1(g) - g)
        second = remainder @ v.abs() + out.abs() * remainder.sum(dim=-1, keepdim=True)
        cross = (p * torch.expm1(g)) @ e_v
        total = (u * out.abs() + u * cov.abs() + z * moved + value_err
                 + torch.minimum(self.u_p * abs_v, z * self.u_p * sq_v) + second + cross)
        out_bound = (total + self.u_out * (out.abs() + total)
                     + self.floor * v.abs().max(dim=0).values.unsqueeze(0))
        return out_bound, lse_bound, out, lse
