"""FP8 e4m3 block quantization as DeepSeek-V3 ships it.

A quantized ``W [out, in]`` is stored as ``float8_e4m3fn`` next to ``weight_scale_inv
[ceil(out / bo), ceil(in / bi)]`` (float32): block ``(i, j)`` of ``(bo, bi)`` elements
dequantizes as ``fp8 * scale_inv[i, j]`` (the last blocks may be partial).
``dequantize_fp8_block`` does that into a destination of any float dtype, a few block rows at a
time (a bounded float32 temporary); ``quantize_fp8_block`` is its inverse up to e4m3 rounding
(absmax scaling to 448, e4m3's largest finite value), for making FP8 copies of checkpoints.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_E4M3_MAX", "dequantize_fp8_block", "quantize_fp8_block", "scale_shape"]

#: The largest finite float8_e4m3fn value.
FP8_E4M3_MAX = 448.0
#: Block rows dequantized at once (bounds the float32 temporary).
_ROW_BLOCKS_PER_CHUNK = 8


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a ``[out, in]`` weight with ``(bo, bi)`` blocks."""
    out, inp = shape
    return -(-out // block[0]), -(-inp // block[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """``out [out, in]`` (any float dtype) = ``weight`` (float8_e4m3fn) times its block scales
    ``scale_inv``; ``ValueError`` on a dtype or shape mismatch. Returns ``out``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    expected = scale_shape((int(weight.shape[0]), int(weight.shape[1])), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of a {list(weight.shape)} weight with "
                         f"{list(block)} blocks must be {list(expected)}, got "
                         f"{list(scale_inv.shape)}")
    if tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"out must be {list(weight.shape)}, got {list(out.shape)}")
    bo, bi = block
    rows, cols = weight.shape
    scales = scale_inv.float()
    step = bo * _ROW_BLOCKS_PER_CHUNK
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        s = scales[r0 // bo:-(-r1 // bo)].repeat_interleave(bo, dim=0)[:r1 - r0]
        s = s.repeat_interleave(bi, dim=1)[:, :cols]
        out[r0:r1].copy_(weight[r0:r1].float() * s)
    return out


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 [out, in], scale_inv [ceil(out/bo), ceil(in/bi)] float32)`` of a 2-D float
    ``weight``: each block scaled so its largest magnitude maps to ``FP8_E4M3_MAX``."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"expected a 2-D float weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    bo, bi = block
    rows, cols = weight.shape
    n_r, n_c = scale_shape((int(rows), int(cols)), block)
    padded = torch.zeros(n_r * bo, n_c * bi, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(n_r, bo, n_c, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_E4M3_MAX
    scaled = blocks / scale_inv[:, None, :, None]
    fp8 = scaled.reshape(n_r * bo, n_c * bi)[:rows, :cols].to(torch.float8_e4m3fn)
    return fp8.contiguous(), scale_inv
