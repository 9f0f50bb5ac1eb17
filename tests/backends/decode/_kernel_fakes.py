"""CPU stand-ins for flashinfer's and tokenspeed's MLA decode kernels.

Each stand-in first binds its arguments to the *installed* package's function (so a misspelt or
missing argument fails here as it would on a GPU), runs the checks the real entry point runs
that matter to the caller (flashinfer's MLA wrapper's plan / run agreement and CSR
metadata, as its public API documents them, ``_flashinfer_contract``; tokenspeed's workspace
size computed with the package's own split heuristics), then computes the attention with
``app.testing.reference_decode`` and hands it back as the library does: base-2 LSE unless
natural log is asked (flashinfer), always base 2 (tokenspeed); bf16 output for trtllm-gen and
for tokenspeed's FP8 path.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from app.testing import reference_decode
from tests.backends.decode import _flashinfer_contract as public

LOG2E = 1.0 / math.log(2.0)


def _paged_reference(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                     seq_lens: list[int], rank: int, bmm1: float, bmm2: float,
                     causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, Q, H, rank]`` (float64) and ``lse [B, Q, H]`` (natural log): logits
    ``bmm1 * q.k`` (bottom-right causal inside the step), output ``bmm2 * p @ v``."""
    if not causal and q.shape[1] > 1:
        raise AssertionError("the decode stand-ins only model causal multi-token steps")
    out, lse = reference_decode(q.float(), kv.float(), table, seq_lens, rank, bmm1)
    return out * bmm2, lse.permute(1, 2, 0)                      # kernels' [B, Q, H]


