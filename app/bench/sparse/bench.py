"""``python -m app bench sparse``: DeepSeek Sparse Attention's decode and prefill against dense
attention at the same context, on the CPU.

**Decode row** (``--requests`` x ``--context``, one new token each, ``--heads`` heads, a bf16
paged cache): the sparse step is the lightning indexer (``--index-heads`` x ``--index-dim``
scores over every visible key, then the top ``--topk``: the container's indexer,
``CpuSparseIndexer`` where the native kernels run), the selected positions turned into cache
slots, and CPU_MLA_SPARSE's ``run_sparse_decode`` over them; the dense step is CPU_MLA's
``run_decode`` over the whole context. Each part is timed alone and the whole sparse step
together, interleaved with the dense step (best of ``--repeat``), and reported with what it
reads (``mb``: the index keys, the selected latent rows, the whole latent context), its FLOPs,
and its fractions of the roofline: ``byte_roofline_fraction`` = (bytes / stream bandwidth) /
time, ``roofline_fraction`` = max(that bound, FLOPs / the peak of the unit it multiplies on) /
time (stream bandwidth and peak measured by ``app.bench._peaks``'s probe before and after the
rows; the best of the two readings).
``speedup_vs_dense`` = dense ms / sparse total ms (target: >= 3x at 16 x 32k).

**Prefill row** (one request of ``--prefill-len`` new tokens): the indexer over every row
(causal) and CPU_MLA_SPARSE's ``run_sparse_prefill`` over the request's latent rows, against
TORCH_SDPA's dense causal prefill (the CPU's native kernel, R1's 128 + 64 / 128 dims) of the same
tokens. ``--prefill-len 0`` skips it. ``--quick`` shrinks everything (tests).

The 1-minute load average before and after is reported: on a busy machine figures are noisy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.cpu_mla import CpuMLADecodeBackend, has_bf16_dot
from app.backends.decode.cpu_sparse import CpuSparseDecodeBackend
from app.backends.prefill.cpu_sparse import CpuSparsePrefillBackend
from app.backends.prefill.metadata import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.backends.sparse.cpu_indexer import default_sparse_indexer
from app.backends.sparse.indexer import SparseIndexer, SparseIndexerMetadata
from app.bench._load import load_text, machine_cores, one_minute_load
from app.bench._peaks import BF16_DOT, FP32_FMA, load_peak_probe
from app.bench._timing import time_interleaved
from app.platforms import platform_for_device

__all__ = ["HELP", "add_arguments", "render", "run"]

HELP = "DeepSeek Sparse Attention (indexer + top-k + sparse attention) vs dense, CPU: ms, roofline"
RANK, ROPE, NOPE, V = 512, 64, 128, 128
TARGET_SPEEDUP = 3.0
_PARTS = ("indexer", "attention", "total", "dense")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes (V3.2's by default) and the run's settings."""
    parser.add_argument("--requests", type=int, default=16, help="decode requests (16)")
    parser.add_argument("--context", type=int, default=32768, help="tokens per request (32768)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (16)")
    parser.add_argument("--topk", type=int, default=2048, help="index_topk (2048)")
    parser.add_argument("--index-heads", type=int, default=64, help="index_n_heads (64)")
    parser.add_argument("--index-dim", type=int, default=128, help="index_head_dim (128)")
    parser.add_argument("--block-size", type=int, default=64, help="cache block size (64)")
    parser.add_argument("--prefill-len", type=int, default=8192,
                        help="tokens of the prefill row (8192; 0 skips it)")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls (5; quick 2)")
    parser.add_argument("--stream-gib", type=float, default=None,
                        help="GiB read to measure the stream bandwidth (1; quick 1/16)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (2 x 2048, topk 256, prefill 512): a smoke run")


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    sizes = {k: int(getattr(args, k)) for k in ("requests", "context", "heads", "topk",
                                                "index_heads", "index_dim", "block_size",
                                                "prefill_len")}
    if args.quick:
        sizes.update(requests=2, context=2048, topk=256, prefill_len=512)
    for key, low in (("requests", 1), ("context", 1), ("heads", 1), ("topk", 1),
                     ("index_heads", 1), ("index_dim", 2), ("block_size", 1),
                     ("prefill_len", 0)):
        if sizes[key] < low:
            raise ValueError(f"--{key.replace('_', '-')} must be >= {low}, got {sizes[key]}")
    return sizes


