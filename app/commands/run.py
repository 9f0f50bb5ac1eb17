"""``python -m app run``: the main job, a chunked MLA prefill over a paged latent cache.

On an embedded default (the small DeepSeek-shaped layer: H=16, L=512, P=128, R=64, V=128;
32 requests of 256-4096 tokens with shared prefixes; an 8192-token step budget) the engine
(``app.mla.engine``) runs every request through the backend the container selects, over a
paged latent cache managed by the ``KVCacheManager``. Each finished request is checked against
the dense float64 reference of the same layer on its whole sequence. The command prints a
progress bar on stderr, then a summary; it exits 1 when the error exceeds the dtype's tolerance
(or blocks leaked), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import attrs
import torch

from app import deployment
from app.commands._args import int_in, positive_int
from app.commands._output import print_json, print_text
from app.config import DTYPE_ALIASES, EngineConfig

HELP = "run the main job: chunked MLA prefill of many requests, checked against float64"

#: The embedded default workload.
DEFAULTS: dict[str, Any] = {
    "num_requests": 32,
    "min_len": 256,
    "max_len": 4096,
    "step_tokens": 8192,
    "seed": 0,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload, the engine sizes, the backend and dtype, a deployment file."""
    parser.add_argument("--backend", default=None,
                        help="MLA prefill backend name, or 'auto' (default: the config's)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_ALIASES),
                        help="model dtype (default: the config's, bfloat16)")
    parser.add_argument("--num-requests", type=positive_int, default=DEFAULTS["num_requests"],
                        help="requests to run (default: %(default)s)")
    parser.add_argument("--min-len", type=positive_int, default=DEFAULTS["min_len"],
                        help="shortest request in tokens (default: %(default)s)")
    parser.add_argument("--max-len", type=positive_int, default=DEFAULTS["max_len"],
                        help="longest request in tokens (default: %(default)s)")
    parser.add_argument("--step-tokens", type=positive_int, default=DEFAULTS["step_tokens"],
                        help="new tokens per step, the chunked-prefill budget "
                             "(default: %(default)s)")
    parser.add_argument("--num-blocks", type=int_in(2), default=None,
                        help="KV-cache blocks in the pool, block 0 reserved "
                             "(default: the config's)")
    parser.add_argument("--block-size", type=positive_int, default=None,
                        help="tokens per KV-cache block (default: the config's)")
    parser.add_argument("--chunk-tokens", type=positive_int, default=None,
                        help="most context tokens gathered and up-projected at once "
                             "(default: the config's attention.context_chunk_tokens)")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=DEFAULTS["seed"],
                        help="seed of the weights and the workload (default: %(default)s)")
    parser.add_argument("--deployment", type=Path, default=None,
                        help="a deployment TOML (app.deployment.load): platform, backend "
                             "overrides and configs; the options above override its configs")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the float64 reference check")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="leave glibc malloc as it is (by default large freed blocks are "
                             "kept for reuse: fewer page faults per step)")


class ProgressBar:
    """A plain-text progress bar on a stream: redrawn in place on a terminal (at most 10 times
    a second), one line per 10% otherwise (logs stay readable)."""

    def __init__(self, total: int, label: str, stream: IO[str] | None = None,
                 width: int = 30, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_draw = 0.0
        self._last_decile = -1
        self._start = time.perf_counter()

    def update(self, done: int, info: str = "") -> None:
        """Show ``done`` of ``total`` with a short ``info`` text."""
        if not self.enabled:
            return
        frac = min(max(done / self.total, 0.0), 1.0)
        now = time.perf_counter()
        if self.tty:
            if done < self.total and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            self.stream.write("\r" + self._line(done, frac, now, info) + "\x1b[K")
        else:
            decile = int(frac * 10)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(self._line(done, frac, now, info) + "\n")
        self.stream.flush()

    def _line(self, done: int, frac: float, now: float, info: str) -> str:
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label} [{bar}] {done}/{self.total} {now - self._start:5.1f}s"
        return f"{text}  {info}" if info else text

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


def build_config(args: argparse.Namespace, base: EngineConfig) -> EngineConfig:
    """``base`` with the command-line options applied (validated by the config classes)."""
    model, attention, cache = base.model, base.attention, base.cache
    if args.dtype is not None:
        model = attrs.evolve(model, dtype=args.dtype)
    if args.backend is not None:
        attention = attrs.evolve(attention, mla_prefill_backend=args.backend)
    if args.chunk_tokens is not None:
        attention = attrs.evolve(attention, context_chunk_tokens=args.chunk_tokens)
    if args.num_blocks is not None:
        cache = attrs.evolve(cache, num_blocks=args.num_blocks)
    if args.block_size is not None:
        cache = attrs.evolve(cache, block_size=args.block_size)
    return EngineConfig(model=model, attention=attention, cache=cache)


