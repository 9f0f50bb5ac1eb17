"""The public base of kernel backends: ``RaggedKernelBackend``, what the built-in prefill
kernels share beyond the contract. Third-party backends build on it as the built-ins do.

The contract's template (every check, ``out=``, the LSE layout, empty batches and rows that see
no key) is ``MLAPrefillBackend``'s, so a backend built on ``MLAPrefillBackend`` alone is checked
the same way. This base adds what a kernel needs: CUDA tensors (``requires_cuda``), an LSE
buffer even when the caller wants none (``needs_lse_buffer``), the kernel workspaces, the step
cache of derived tensors, a kernel's LSE turned into the contract's layout
(``_copy_kernel_lse``), and one hook, ``_launch``. The layouts, checks, ``StepCache`` and
workspaces it used to define are re-exported here from where they live now.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from app.backends.lse import lse_rows_to_heads_tokens
from app.backends.prefill.base import MLAPrefillBackend, StepCache
from app.backends.prefill.checks import (
    check_attention_inputs,
    empty_rows_mask,
    zero_empty_rows,
)
from app.backends.prefill.metadata import RaggedLayout, StepLayouts, check_cu_seqlens
from app.backends.workspaces import KernelWorkspaces

if TYPE_CHECKING:
    from collections.abc import Sequence

    from app._types import DeviceCapability

__all__ = [
    "KernelWorkspaces",
    "RaggedKernelBackend",
    "RaggedLayout",
    "StepCache",
    "StepLayouts",
    "check_attention_inputs",
    "check_cu_seqlens",
    "empty_rows_mask",
    "unit_stride",
    "zero_empty_rows",
]


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (a split ``v`` view is), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


class RaggedKernelBackend(MLAPrefillBackend):
    """What every built-in prefill kernel backend shares; a subclass implements ``_launch``.

    ``_run_prefill`` (the contract's kernel hook) hands ``_launch`` an LSE buffer when the
    kernel always writes one (``needs_lse_buffer``); ``_check_inputs`` adds the kernel's device
    (``requires_cuda``) to the contract's checks.
    """

    supported_dtypes: ClassVar[Sequence[torch.dtype]] = (torch.float16, torch.bfloat16)
    #: Whether the kernel needs CUDA tensors.
    requires_cuda: ClassVar[bool] = True
    #: Whether ``_launch`` always needs an LSE buffer (even when the caller wants none).
    needs_lse_buffer: ClassVar[bool] = False

    def _check_inputs(self, layout: RaggedLayout, q: object, k: object, v: object,
                      out: object) -> None:
        """The contract's checks, then the kernel's device."""
        super()._check_inputs(layout, q, k, v, out)
        if self.requires_cuda and isinstance(q, torch.Tensor) and q.device.type != "cuda":
            raise ValueError(f"{self._label()}: expected CUDA tensors (the kernel runs on a "
                             f"GPU), got device {q.device}")

    def _run_prefill(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                     ) -> None:
        if lse is None and self.needs_lse_buffer:
            lse = torch.empty(self.num_heads, layout.total_q, dtype=torch.float32,
                              device=q.device)
        self._launch(call, layout, q, k, v, causal, out, lse)

    @abstractmethod
    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        """Run the kernel: write ``out [T, H, Dv]`` and, if given, ``lse [H, T]`` (natural
        log). ``call`` is -1 for the new tokens, else the context chunk index."""

    def _workspace(self, name: str, nbytes: int, device: torch.device, *,
                   zeroed: bool = False) -> torch.Tensor:
        """Kernel workspace ``name`` on ``device`` from the workspaces passed in (the
        container's), else from this backend's own."""
        if self.workspaces is None:
            self.workspaces = KernelWorkspaces()
        return self.workspaces.get(name, nbytes, device, zeroed=zeroed)

    def _require_capability(self) -> DeviceCapability:
        """The capability passed in; ``ValueError`` when the backend was built without one (a
        GPU kernel needs it to pick its variant)."""
        if self.device_capability is None:
            raise ValueError(f"{self.get_name()}: built without a device_capability; build "
                             "it through the container (container.mla_prefill_backend()) or "
                             "pass device_capability=platform.get_device_capability()")
        return self.device_capability

    def _token_index(self, layout: RaggedLayout,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(request, position)`` of every query token (device tensors, cached per step)."""
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            req = torch.repeat_interleave(torch.arange(layout.batch),
                                          torch.tensor(layout.q_lens, dtype=torch.long))
            pos = torch.arange(layout.total_q) - torch.tensor(layout.q_starts,
                                                              dtype=torch.long)[req]
            return req.to(device, non_blocking=True), pos.to(device, non_blocking=True)

        return self._step_cache.get(layout, "index", make)

    def _kv_lens(self, layout: RaggedLayout, device: torch.device) -> torch.Tensor:
        """Per-request KV lengths, int32, on ``device`` (cached per step)."""
        return self._step_cache.get(layout, "kv_lens", lambda: torch.tensor(
            layout.kv_lens, dtype=torch.int32).to(device, non_blocking=True))

    def _copy_kernel_lse(self, lg: torch.Tensor, layout: RaggedLayout, lse: torch.Tensor, *,
                         tokens_first: bool, base2: bool = False) -> None:
        """A kernel's LSE into ``lse``: ``[T, H]`` (``tokens_first``), ``[H, T]``, or a
        padded per-request ``[B, H, L]`` (gathered)."""
        if lg.dim() == 3:
            req, pos = self._token_index(layout, lg.device)
            lg, tokens_first = lg[req, :, pos], True
        lse_rows_to_heads_tokens(lg, self.num_heads, layout.total_q, tokens_first=tokens_first,
                                 base2=base2, out=lse)