def _bound(nbytes: float, flops: float, t: float) -> dict[str, Any]:
    """A part's time, bytes and FLOPs (its roofline comes with :func:`_rooflines`)."""
    return {"ms": round(t * 1e3, 3), "mb": round(nbytes / 1e6, 1),
            "gflop": round(flops / 1e9, 3)}


def _rooflines(rows: list[dict[str, Any]], bw: float, peak: float) -> None:
    """Each part's fractions of the roofline, against the run's best stream bandwidth and best
    peak (a reading taken while the machine was busy would flatter every part)."""
    for row in rows:
        for part in _PARTS:
            p = row[part]
            t, by_bytes = p["ms"] / 1e3, p["mb"] * 1e6 / (bw * 1e9)
            bound = max(by_bytes, p["gflop"] * 1e9 / (peak * 1e9))
            p.update({"byte_roofline_ms": round(by_bytes * 1e3, 3),
                      "byte_roofline_fraction": float(f"{by_bytes / t:.3g}"),
                      "roofline_ms": round(bound * 1e3, 3),
                      "roofline_fraction": float(f"{bound / t:.3g}"),
                      "bound_by": "memory" if by_bytes >= bound else "compute"})


def _decode_row(s: dict[str, int], repeat: int, indexer: SparseIndexer) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    b, ctx, bs, topk = s["requests"], s["context"], s["block_size"], s["topk"]
    per = -(-ctx // bs)
    table = torch.randperm(b * per, generator=gen).to(torch.int32).view(b, per)
    cache = torch.randn(b * per, bs, RANK + ROPE, generator=gen).bfloat16()
    keys = torch.randn(b * per, bs, s["index_dim"], generator=gen).bfloat16()
    q = torch.randn(b, 1, s["heads"], RANK + ROPE, generator=gen).bfloat16()
    iq = torch.randn(b, s["index_heads"], s["index_dim"], generator=gen).bfloat16()
    weights = torch.rand(b, s["index_heads"], generator=gen)
    meta = SparseIndexerMetadata.build(table, [1] * b, [ctx] * b)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32)
    backends: list[MLADecodeBackend] = []
    for cls in (CpuSparseDecodeBackend, CpuMLADecodeBackend):
        be = cls(num_heads=s["heads"], scale=1 / (NOPE + ROPE) ** 0.5, kv_lora_rank=RANK,
                 qk_rope_head_dim=ROPE, kv_cache_dtype=torch.bfloat16)
        be.prepare_metadata(table, seq_lens, 1)
        backends.append(be)
    sparse, dense = backends
    slots = meta.to_slots(indexer.select(iq, weights, keys, meta, topk), bs).view(b, 1, -1)

    def whole() -> object:
        picked = meta.to_slots(indexer.select(iq, weights, keys, meta, topk), bs)
        return sparse.run_sparse_decode(q, cache, picked.view(b, 1, -1))

    timed = time_interleaved({
        "indexer": lambda: indexer.select(iq, weights, keys, meta, topk),
        "attention": lambda: sparse.run_sparse_decode(q, cache, slots),
        "total": whole, "dense": lambda: dense.run_decode(q, cache)}, repeat=repeat)
    ms = {k: min(v) for k, v in timed.items()}
    sel, heads = min(topk, ctx), s["heads"]
    attn_flops = 2.0 * (2 * RANK + ROPE) * heads * b
    parts = {
        "indexer": _bound(b * ctx * s["index_dim"] * 2, 2.0 * b * ctx * s["index_heads"]
                          * s["index_dim"], ms["indexer"]),
        "attention": _bound(b * sel * (RANK + ROPE) * 2, attn_flops * sel, ms["attention"]),
        "dense": _bound(b * ctx * (RANK + ROPE) * 2, attn_flops * ctx, ms["dense"])}
    parts["total"] = _bound(parts["indexer"]["mb"] * 1e6 + parts["attention"]["mb"] * 1e6,
                            (parts["indexer"]["gflop"] + parts["attention"]["gflop"]) * 1e9,
                            ms["total"])
    return {"row": "decode", "requests": b, "context": ctx, "heads": heads, "topk": topk,
            "index_heads": s["index_heads"], "index_dim": s["index_dim"], "block_size": bs,
            "dtype": "bf16", "indexer_class": type(indexer).__name__,
            "sparse_backend": "CPU_MLA_SPARSE", "dense_backend": "CPU_MLA", **parts,
            "speedup_vs_dense": round(ms["dense"] / ms["total"], 2)}