#: Host memory one block costs beyond its latent storage (the pool's Python block object).
_BLOCK_OVERHEAD_BYTES = 256


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory the KV cache may take on ``device``: free GPU memory, or the host's physical
    memory; None when it cannot be told (no CUDA here, an OS without ``sysconf``)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_cache_fits(config: EngineConfig, device: torch.device) -> None:
    """``ValueError`` when ``cache.num_blocks`` blocks cannot fit in memory: the latent cache on
    ``device``, the pool's per-block bookkeeping on the host. Checked before the pool is built
    (a huge ``num_blocks`` would otherwise spend minutes building it, then fail)."""
    model, cache = config.model, config.cache
    latent = cache.block_size * (model.kv_lora_rank + model.qk_rope_head_dim) * (
        model.dtype.itemsize)
    cpu = torch.device("cpu")
    per_block = ({device: latent, cpu: _BLOCK_OVERHEAD_BYTES} if device.type != "cpu"
                 else {cpu: latent + _BLOCK_OVERHEAD_BYTES})
    for where, cost in per_block.items():
        have = available_memory_bytes(where)
        if have is not None and cache.num_blocks * cost > have:
            raise ValueError(
                f"cache.num_blocks = {cache.num_blocks} needs "
                f"{cache.num_blocks * cost / 2**30:.1f} GiB of {where} memory ({cost} B per "
                f"block: {latent} B of latent cache for {cache.block_size} tokens, and the "
                f"pool's bookkeeping); {where} has {have / 2**30:.1f} GiB: use at most "
                f"{have // cost} blocks (--num-blocks or [cache] num_blocks)")


def _why_not(explanation: Any) -> dict[str, list[str]]:
    chosen = explanation["chosen"]
    return {name: verdict["reasons"] or ["valid, but lower priority"
                                         if verdict["priority"] is not None
                                         else "valid, but not in this platform's priorities"]
            for name, verdict in explanation["backends"].items() if name != chosen}


