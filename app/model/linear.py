"""Linear layers whose weights are laid out once, at model build, for the device's matmul path.

On a CPU, torch's bf16 ``F.linear`` runs oneDNN's brgemm matmul on the weight in its plain
``[out, in]`` layout, and oneDNN copies the weight into its blocked (VNNI) layout on *every*
call. For the few rows of a decode step that copy costs as much as the product itself:
measured on a 2-core AMD EPYC (AVX512-BF16), weights streamed from memory, one thread, 1-4
rows of an expert's ``[1408, 1024]``, 206 us plain vs 90 us reordered; 16 rows 277 vs 168 us;
a 1024-row prefill matmul about 5% faster. ``Linear`` reorders the weight once
(``torch.ops.mkldnn._reorder_linear_weight``, an opaque oneDNN tensor) and calls
``torch.ops.mkldnn._linear_pointwise`` on it, the pair torch's own compiler (inductor's
weight prepacking) emits for frozen CPU linears; the results equal ``F.linear``'s.

Which weights are reordered: those of a 16-bit compute dtype on a CPU where a probe (once per
process and dtype) finds both operators, reorders a small weight and gets ``F.linear``'s
result on it. Float32 keeps ``F.linear`` (MKL's sgemm, as transformers runs it, so the float32
tokens stay transformers'); so do other devices, and CPUs where oneDNN has no path for the
dtype (fp16 needs AVX512-FP16 or AVX-NE-CONVERT). ``APP_CPU_PACKED_LINEAR=0`` turns the
reordering off (it is read when a model is built).

The reordered copy is held beside the plain weight (which the caller's ``ModelWeights`` keeps):
a model built with reordering holds its matmul weights twice.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from app.backends.cpu.loader import read_switch

__all__ = ["PACKED_LINEAR_ENV", "Linear", "packed_linear_available"]

#: Set to ``0`` to keep every weight in its plain layout (``F.linear``).
PACKED_LINEAR_ENV = "APP_CPU_PACKED_LINEAR"


def _ops() -> tuple[Any, Any] | None:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch._C._has_mkldnn:
        return None
    try:
        return mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    ops = _ops()
    if ops is None:
        return False
    reorder, linear = ops
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    wide = torch.randn(5, 80, generator=gen).to(dtype)
    try:
        packed = reorder(weight, 5)
        # A row-strided input too: engines pass slices of wider activations.
        outs = [linear(x, packed, None, "none", [None], "")
                for x in (wide[:, :64].contiguous(), wide[:, 16:])]
    except RuntimeError:        # no oneDNN path for this dtype on this CPU
        return False
    for x, out in zip((wide[:, :64], wide[:, 16:]), outs, strict=True):
        want = F.linear(x, weight)
        if out.dtype != dtype or out.shape != want.shape or not torch.allclose(
                out.float(), want.float(), rtol=1e-2, atol=1e-2):
            return False
    return True


def packed_linear_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether ``Linear`` reorders weights of ``dtype`` on ``device`` (see the module
    docstring): a 16-bit dtype, a CPU, the oneDNN operators present and agreeing with
    ``F.linear``, and ``APP_CPU_PACKED_LINEAR`` not off (read strictly, as every
    ``APP_CPU_*`` switch: ``ValueError`` for a value that is neither on nor off)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not read_switch(PACKED_LINEAR_ENV):
        return False
    return _probe(dtype)


class Linear:
    """``y = x W^T`` for ``weight [out, in]`` (used as given: the caller converts it to the
    compute dtype and device first); reordered once where ``packed_linear_available``.

    ``x [..., in]`` in the weight's dtype -> ``[..., out]`` in that dtype. Thread-safe: the
    reordered weight is read-only.
    """

    __slots__ = ("_packed", "_pointwise", "weight")

    def __init__(self, weight: torch.Tensor, *, pack: bool = True) -> None:
        if weight.dim() != 2:
            raise ValueError(f"Linear: weight must be 2-D [out, in], got "
                             f"{list(weight.shape)}")
        self.weight = weight
        self._packed: torch.Tensor | None = None
        self._pointwise: Any = None
        if pack and packed_linear_available(weight.dtype, weight.device):
            ops = _ops()
            if ops is not None:
                self._packed = ops[0](weight.contiguous(), 1)
                self._pointwise = ops[1]

    @property
    def packed(self) -> bool:
        """Whether the weight was reordered."""
        return self._packed is not None

    @property
    def out_features(self) -> int:
        """``out``."""
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """``in``."""
        return int(self.weight.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the reordered copy (0 when the plain weight is used)."""
        if self._packed is None:
            return 0
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight)
        if x.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return self._pointwise(x, self._packed, None, "none", [None], "")  # type: ignore[no-any-return]