def _poison_like_fa3(out: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                     seq_lens: list[int], rank: int) -> None:
    """What flashinfer's fa2/fa3 MLA kernels make of a non-finite value in a multi-token
    step: a key past a row's diagonal but below the request's length is masked on the scores
    only, and its value still enters ``P @ V`` with probability 0 over the KV tile
    (``mla_hopper.cuh``, ``logits_mask_``), so ``0 * NaN`` reaches every row of the request
    (the H100 run: all 4 rows). Keys past the length are zero-filled at load: no effect."""
    batch, qlen = out.shape[0], out.shape[1]
    bs = kv.shape[1]
    for b in range(batch):
        n = seq_lens[b]
        pos = torch.arange(n - qlen + 1, n)            # masked for some row of the step
        values = kv[table[b][pos // bs].long(), pos % bs, :rank]
        if not bool(torch.isfinite(values).all()):
            out[b] = float("nan")


class FakeFlashInferMLA:
    """Stand-ins for ``BatchMLAPagedAttentionWrapper``, ``MLAPlanMetadata`` and
    ``trtllm_batch_decode_with_kv_cache_mla``, recording every call."""

    def __init__(self) -> None:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

        self.created: list[dict[str, Any]] = []
        self.plans: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.trtllm_calls: list[dict[str, Any]] = []
        #: Whether the wrapper's causal steps do what the fa2/fa3 kernels do with a masked
        #: key (its value still multiplied by probability 0 over the tile; see
        #: ``_poison_like_fa3``): on by default, as the H100 run measured.
        self.tile_wide_nonfinite_values = True
        self.plan_metadata = MLAPlanMetadata
        real_trtllm = trtllm_batch_decode_with_kv_cache_mla
        fake = self

        class Wrapper:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                a = inspect.signature(BatchMLAPagedAttentionWrapper.__init__).bind(
                    self, *args, **kwargs).arguments
                fake.created.append(dict(a))
                self.plan_args: dict[str, Any] | None = None

            def plan(self, *args: Any, **kwargs: Any) -> None:
                a = public.bind(BatchMLAPagedAttentionWrapper.plan, self, *args, **kwargs)
                md = a["metadata"]
                if not isinstance(md, MLAPlanMetadata) or md.qo_indptr is None:
                    raise ValueError("expected MLAPlanMetadata.csr(...)")
                public.check_csr(md, a["page_size"])
                if a["query_layout"] != "packed" or a["kv_cache_layout"] != "packed":
                    raise AssertionError("the stand-in models packed query and kv_cache only")
                fp8 = a["kv_data_type"] == torch.float8_e4m3fn
                if fp8 and a["q_data_type"] != torch.bfloat16:
                    raise ValueError("FP8 MLA caches need a bf16 query")
                fake.plans.append(a)
                self.plan_args = a

            def run(self, *args: Any, **kwargs: Any) -> Any:
                a = public.bind(BatchMLAPagedAttentionWrapper.run, self, *args, **kwargs)
                fake.runs.append(dict(a))
                p = self.plan_args
                if p is None:
                    raise RuntimeError("BatchMLAPagedAttentionWrapper.run() called before plan()")
                public.check_run_agrees_with_plan(p, a)
                return fake._wrapper_attention(p, a)

        self.wrapper_cls = Wrapper

        def trtllm(*args: Any, **kwargs: Any) -> Any:
            a = inspect.signature(real_trtllm).bind(*args, **kwargs).arguments
            fake.trtllm_calls.append(dict(a))
            return fake._trtllm_attention(a)

        self.trtllm_decode: Callable[..., Any] = trtllm

    def _wrapper_attention(self, p: dict[str, Any], a: dict[str, Any]) -> Any:
        q, kv = a["query"], a["kv_cache"]
        if q.dim() != 3 or kv.dim() != 3:
            raise ValueError("packed query and kv_cache must have rank 3")
        if q.dtype != p["q_data_type"] or kv.dtype != p["kv_data_type"]:
            raise ValueError("query / kv_cache dtype does not match the plan")
        if kv.shape[1] != p["page_size"]:
            raise ValueError("kv_cache page size does not match the plan")
        md = p["metadata"]
        qo, kv_ptr = md.qo_indptr.tolist(), md.kv_indptr.tolist()
        lens = md.kv_len_arr.tolist()
        batch = len(lens)
        qlen = qo[1] - qo[0] if batch else 0
        if any(qo[b + 1] - qo[b] != qlen for b in range(batch)):
            raise AssertionError("the stand-in models uniform query lengths only")
        width = max((kv_ptr[b + 1] - kv_ptr[b] for b in range(batch)), default=0)
        table = torch.zeros(batch, max(width, 1), dtype=torch.int64)
        for b in range(batch):
            pages = md.kv_indices[kv_ptr[b]:kv_ptr[b + 1]]
            table[b, :pages.numel()] = pages
        kvf = kv.float()
        if kv.dtype == torch.float8_e4m3fn:  # dequantised by the kernel (ckv / kpe scales)
            rank = p["head_dim_ckv"]
            kvf[..., :rank] *= float(a["ckv_scale"])
            kvf[..., rank:] *= float(a["kpe_scale"])
        heads = q.shape[1]
        out, lse = _paged_reference(q.view(batch, qlen, heads, -1), kvf, table, lens,
                                    p["head_dim_ckv"], p["sm_scale"], 1.0,
                                    causal=p["causal"] or qlen == 1)
        if self.tile_wide_nonfinite_values and qlen > 1:
            _poison_like_fa3(out, kvf, table, lens, p["head_dim_ckv"])
        o = a.get("out")
        if o is None:
            o = torch.empty(q.shape[0], heads, p["head_dim_ckv"], dtype=q.dtype)
        o.copy_(out.reshape(o.shape))
        if not a.get("return_lse", False):
            return o
        lg = lse if a.get("return_lse_base_on_e", False) else lse * LOG2E
        buf = a.get("lse")
        if buf is None:
            buf = torch.empty(q.shape[0], heads, dtype=torch.float32)
        buf.copy_(lg.reshape(buf.shape))
        return o, buf

    def _trtllm_attention(self, a: dict[str, Any]) -> Any:
        q, kv, ws = a["query"], a["kv_cache"], a["workspace_buffer"]
        if a.get("backend") != "trtllm-gen":
            raise AssertionError("expected backend='trtllm-gen'")
        if q.dim() != 4 or kv.dim() != 3:
            raise ValueError("query must be [B, q_len, H, D] and kv_cache [pages, page, D]")
        if kv.shape[1] not in (32, 64):
            raise ValueError(f"trtllm-gen requires block_size in (32, 64), got {kv.shape[1]}")
        if 64 < q.shape[2] < 128:
            raise ValueError("trtllm-gen MLA decode does not support 64 < num_heads_q < 128")
        if q.dtype != kv.dtype or q.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError("trtllm-gen needs matching bf16 or fp8 query and kv_cache")
        if ws.dtype != torch.uint8 or bool(ws.any()):
            raise RuntimeError("trtllm-gen needs a zero-initialised uint8 workspace")
        if a.get("return_lse", False):  # the launcher carves the softmax-stats slab first
            slab = 8 * q.shape[2] * q.shape[0] * (-(-q.shape[1] // 256) * 256) + (1 << 20)
            if ws.numel() < slab:
                raise RuntimeError("Buffer overflow when allocating memory for "
                                   "trtllm_gen_softmax_workspace")
        seq_lens, table = a["seq_lens"], a["block_tables"]
        if seq_lens.dtype != torch.int32 or table.dtype != torch.int32:
            raise ValueError("seq_lens and block_tables must be int32")
        if table.shape[0] != q.shape[0]:
            raise ValueError("block_tables batch != query batch")
        lens = seq_lens.tolist()
        if a["max_seq_len"] != max(lens) or (not a.get("is_var_seq", True)
                                            and len(set(lens)) > 1):
            raise AssertionError("max_seq_len / is_var_seq do not describe seq_lens")
        out, lse = _paged_reference(q, kv, table, lens, a["kv_lora_rank"],
                                    float(a["bmm1_scale"]), float(a["bmm2_scale"]))
        o = a.get("out")
        if o is None:
            o = torch.empty(*q.shape[:3], a["kv_lora_rank"], dtype=torch.bfloat16)
        if o.dtype != torch.bfloat16:
            raise ValueError("out must be bfloat16")
        o.copy_(out)
        if not a.get("return_lse", False):
            return o
        lg = lse if a.get("return_lse_base") == "basee" else lse * LOG2E
        buf = a.get("lse")
        if buf is None:
            buf = torch.empty(q.shape[0] * q.shape[1], q.shape[2], dtype=torch.float32)
        buf.copy_(lg.reshape(buf.shape))
        return o, buf


def tokenspeed_required_workspace(batch: int, q_len: int, heads: int, rank: int,
                                  max_seq_len: int, dtype: torch.dtype, num_sms: int,
                                  capability: tuple[int, int] = (10, 0)) -> int:
    """The bytes ``tokenspeed_mla_decode`` asserts, from the package's own helpers, following
    its effective-layout logic (mla_decode.py: fold or pack the query, then split-KV)."""
    from tokenspeed_mla.mla_decode import _get_split_kv_and_workspace_size
    from tokenspeed_mla.mla_helpers import (
        ceil_div,
        compute_q_tile_layout,
        get_mla_decode_fold_sq_factor,
        select_mla_decode_tilers,
    )

    fp8 = dtype == torch.float8_e4m3fn
    tiler, _ = select_mla_decode_tilers(heads, q_len, is_fp8=fp8,
                                        compute_capability=capability)
    fold = get_mla_decode_fold_sq_factor(heads, q_len, tiler[0])
    h_eff, q_eff = heads * fold, q_len // fold
    if tiler[0] == 128 and ceil_div(heads * q_len, tiler[0]) < q_eff:  # contiguous q: packed
        _, q_eff, _ = compute_q_tile_layout(heads, q_len, tiler[0])
        h_eff = tiler[0]
    _, size = _get_split_kv_and_workspace_size(batch, q_eff, h_eff, rank, num_sms,
                                               max_seq_len, dtype, tiler)
    return int(size)


def make_tokenspeed_decode(calls: list[dict[str, Any]], num_sms: int
                           ) -> Callable[..., Any]:
    """A stand-in ``tokenspeed_mla_decode`` (bound to the installed signature)."""
    from tokenspeed_mla import tokenspeed_mla_decode as real

    def decode(*args: Any, **kwargs: Any) -> Any:
        a = inspect.signature(real).bind(*args, **kwargs).arguments
        calls.append(dict(a))
        q, kv, ws = a["query"], a["kv_cache"], a["workspace_buffer"]
        if kv.dtype != q.dtype or q.dtype not in (torch.float16, torch.bfloat16,
                                                  torch.float8_e4m3fn):
            raise AssertionError(f"kv_cache dtype {kv.dtype} must match query dtype {q.dtype}")
        batch, q_len, heads, dim = q.shape
        rank = a["kv_lora_rank"]
        if dim != rank + a["qk_rope_head_dim"] or not q.is_contiguous():
            raise AssertionError("query must be contiguous [B, q_len, H, rank + rope]")
        page = kv.shape[1]
        if 128 % page or page == 1 or heads > 128:
            raise ValueError("tokenspeed_mla_decode: unsupported configuration")
        table, seq_lens = a["block_tables"], a["seq_lens"]
        if table.shape[0] != batch or seq_lens.shape[0] != batch:
            raise AssertionError("block_tables / seq_lens batch != query batch")
        lens = seq_lens.tolist()
        if a["max_seq_len"] != max(lens) or (not a.get("is_var_seq", True)
                                            and len(set(lens)) > 1):
            raise AssertionError("max_seq_len / is_var_seq do not describe seq_lens")
        need = tokenspeed_required_workspace(batch, q_len, heads, rank, a["max_seq_len"],
                                             q.dtype, num_sms)
        if ws.dtype != torch.int8 or ws.numel() < need:
            raise AssertionError(f"workspace_buffer too small: {ws.numel()} bytes, "
                                 f"need {need} bytes")
        out, lse = _paged_reference(q, kv, table, lens, rank, a["softmax_scale"],
                                    a.get("output_scale", 1.0), a.get("causal_mask", True))
        o = a.get("out")
        if o is None:
            o = torch.empty(batch, q_len, heads, rank,
                            dtype=torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
        o.copy_(out)
        if a.get("return_lse", False):
            return o, (lse * LOG2E).float()  # base 2, [B, q_len, H]
        return o

    return decode
