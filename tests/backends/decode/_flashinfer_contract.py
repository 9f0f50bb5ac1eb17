"""flashinfer's MLA decode contract, as its public API documents it (flashinfer-python 0.7).

Only public names are read: the signatures of ``BatchMLAPagedAttentionWrapper.plan`` / ``run``
and ``trtllm_batch_decode_with_kv_cache_mla`` (their ``Literal`` choices included), and what
their docstrings say. flashinfer's private validators (``flashinfer.mla._batch_mla...``,
``flashinfer.mla._core``) move between patch releases (0.7.4 moved
``_check_trtllm_gen_mla_shape``), so the checks they make that matter to a caller are written
out here from the documentation instead.
"""

from __future__ import annotations

import inspect
import itertools
import typing
from collections.abc import Callable
from typing import Any

import torch

FP8 = torch.float8_e4m3fn

#: The cache dtypes each decode kernel reads, with the query dtype it reads them with, as
#: flashinfer documents them: fa2 / fa3 read a query and cache of one 16-bit dtype, fa3 also
#: an FP8 cache under a bf16 query (``plan``: ``scale_mode="kv-per-tensor"``, Hopper only);
#: trtllm-gen reads "the query-compatible dense dtype", bf16, or FP8 with an FP8 query
#: (``plan``: "TRTLLM-GEN supports 'bmm-tensor' for FP8 query/KV inputs").
DOCUMENTED_DTYPES: dict[str, dict[torch.dtype, torch.dtype]] = {
    "fa2": {torch.float16: torch.float16, torch.bfloat16: torch.bfloat16},
    "fa3": {torch.float16: torch.float16, torch.bfloat16: torch.bfloat16,
            FP8: torch.bfloat16},
    "trtllm-gen": {torch.bfloat16: torch.bfloat16, FP8: FP8},
}


def literal_choices(func: Callable[..., Any], name: str) -> tuple[Any, ...]:
    """The values the ``Literal`` annotation of ``func``'s parameter ``name`` allows."""
    annotation = typing.get_type_hints(func).get(name)
    if annotation is None:
        raise AssertionError(f"{func.__qualname__} has no annotated parameter {name!r}")
    for option in (annotation, *typing.get_args(annotation)):  # Optional[Literal[...]]
        if typing.get_origin(option) is typing.Literal:
            return typing.get_args(option)
    raise AssertionError(f"{func.__qualname__}({name}) is not a Literal: {annotation}")


