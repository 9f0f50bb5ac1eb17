"""CPU stand-ins for the GPU kernels, with each library's documented conventions.

Every fake first binds its arguments to the *real* function's signature (the installed package,
or for flash-attn the signature copied from the upstream source), then computes the attention
with the float64 reference and hands it back the way the library does: flashinfer and
trtllm-gen in base 2 as ``[T, H]``, tokenspeed in natural log as ``[T, H]`` with bf16 output,
FA2/FA4 in natural log as ``[H, T]``. Rows that see no key get deliberately odd values (FA2's
``+inf`` LSE, garbage output) so that the backends' normalisation is exercised too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from app.testing import reference_attention

LOG2E = 1.0 / math.log(2.0)


def fa2_varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,  # type: ignore[no-untyped-def]
                         dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False,
                         return_attn_probs=False, block_table=None):
    """flash-attn 2.8.3 ``flash_attn.flash_attn_varlen_func`` (flash_attn_interface.py)."""


def fa4_varlen_signature(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,  # type: ignore[no-untyped-def]
                         max_seqlen_k=None, seqused_q=None, seqused_k=None, page_table=None,
                         softmax_scale=None, causal=False, window_size=(None, None),
                         learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                         deterministic=False, score_mod=None, mask_mod=None,
                         block_sparse_tensors=None, cu_total_m_blocks=None,
                         cu_total_n_blocks=None, aux_tensors=None, return_lse=False):
    """flash-attn-4 ``flash_attn.cute.flash_attn_varlen_func`` (flash_attn/cute/interface.py)."""


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
               cu_kv: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference out (float64), LSE ``[H, T]`` (ln) and the mask of rows that see no key."""
    out, lse = reference_attention(q, k, v, cu_q.cpu().tolist(), cu_kv.cpu().tolist(), causal,
                                   scale)
    return out, lse, torch.isneginf(lse[0])


def _garble(out: torch.Tensor, lse: torch.Tensor, dead: torch.Tensor, lse_value: float
            ) -> None:
    out[dead] = 123.0
    lse[:, dead] = lse_value


