"""FLASHINFER: flashinfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (SM80+).

The wrapper's kernel backend follows the GPU: ``fa3`` on SM90 (Hopper; it takes 192/128 and equal
head dims of 64/128/256), ``cutlass`` on the SM100 family (192/128 and 128/128), ``fa2`` everywhere
else on SM80+. A wrapper holds one plan, so the backend keeps one wrapper per call of a step (the
causal new-token call and one per context chunk), re-planned in ``prepare_metadata`` from the host
``cu_seqlens`` (``plan`` copies them to the GPU; it needs the input dtype, taken from the engine
config, else planned again at the first run). All wrappers share one 128 MiB float workspace per
device (the container's ``kernel_workspaces``). ``run`` writes ``out`` in place and the LSE straight
into the contract's ``[H, T]`` natural-log buffer (``lse_base="ln"``, ``lse_layout="HN"``; the
kernels themselves write base 2, which flashinfer converts).

flashinfer-python is imported only when availability is asked or at first use. The argument
construction is kept apart from the launch (``plan_kwargs``, ``run_kwargs``) so that contract
tests can bind it to the installed package's signatures without a GPU. Not run on a GPU in this
project's CI; see docs/gpu-results.md.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from app._types import ComputeCapabilities, DeviceCapability
from app.backends.prefill.kernel_base import (
    KernelWorkspaces,
    RaggedKernelBackend,
    RaggedLayout,
    StepLayouts,
    unit_stride,
)
from app.backends.vendors import (
    FLASHINFER_CAPABILITIES,
    FLASHINFER_INSTALL_HINT,
    FLASHINFER_PACKAGE,
    probe_flashinfer,
)

if TYPE_CHECKING:
    from app.config import EngineConfig

__all__ = ["INSTALL_HINT", "FlashInferBackend", "FlashInferPrefillBackend", "wrapper_backend_for"]

#: The float workspace every wrapper of a container shares, per device.
WORKSPACE_BYTES = 128 * 1024 * 1024


#: Why FLASHINFER cannot run without flashinfer-python (``app.backends.vendors``).
INSTALL_HINT = FLASHINFER_INSTALL_HINT
#: The flashinfer module, or None (``app.backends.vendors``; tests swap it here).
_probe = probe_flashinfer


def wrapper_backend_for(capability: DeviceCapability, qk_head_dim: int, v_head_dim: int) -> str:
    """The wrapper ``backend=`` for a GPU and head dims: fa3 (SM90), cutlass (SM100), fa2."""
    dims = (qk_head_dim, v_head_dim)
    if capability.major == 9 and (dims == (192, 128)
                                  or (qk_head_dim == v_head_dim and qk_head_dim in (64, 128, 256))):
        return "fa3"
    if capability.major == 10 and dims in ((192, 128), (128, 128)):
        return "cutlass"
    return "fa2"


class FlashInferPrefillBackend(RaggedKernelBackend):
    """flashinfer's ragged prefill wrapper (fa2 / fa3 / cutlass), SM80 and newer."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supports_out: ClassVar[bool] = True
    requires_device_capability: ClassVar[bool] = True

    #: SM80 (Ampere) and newer.
    compute_capabilities: ClassVar[ComputeCapabilities] = FLASHINFER_CAPABILITIES
    #: flashinfer-python (late-bound: tests swap the module's ``_probe``).
    probe = staticmethod(lambda: _probe())
    kernel_package: ClassVar[str | None] = FLASHINFER_PACKAGE
    install_hint: ClassVar[str] = FLASHINFER_INSTALL_HINT

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, config: EngineConfig | None = None,
                 *, device_capability: DeviceCapability | None = None,
                 workspaces: KernelWorkspaces | None = None) -> None:
        super().__init__(num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, config, device_capability=device_capability,
                         workspaces=workspaces)
        self._wrappers: dict[int, Any] = {}
        self._planned: dict[int, torch.dtype] = {}

    def _prepare_step(self, layouts: StepLayouts) -> None:
        """Plan every call of the step now when the inputs' dtype is known (the engine
        config's), else at each call's first run."""
        self._planned = {}
        if layouts.new_tokens.cu_q.device.type != "cuda" or self.config is None:
            return  # planned at the first run, once the dtype is known
        dtype = self.config.model.dtype
        if dtype in self.supported_dtypes:
            for call, layout in self._calls(layouts):
                self._plan_call(call, layout, dtype)

    @staticmethod
    def _calls(layouts: StepLayouts) -> list[tuple[int, RaggedLayout]]:
        return [(-1, layouts.new_tokens), *enumerate(layouts.chunks)]

    def plan_kwargs(self, layout: RaggedLayout, causal: bool, dtype: torch.dtype
                    ) -> dict[str, Any]:
        """The keyword arguments of ``wrapper.plan`` for one call (host indptrs)."""
        return {"qo_indptr": layout.cu_q_cpu, "kv_indptr": layout.cu_kv_cpu,
                "num_qo_heads": self.num_heads, "num_kv_heads": self.num_heads,
                "head_dim_qk": self.qk_head_dim, "head_dim_vo": self.v_head_dim,
                "causal": causal, "sm_scale": self.scale, "q_data_type": dtype,
                "kv_data_type": dtype, "o_data_type": dtype}

    @staticmethod
    def run_kwargs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None, natural_lse: bool) -> dict[str, Any]:
        """The keyword arguments of ``wrapper.run``; ``natural_lse``: the installed flashinfer
        takes ``lse_base``/``lse_layout`` (0.7.2+), so ``lse`` is written as ``[H, T]`` ln."""
        kwargs: dict[str, Any] = {"q": q, "k": k, "v": v, "out": out,
                                  "return_lse": lse is not None}
        if lse is not None and natural_lse:
            kwargs.update(lse=lse, lse_base="ln", lse_layout="HN")
        return kwargs

    def wrapper_kwargs(self, capability: DeviceCapability) -> dict[str, Any]:
        """The keyword arguments of the wrapper's constructor (minus the workspace)."""
        return {"kv_layout": "NHD",
                "backend": wrapper_backend_for(capability, self.qk_head_dim, self.v_head_dim)}

    def _wrapper(self, call: int, device: torch.device) -> Any:
        wrapper = self._wrappers.get(call)
        if wrapper is None:
            module = _probe()
            if module is None:
                raise RuntimeError(self.unavailable_reason())
            kwargs = self.wrapper_kwargs(self._require_capability())
            workspace = self._workspace("flashinfer-float", WORKSPACE_BYTES, device)
            wrapper = module.BatchPrefillWithRaggedKVCacheWrapper(workspace, **kwargs)
            self._wrappers[call] = wrapper
        return wrapper

    def _plan_call(self, call: int, layout: RaggedLayout, dtype: torch.dtype) -> None:
        """Plan one call's wrapper (the new tokens: -1, or a context chunk) for ``dtype``."""
        if layout.total_q == 0 or layout.total_kv == 0:
            return
        self._wrapper(call, layout.cu_q.device).plan(**self.plan_kwargs(layout, call == -1,
                                                                        dtype))
        self._planned[call] = dtype

    def _launch(self, call: int, layout: RaggedLayout, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, causal: bool, out: torch.Tensor, lse: torch.Tensor | None
                ) -> None:
        if self._planned.get(call) != q.dtype:
            self._plan_call(call, layout, q.dtype)
        wrapper = self._wrapper(call, q.device)
        natural = _takes_lse_base(wrapper.__class__)
        result = wrapper.run(**self.run_kwargs(q, k, unit_stride(v), out, lse, natural))
        if lse is not None and not natural:
            self._copy_kernel_lse(result[1], layout, lse, tokens_first=True, base2=True)


@functools.cache
def _takes_lse_base(wrapper_cls: Any) -> bool:
    params = inspect.signature(wrapper_cls.run).parameters
    return "lse_base" in params and "lse_layout" in params


#: The class's old name (deprecated alias: its name now says its kind).
FlashInferBackend = FlashInferPrefillBackend