def bind(func: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments bound to ``func``'s public signature, defaults applied."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _int32_vector(name: str, t: object) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor, got {t!r}")
    return [int(v) for v in t.tolist()]


def check_csr(metadata: Any, page_size: int) -> None:
    """``MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr)``: offsets from 0,
    non-decreasing, one entry per request, ``ceil(kv_len / page_size)`` pages per request."""
    qo = _int32_vector("qo_indptr", metadata.qo_indptr)
    kv = _int32_vector("kv_indptr", metadata.kv_indptr)
    pages = _int32_vector("kv_indices", metadata.kv_indices)
    lens = _int32_vector("kv_len_arr", metadata.kv_len_arr)
    if len(qo) != len(lens) + 1 or len(kv) != len(lens) + 1:
        raise ValueError(f"batch sizes disagree: {len(qo)} / {len(kv)} offsets, {len(lens)}")
    for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv)):
        if ptr[0] != 0 or any(b < a for a, b in itertools.pairwise(ptr)):
            raise ValueError(f"{name} must start at 0 and never decrease: {ptr}")
    if kv[-1] != len(pages):
        raise ValueError(f"kv_indptr ends at {kv[-1]} for {len(pages)} kv_indices")
    if [b - a for a, b in itertools.pairwise(kv)] != [-(-n // page_size) for n in lens]:
        raise ValueError(f"pages per request {kv} do not hold kv_len_arr {lens}")


def check_run_agrees_with_plan(plan: dict[str, Any], run: dict[str, Any]) -> None:
    """``plan``: "``lse_mode``, ``output_dtype``, ``output_scale``, ``scale_mode`` ... must
    agree with the subsequent call" of ``run`` (both dicts as :func:`bind` returns them)."""
    for name, func_name in (("lse_mode", "lse_mode"), ("scale_mode", "scale_mode"),
                            ("output_scale", "output_scale")):
        if plan[name] not in literal_choices(_wrapper().plan, func_name):
            raise ValueError(f"plan {name}={plan[name]!r} is not one flashinfer takes")
    wants_lse = run["return_lse"] or run["lse"] is not None
    lse_mode = "none" if not wants_lse else ("basee" if run["return_lse_base_on_e"]
                                              else "base2")
    if lse_mode != plan["lse_mode"]:
        raise ValueError(f"planned lse_mode {plan['lse_mode']!r}, run asks for {lse_mode!r}")
    output_dtype = plan["output_dtype"] or plan["q_data_type"]
    if run["out"] is not None and run["out"].dtype != output_dtype:
        raise ValueError(f"planned output {output_dtype}, run writes {run['out'].dtype}")
    if (run["o_scale"] is not None) != (plan["output_scale"] == "per-tensor"):
        raise ValueError("o_scale disagrees with the planned output_scale")
    kv_scales = (run["ckv_scale"] is not None or run["ckv_scale_arr"] is not None,
                 run["kpe_scale"] is not None)
    if plan["scale_mode"] == "kv-per-tensor" and kv_scales != (True, True):
        raise ValueError("an FP8 plan needs ckv_scale (or ckv_scale_arr) and kpe_scale")
    if plan["scale_mode"] == "default" and any(kv_scales):
        raise ValueError("KV scales are only valid with scale_mode='kv-per-tensor'")


def check_trtllm_shapes(call: dict[str, Any]) -> None:
    """The documented shapes of ``trtllm_batch_decode_with_kv_cache_mla``'s dense path:
    ``query [B, q_len, H, kv_lora_rank + rope]``, ``kv_cache [pages, page_size, D]`` (or
    ``[pages, 1, page_size, D]``) of the query's dtype, ``block_tables [B, max_pages]`` and
    ``seq_lens [B]`` int32, the ``lse`` buffer float32 ``[B * q_len, H]`` or
    ``[B, q_len, H]``."""
    q, kv, table, seq = (call[n] for n in ("query", "kv_cache", "block_tables", "seq_lens"))
    dim = call["kv_lora_rank"] + call["qk_rope_head_dim"]
    if q.dim() != 4 or q.shape[-1] != dim:
        raise ValueError(f"query must be [B, q_len, H, {dim}], got {tuple(q.shape)}")
    if kv.dim() == 4 and kv.shape[1] == 1:
        kv = kv.squeeze(1)
    if kv.dim() != 3 or kv.shape[-1] != dim or kv.dtype != q.dtype:
        raise ValueError(f"kv_cache must be [pages, page_size, {dim}] {q.dtype}, "
                         f"got {tuple(kv.shape)} {kv.dtype}")
    batch = q.shape[0]
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != batch:
        raise ValueError(f"block_tables must be int32 [{batch}, max_pages]")
    if seq.dtype != torch.int32 or tuple(seq.shape) != (batch,):
        raise ValueError(f"seq_lens must be int32 [{batch}]")
    if table.shape[1] * kv.shape[1] < call["max_seq_len"] or int(seq.max()) > call[
            "max_seq_len"]:
        raise ValueError("block_tables / max_seq_len do not hold seq_lens")
    lse, rows, heads = call["lse"], batch * q.shape[1], q.shape[2]
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) not in (
            (rows, heads), (batch, q.shape[1], heads))):
        raise ValueError(f"lse must be float32 [{rows}, {heads}] or [{batch}, "
                         f"{q.shape[1]}, {heads}], got {tuple(lse.shape)} {lse.dtype}")


def _wrapper() -> Any:
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    return BatchMLAPagedAttentionWrapper