def execute(args: argparse.Namespace, stream: IO[str] | None = None) -> dict[str, Any]:
    """Run the job; the summary as a dict (``ok`` False when the check fails)."""
    from app.backends.selector import explain_mla_prefill_selection
    from app.containers import create_container
    from app.mla.engine import MLAPrefillEngine
    from app.mla.process import tune_malloc_for_large_tensors
    from app.mla.reference import check_against_reference, reference_tolerance
    from app.mla.workload import make_workload

    wall_start = time.perf_counter()
    malloc_tuned = False if args.no_malloc_tuning else tune_malloc_for_large_tensors()
    for name in ("num_requests", "min_len", "max_len", "step_tokens"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.min_len > args.max_len:
        raise ValueError(f"--min-len ({args.min_len}) must be <= --max-len ({args.max_len})")
    if args.deployment is not None:
        container = deployment.load(args.deployment)
        config = build_config(args, container.config())
    else:
        config = build_config(args, EngineConfig())
        container = create_container(config)
    check_cache_fits(config, container.platform().device)
    explanation = explain_mla_prefill_selection(config, container=container)
    engine = MLAPrefillEngine(config, container=container, seed=args.seed,
                              step_tokens=args.step_tokens)
    workload = make_workload(args.num_requests, args.min_len, args.max_len,
                             engine.embedding.vocab_size, seed=args.seed)
    for request in workload:
        engine.add_request(request.request_id, request.token_ids)

    tolerance = reference_tolerance(config.model.dtype)
    check_seconds = 0.0
    worst_abs = worst_rel = ref_scale = 0.0
    rows_checked = 0
    bar = ProgressBar(len(workload), "prefill", stream=stream, enabled=not args.no_progress)
    done = 0
    while engine.has_unfinished():
        step = engine.step()
        if not step.scheduled and engine.num_running == 0:  # pragma: no cover - cannot happen
            raise RuntimeError("the engine made no progress with no request running")
        for out in step.finished:
            done += 1
            if not args.no_check and out.output is not None:
                t0 = time.perf_counter()
                result = check_against_reference(engine.weights, engine.embedding,
                                                  out.request_id, out.token_ids, out.output,
                                                  out.computed_rows)
                check_seconds += time.perf_counter() - t0
                worst_abs = max(worst_abs, result.max_abs_error)
                worst_rel = max(worst_rel, result.relative_error)
                ref_scale = max(ref_scale, result.ref_max_abs)
                rows_checked += result.rows_checked
            bar.update(done, f"step {step.step}, "
                             f"{engine.stats.tokens_per_second / 1e3:.1f}k tok/s, "
                             f"max err {worst_rel:.1e}")
    bar.close()

    stats = engine.stats
    leaked = engine.initial_free_blocks - engine.kv_manager.num_free_blocks
    checked = not args.no_check
    passed = (worst_rel <= tolerance) if checked else None
    ok = (passed is not False) and leaked == 0
    return {
        "ok": ok,
        "platform": engine.platform.describe(),
        "deployment": None if args.deployment is None else str(args.deployment),
        "backend": {"chosen": explanation["chosen"], "class": explanation["chosen_class"],
                    "requested": explanation["requested"],
                    "priorities": explanation["priorities"],
                    "why_not_others": _why_not(explanation)},
        "model": engine.layer.describe(),
        "kv_cache": {"groups": engine.describe_kv_cache_groups(),
                     "pool": engine.pool_usage(), "leaked_blocks": leaked,
                     "context_chunk_tokens": config.attention.context_chunk_tokens},
        "workload": {"num_requests": len(workload), "min_len": args.min_len,
                     "max_len": args.max_len, "step_tokens": args.step_tokens,
                     "seed": args.seed, "prompt_tokens": stats.prompt_tokens,
                     "shared_prefix_tokens": sum(r.shared_prefix_len for r in workload)},
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "prefill_tokens": stats.computed_tokens,
        "prefill_seconds": round(stats.step_seconds, 3),
        "prefill_tokens_per_s": round(stats.tokens_per_second, 1),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "check": {"enabled": checked, "reference": "dense float64, whole sequence",
                  "rows_checked": rows_checked, "max_abs_error": worst_abs,
                  "ref_max_abs": ref_scale, "max_relative_error": worst_rel,
                  "tolerance": tolerance, "passed": passed,
                  "seconds": round(check_seconds, 3)},
        "wall_seconds": round(time.perf_counter() - wall_start, 3),
        "torch_threads": torch.get_num_threads(),
        "malloc_tuned": malloc_tuned,
    }


def render(result: dict[str, Any]) -> str:
    """The human-readable summary."""
    plat = result["platform"]
    backend = result["backend"]
    pool = result["kv_cache"]["pool"]
    check = result["check"]
    model = result["model"]
    lines = [
        f"platform        {plat['platform']} ({plat['platform_class']}), device capability "
        f"{plat['device_capability']}, fast bf16: {plat['fast_bfloat16']}",
        f"backend         {backend['chosen']} ({backend['class']})"
        + ("" if backend["requested"] is None else f", requested {backend['requested']}"),
    ]
    width = max((len(n) for n in backend["why_not_others"]), default=0) + 2
    for name, reasons in backend["why_not_others"].items():
        lines.append(f"  not {name:<{width}}{'; '.join(reasons)}")
    lines.append(f"layer           H={model['num_heads']} L={model['kv_lora_rank']} "
                 f"P={model['qk_nope_head_dim']} R={model['qk_rope_head_dim']} "
                 f"V={model['v_head_dim']} hidden={model['hidden_size']}, {model['dtype']} "
                 f"(compute {model['compute_dtype']})")
    for i, group in enumerate(result["kv_cache"]["groups"]):
        lines.append(f"kv group {i}      {group['spec']} -> {group['manager']}, block "
                     f"{group['block_size']} x {group['head_size']} {group['dtype']}, page "
                     f"{group['page_size_bytes']} B, layers {', '.join(group['layers'])}")
    leaked = result["kv_cache"]["leaked_blocks"]
    lines.append(f"kv pool         {pool['num_blocks']} blocks ({pool['cache_bytes'] / 2**20:.0f}"
                 f" MiB), peak used {pool['peak_used_blocks']}, cached {pool['cached_blocks']},"
                 f" free at end {pool['free_blocks']}, leaked {leaked}")
    wl = result["workload"]
    summary = {
        "requests": f"{wl['num_requests']} of {wl['min_len']}-{wl['max_len']} tokens "
                    f"({wl['prompt_tokens']} prompt tokens), step budget {wl['step_tokens']}",
        "steps": f"{result['steps']} ({result['preemptions']} preemptions)",
        "prefill": f"{result['prefill_tokens']} tokens computed in {result['prefill_seconds']} s"
                   f" = {result['prefill_tokens_per_s']:.0f} tokens/s",
        "prefix cache": f"hit rate {result['prefix_cache_hit_rate']:.1%} of prompt tokens",
    }
    if check["enabled"]:
        verdict = "PASS" if check["passed"] else "FAIL"
        summary["max error"] = (
            f"{check['max_relative_error']:.2e} of the output scale (abs "
            f"{check['max_abs_error']:.2e}, scale {check['ref_max_abs']:.2f}) vs dense float64, "
            f"{check['rows_checked']} rows; tolerance {check['tolerance']:.0e}: {verdict}")
    else:
        summary["max error"] = "not checked (--no-check)"
    summary["wall time"] = f"{result['wall_seconds']} s"
    lines.extend(f"{key:<16}{value}" for key, value in summary.items())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the job and print the summary; 1 when the check fails or blocks leaked."""
    result = execute(args)
    if args.json:
        print_json(result)
    else:
        print_text(render(result))
    return 0 if result["ok"] else 1