def make_fa2(calls: list[dict[str, Any]]) -> Callable[..., Any]:
    def fa2(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(fa2_varlen_signature).bind(*args, **kwargs)
        a = bound.arguments
        calls.append(dict(a))
        q, k, v = a["q"], a["k"], a["v"]
        if v.shape[-1] != q.shape[-1]:
            raise RuntimeError("FA2: v must have the q/k head dim")
        out, lse, dead = _attention(q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"],
                                    a.get("causal", False), a["softmax_scale"])
        _garble(out, lse, dead, float("inf"))
        o = out.to(q.dtype)
        if a.get("return_attn_probs", False):
            return o, lse.float(), None
        return o

    return fa2


def make_fa4(calls: list[dict[str, Any]]) -> Callable[..., Any]:
    def fa4(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(fa4_varlen_signature).bind(*args, **kwargs)
        a = bound.arguments
        calls.append(dict(a))
        out, lse, dead = _attention(a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                                    a["cu_seqlens_k"], a.get("causal", False),
                                    a["softmax_scale"])
        out[dead] = 0.0
        return out.to(a["q"].dtype), (lse.float() if a.get("return_lse") else None)

    return fa4


def make_trtllm(real: Callable[..., Any], calls: list[dict[str, Any]]) -> Callable[..., Any]:
    def trtllm(*args: Any, **kwargs: Any) -> Any:
        a = inspect.signature(real).bind(*args, **kwargs).arguments
        calls.append(dict(a))
        ws = a["workspace_buffer"]
        if bool(ws.any()):
            raise RuntimeError("trtllm-gen needs a zero-initialised workspace")
        q, k, v = a["query"], a["key"], a["value"]
        if (q.shape[-1], k.shape[-1], v.shape[-1]) not in ((192, 192, 128), (128, 128, 128),
                                                          (256, 256, 256)):
            raise AssertionError("Unsupported head dimensions")
        kv_lens = (a["cum_seq_lens_kv"][1:] - a["cum_seq_lens_kv"][:-1]).to(torch.int32)
        if a["seq_lens"].dtype != torch.int32 or not torch.equal(a["seq_lens"], kv_lens):
            raise RuntimeError("seq_lens must be the int32 KV lengths")
        out, lse, dead = _attention(q, k, v, a["cum_seq_lens_q"], a["cum_seq_lens_kv"],
                                    a["is_causal"], a["bmm1_scale"])
        out[dead] = 0.0
        o = a.get("out")
        if o is None:
            o = torch.empty(out.shape, dtype=q.dtype)
        o.copy_(out)
        lse_nh = (lse.t() * LOG2E).float()  # base 2, [T, H]
        if not a["return_lse"]:
            return o
        buf = a.get("lse")
        if buf is None:
            buf = torch.empty_like(lse_nh)
        buf.copy_(lse_nh)
        return o, buf

    return trtllm


def make_tokenspeed(real: Callable[..., Any], calls: list[dict[str, Any]]
                    ) -> Callable[..., Any]:
    def prefill(*args: Any, **kwargs: Any) -> Any:
        a = inspect.signature(real).bind(*args, **kwargs).arguments
        calls.append(dict(a))
        q, k, v = a["query"], a["key"], a["value"]
        if not q.dtype == k.dtype == v.dtype:
            raise TypeError("q, k and v must share one dtype")
        cu_q = a.get("cum_seq_lens_q")
        cu_kv = a["cum_seq_lens"]
        out, lse, dead = _attention(q, k, v, cu_kv if cu_q is None else cu_q, cu_kv,
                                    a.get("is_causal", True), a["softmax_scale"])
        out[dead] = 0.0
        o = a.get("out")
        if o is None:
            o = torch.empty(out.shape, dtype=torch.bfloat16)
        if o.dtype != torch.bfloat16 or not o.is_contiguous():
            raise ValueError("out must be contiguous bf16")
        o.copy_(out)
        if a.get("return_lse", False):
            return o, lse.t().contiguous().float()  # natural log, [T, H]
        return o

    return prefill


class FakeFlashInfer:
    """A stand-in ``flashinfer`` module with ``BatchPrefillWithRaggedKVCacheWrapper``."""

    def __init__(self, real_wrapper: Any, natural_lse: bool = True) -> None:
        run_sig = inspect.signature(real_wrapper.run)
        if not natural_lse:  # an older flashinfer: no lse_base / lse_layout
            run_sig = run_sig.replace(parameters=[
                p for name, p in run_sig.parameters.items()
                if name not in ("lse_base", "lse_layout")])
        self.created: list[dict[str, Any]] = []
        self.plans: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        fake = self

        class Wrapper:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                a = inspect.signature(real_wrapper.__init__).bind(self, *args, **kwargs)
                fake.created.append(dict(a.arguments))
                self._plan: dict[str, Any] | None = None

            def plan(self, *args: Any, **kwargs: Any) -> None:
                a = inspect.signature(real_wrapper.plan).bind(self, *args, **kwargs).arguments
                fake.plans.append(dict(a))
                self._plan = dict(a)

            def run(self, *args: Any, **kwargs: Any) -> Any:
                a = run_sig.bind(self, *args, **kwargs).arguments
                fake.runs.append(dict(a))
                p = self._plan
                if p is None:
                    raise RuntimeError("plan() before run()")
                q, k, v = a["q"], a["k"], a["v"]
                if q.dtype != p["q_data_type"]:
                    raise ValueError("q dtype does not match the plan")
                out, lse, dead = _attention(q, k, v, p["qo_indptr"], p["kv_indptr"],
                                            p.get("causal", False), p["sm_scale"])
                _garble(out, lse, dead, float("-inf"))
                o = a.get("out")
                if o is None:
                    o = torch.empty(out.shape, dtype=q.dtype)
                o.copy_(out)
                if not a.get("return_lse", False):
                    return o
                base, layout = a.get("lse_base", "log2"), a.get("lse_layout", "NH")
                lg = lse if base == "ln" else lse * LOG2E
                lg = lg.float() if layout == "HN" else lg.t().float()
                buf = a.get("lse")
                if buf is None:
                    buf = torch.empty(lg.shape, dtype=torch.float32)
                buf.copy_(lg)
                return o, buf

        Wrapper.run.__signature__ = run_sig  # type: ignore[attr-defined]
        self.BatchPrefillWithRaggedKVCacheWrapper = Wrapper


class RealRunFlashInfer:
    """A stand-in ``flashinfer`` module whose ``BatchPrefillWithRaggedKVCacheWrapper`` keeps
    the installed package's own ``run`` (its argument checks, LSE staging and base/layout
    conversion: ``_stage_lse`` / ``_finish_lse``), with a stand-in compiled module under it:
    ``ragged_run`` writes the output and a base-2 ``[T, H]`` LSE, as the fa2/fa3 kernels do.
    ``plan`` (which needs a GPU: pinned memory) records its arguments and sets what ``run``
    reads. ``kernel_calls`` counts the kernel launches; ``in_kernel`` is True inside one."""

    def __init__(self) -> None:
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper as Real
        from flashinfer.utils import MaskMode

        self.kernel_calls = 0
        self.in_kernel = False
        fake = self
        causal_mode = MaskMode.CAUSAL.value

        class Module:
            def ragged_run(self, *args: Any) -> None:
                fake.kernel_calls += 1
                fake.in_kernel = True
                try:
                    (q, k, v, cu_q, cu_kv, out, lse, mask_mode) = (args[3], args[4], args[5],
                                                                  args[6], args[7], args[8],
                                                                  args[9], args[10])
                    scale = args[21]
                    ref, lg, dead = _attention(q, k, v, cu_q, cu_kv, mask_mode == causal_mode,
                                               scale)
                    _garble(ref, lg, dead, float("-inf"))
                    out.copy_(ref)
                    if lse is not None:   # the kernels' own convention: base 2, [T, H]
                        lse.copy_((lg * LOG2E).t())
                finally:
                    fake.in_kernel = False

        class Wrapper(Real):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                inspect.signature(Real.__init__).bind(self, *args, **kwargs)
                self._backend = kwargs.get("backend", "auto")
                self._kv_layout = kwargs.get("kv_layout", args[1] if len(args) > 1 else "NHD")
                self._cached_module = Module()

            def plan(self, *args: Any, **kwargs: Any) -> None:
                a = inspect.signature(Real.plan).bind(self, *args, **kwargs).arguments
                self._qo_indptr_buf, self._kv_indptr_buf = a["qo_indptr"], a["kv_indptr"]
                self._qo_indptr_last = int(a["qo_indptr"][-1])
                self._causal = a.get("causal", False)
                self._sm_scale = a.get("sm_scale")
                self._cached_q_data_type = a.get("q_data_type")
                self._cached_kv_data_type = a.get("kv_data_type") or a.get("q_data_type")
                self._cached_o_data_type = a.get("o_data_type") or a.get("q_data_type")
                self._window_left, self._logits_soft_cap = -1, None
                self._rope_scale = self._rope_theta = None
                self._custom_mask_buf = self._mask_indptr_buf = None
                self._variant_owns_mask, self._jit_module = False, None
                self._prefix_len_ptr = self._token_pos_in_items_ptr = None
                self._max_item_len_ptr, self._token_pos_in_items_len = None, 0
                self._float_workspace_buffer = self._int_workspace_buffer = None
                self._plan_info, self.device = [], a["qo_indptr"].device

        self.BatchPrefillWithRaggedKVCacheWrapper = Wrapper