def _prefill_row(s: dict[str, int], repeat: int, indexer: SparseIndexer) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    n, bs, topk, heads = s["prefill_len"], s["block_size"], s["topk"], s["heads"]
    per = -(-n // bs)
    table = torch.arange(per, dtype=torch.int32).view(1, per)
    latent = torch.randn(per * bs, RANK + ROPE, generator=gen).bfloat16()
    keys = torch.randn(per, bs, s["index_dim"], generator=gen).bfloat16()
    q = torch.randn(n, heads, RANK + ROPE, generator=gen).bfloat16()
    iq = torch.randn(n, s["index_heads"], s["index_dim"], generator=gen).bfloat16()
    weights = torch.rand(n, s["index_heads"], generator=gen)
    meta = SparseIndexerMetadata.build(table, [n], list(range(1, n + 1)))
    args = {"num_heads": heads, "scale": 1 / (NOPE + ROPE) ** 0.5, "kv_lora_rank": RANK,
            "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V}
    sparse = CpuSparsePrefillBackend(**args)
    dense = TorchSDPABackend(**args)
    dense.prepare_metadata(MLAPrefillMetadata.build([n]))
    dq = torch.randn(n, heads, NOPE + ROPE, generator=gen).bfloat16()
    dk = torch.randn(n, heads, NOPE + ROPE, generator=gen).bfloat16()
    dv = torch.randn(n, heads, V, generator=gen).bfloat16()
    positions = indexer.select(iq, weights, keys, meta, topk)

    def whole() -> object:
        picked = indexer.select(iq, weights, keys, meta, topk)
        return sparse.run_sparse_prefill(q, latent, picked, return_softmax_lse=True)

    timed = time_interleaved({
        "indexer": lambda: indexer.select(iq, weights, keys, meta, topk),
        "attention": lambda: sparse.run_sparse_prefill(q, latent, positions,
                                                       return_softmax_lse=True),
        "total": whole,
        "dense": lambda: dense.run_prefill_new_tokens(dq, dk, dv, return_softmax_lse=True)},
        repeat=repeat)
    ms = {k: min(v) for k, v in timed.items()}
    pairs = n * (n + 1) // 2                       # causal (row, visible key) pairs
    picked = sum(min(topk, i) for i in range(1, n + 1))
    parts = {
        "indexer": _bound(n * s["index_dim"] * 2, 2.0 * pairs * s["index_heads"]
                          * s["index_dim"], ms["indexer"]),
        "attention": _bound(n * (RANK + ROPE) * 2, 2.0 * (2 * RANK + ROPE) * heads * picked,
                            ms["attention"]),
        "dense": _bound(n * heads * (2 * (NOPE + ROPE) + V) * 2,
                        2.0 * (NOPE + ROPE + V) * heads * pairs, ms["dense"])}
    parts["total"] = _bound(parts["indexer"]["mb"] * 1e6 + parts["attention"]["mb"] * 1e6,
                            (parts["indexer"]["gflop"] + parts["attention"]["gflop"]) * 1e9,
                            ms["total"])
    return {"row": "prefill", "tokens": n, "heads": heads, "topk": topk,
            "index_heads": s["index_heads"], "index_dim": s["index_dim"], "dtype": "bf16",
            "indexer_class": type(indexer).__name__, "sparse_backend": "CPU_MLA_SPARSE",
            "dense_backend": "TORCH_SDPA", **parts,
            "speedup_vs_dense": round(ms["dense"] / ms["total"], 2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result."""
    started = time.perf_counter()
    sizes = _sizes(args)
    for cls in (CpuSparseDecodeBackend, CpuMLADecodeBackend):
        if not cls.is_available():
            raise ValueError(f"bench sparse needs {cls.get_name()}: {cls.unavailable_reason()}")
    repeat = args.repeat or (2 if args.quick else 5)
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    gib = args.stream_gib if args.stream_gib is not None else (0.0625 if args.quick else 1.0)
    if not gib > 0:
        raise ValueError(f"--stream-gib must be > 0, got {gib}")
    load_before = one_minute_load()
    probe = load_peak_probe()
    kind = BF16_DOT if has_bf16_dot() else FP32_FMA
    buffer = torch.ones(max(64, int(gib * (1 << 30)) // 4))
    measure: Callable[[], tuple[float, float]] = (
        (lambda: (probe.stream_gbs(buffer, repeat=3), probe.rate(kind, repeat=1)))
        if probe is not None else (lambda: (float("nan"), float("nan"))))
    bw, peak = measure()
    indexer = default_sparse_indexer(platform_for_device("cpu"))
    rows = [_decode_row(sizes, repeat, indexer)]
    if sizes["prefill_len"]:
        rows.append(_prefill_row(sizes, repeat, indexer))
    bw_after, peak_after = measure()
    _rooflines(rows, max(bw, bw_after), max(peak, peak_after))
    targets = [] if args.quick else [{
        "name": f"sparse decode {sizes['requests']}x{sizes['context']} speedup_vs_dense",
        "target": TARGET_SPEEDUP, "value": rows[0]["speedup_vs_dense"],
        "met": rows[0]["speedup_vs_dense"] >= TARGET_SPEEDUP}]
    return {"benchmark": "sparse", "ok": True, "rows": rows, "targets": targets,
            "stream_gbs": round(max(bw, bw_after), 1), "peak_kind": kind,
            "peak_gflops": round(max(peak, peak_after), 1), "threads": torch.get_num_threads(),
            "bf16_dot": has_bf16_dot(), "load_avg_1m": [load_before, one_minute_load()],
            "cores": machine_cores(),
            "seconds": round(time.perf_counter() - started, 1)}


def render(result: dict[str, Any]) -> str:
    """A readable table of the rows' parts."""
    load = result["load_avg_1m"]
    lines = [f"sparse vs dense (CPU, {result['threads']} threads, stream "
             f"{result['stream_gbs']} GB/s, {result['peak_kind']} {result['peak_gflops']} "
             f"GFLOP/s, {load_text(load[0], load[1], result.get('cores'))})",
             f"{'row':8s} {'part':10s} {'ms':>9s} {'MB':>8s} {'GFLOP':>8s} {'bytes rf':>8s} "
             f"{'roofline':>8s}"]
    for row in result["rows"]:
        for part in ("indexer", "attention", "total", "dense"):
            p = row[part]
            lines.append(f"{row['row']:8s} {part:10s} {p['ms']:9.3f} {p['mb']:8.1f} "
                         f"{p['gflop']:8.3f} {p['byte_roofline_fraction']:8.3g} "
                         f"{p['roofline_fraction']:8.3g}")
        lines.append(f"{row['row']:8s} speedup_vs_dense {row['speedup_vs_dense']}")
    return "\n".join(lines)
