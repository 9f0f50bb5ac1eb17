"""``python -m app run``: the main job, an MLA engine serving requests end to end.

The model: a Hugging Face DeepSeek-V2/V3 checkpoint (``--model DIR``), or by default the random
DeepSeek-V3-shaped model made in memory at production attention dims (H=16, L=512, P=128,
R=64, V=128; q LoRA, yarn rope, MoE; ``app.model.random``), so the job needs no download. The
workload: 32 requests, prompts of 256-4096 tokens with shared prefixes, 32-128 new tokens each,
an 8192-token step budget. The engine (``app.mla.engine``) serves every request: continuous
batching of chunked prefill (the prefill backend the container selects, non-absorbed form) and
decode (the selected decode backend, absorbed form) over one paged latent cache managed by the
``KVCacheManager``, greedy tokens from the LM head, optionally speculative
(``--speculative-tokens``). Each finished request is checked, teacher-forced, against the dense
float64 model on its final sequence (``app.mla.checks``: a stated sample of prefill rows and of
decode rows, always the last prompt rows, the first decode rows and the last rows, and the
tokens those rows chose). The tolerance follows the dtype, measured (``app.mla.checks.
derived_tolerance``): the same dense model computed plainly in the engine's dtype is compared
with float64 on the same rows, and the engine may be twice as far, never held below the dtype's
few units of rounding; the summary states the rule and the measurement. The command prints
progress on stderr, then a summary; it exits 1 when an error exceeds that tolerance, a token is
not the float64 argmax beyond a near-tie, or blocks leaked; 2 on a usage error (a request that
ended in an error, its logits not finite, is one: the checkpoint is broken).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import attrs
import torch
from dependency_injector import providers

from app import deployment
from app._cpu import apply_thread_count
from app.commands._args import add_kv_cache_dtype_argument, int_in, positive_int
from app.commands._memory import check_cache_fits, check_request_fits
from app.commands._model import add_model_arguments, build_model, model_line
from app.commands._output import ProgressBar, print_json, print_text, raise_for_errors
from app.config import EngineConfig, dtype_name

HELP = ("run the main job: serve many requests (prefill + decode) on a DeepSeek model (random, "
        "or --model DIR), checked against float64")

#: Said when a native kernel library starts compiling (first use on a machine).
COMPILING = "compiling the native kernels (first run, ~20 s)"

#: The embedded default workload.
DEFAULTS: dict[str, Any] = {
    "num_requests": 32,
    "min_len": 256,
    "max_len": 4096,
    "min_new_tokens": 32,
    "max_new_tokens": 128,
    "step_tokens": 8192,
    "seed": 0,
    "check_prefill_rows": 16,
    "check_decode_rows": 16,
}
#: The engine config a run starts from without --deployment (its defaults go into --help).
_CONFIG = EngineConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the workload, the engine sizes, the backend and dtype, a deployment file."""
    add_model_arguments(parser)
    parser.add_argument("--backend", default=None,
                        help="MLA prefill backend name, or 'auto' (default: auto, or the "
                             "--deployment file's)")
    parser.add_argument("--decode-backend", default=None,
                        help="MLA decode backend name, or 'auto' (default: auto, or the "
                             "--deployment file's)")
    parser.add_argument("--num-requests", type=positive_int, default=DEFAULTS["num_requests"],
                        help="requests to run (default: %(default)s)")
    parser.add_argument("--min-len", type=positive_int, default=DEFAULTS["min_len"],
                        help="shortest request in tokens (default: %(default)s)")
    parser.add_argument("--max-len", type=positive_int, default=DEFAULTS["max_len"],
                        help="longest request in tokens (default: %(default)s)")
    parser.add_argument("--min-new-tokens", type=positive_int, default=DEFAULTS["min_new_tokens"],
                        help="fewest tokens a request generates (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=DEFAULTS["max_new_tokens"],
                        help="most tokens a request generates (default: %(default)s)")
    parser.add_argument("--step-tokens", type=positive_int, default=DEFAULTS["step_tokens"],
                        help="tokens per step (decode first, then chunked prefill) "
                             "(default: %(default)s)")
    parser.add_argument("--speculative-tokens", type=int_in(0, 15), default=0,
                        help="n-gram draft tokens verified per decode step (default: "
                             "%(default)s, plain decoding)")
    parser.add_argument("--check-prefill-rows", type=int_in(-1),
                        default=DEFAULTS["check_prefill_rows"],
                        help="most prefill rows per request checked against float64, its "
                             "last 16 always, the others at a stride (-1: every row) "
                             "(default: %(default)s)")
    parser.add_argument("--check-decode-rows", type=int_in(-1),
                        default=DEFAULTS["check_decode_rows"],
                        help="most decode rows per request checked against float64, its "
                             "first 8 and last 8 always, the others at a stride (-1: every "
                             "row) (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int_in(2), default=None,
                        help="KV-cache blocks in the pool, block 0 reserved (default: "
                             f"{_CONFIG.cache.num_blocks}, or the --deployment file's [cache])")
    parser.add_argument("--block-size", type=positive_int, default=None,
                        help=f"tokens per KV-cache block (default: {_CONFIG.cache.block_size}, "
                             "or the --deployment file's [cache])")
    add_kv_cache_dtype_argument(parser)
    parser.add_argument("--cache-memory", default=None, metavar="SIZE",
                        help="size the pool by memory instead of --num-blocks: as many blocks "
                             "as fit in SIZE (e.g. 2GiB) with the cache dtype's bytes per "
                             "token, so an FP8 cache holds more tokens in the same memory")
    parser.add_argument("--chunk-tokens", type=positive_int, default=None,
                        help="most context tokens gathered and up-projected at once (default: "
                             f"{_CONFIG.attention.context_chunk_tokens}, or the --deployment "
                             "file's [attention] context_chunk_tokens)")
    parser.add_argument("--deployment", type=Path, default=None,
                        help="a deployment TOML (app.deployment.load): platform, backend "
                             "overrides and configs; the options above override its configs")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the float64 reference check")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines on stderr")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="leave glibc malloc as it is (by default large freed blocks are "
                             "kept for reuse: fewer page faults per step)")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


def build_config(args: argparse.Namespace, base: EngineConfig) -> EngineConfig:
    """``base`` with the command-line options applied (validated by the config classes)."""
    model, attention, cache = base.model, base.attention, base.cache
    if args.backend is not None:
        attention = attrs.evolve(attention, mla_prefill_backend=args.backend)
    if args.decode_backend is not None:
        attention = attrs.evolve(attention, mla_decode_backend=args.decode_backend)
    if args.chunk_tokens is not None:
        attention = attrs.evolve(attention, context_chunk_tokens=args.chunk_tokens)
    if args.num_blocks is not None:
        cache = attrs.evolve(cache, num_blocks=args.num_blocks)
    if args.block_size is not None:
        cache = attrs.evolve(cache, block_size=args.block_size)
    if getattr(args, "kv_cache_dtype", None) is not None:
        cache = attrs.evolve(cache, kv_cache_dtype=args.kv_cache_dtype)
    return EngineConfig(model=model, attention=attention, cache=cache)


def _blocks_in_memory(config: EngineConfig, memory: str, num_layers: int) -> EngineConfig:
    """``config`` with as many cache blocks as fit in ``memory`` (``--cache-memory``)."""
    from app.commands.kv_plan import parse_memory
    from app.kvcache.cache_dtypes import LatentCacheFormat

    m, cache = config.model, config.cache
    per_token = LatentCacheFormat.from_name(cache.kv_cache_dtype, m.dtype, m.kv_lora_rank,
                                            m.qk_rope_head_dim).bytes_per_token
    per_block = per_token * cache.block_size * num_layers
    blocks = parse_memory(memory, "--cache-memory") // per_block
    if blocks < 2:
        raise ValueError(f"--cache-memory {memory}: a block takes {per_block} B "
                         f"({num_layers} layer(s) x {cache.block_size} tokens x {per_token} "
                         f"B); that holds {blocks}, the pool needs at least 2")
    return attrs.evolve(config, cache=attrs.evolve(cache, num_blocks=int(blocks)))


def _pool_capacity(config: EngineConfig, pool: dict[str, Any]) -> dict[str, Any]:
    """How many tokens the pool holds, and how many the same memory would hold in the model
    dtype: an FP8 cache holds 1152 / 656 = 1.76x (fp8_ds_mla) or 2x (fp8) as many."""
    m = config.model
    model_bytes = (m.kv_lora_rank + m.qk_rope_head_dim) * m.dtype.itemsize
    ratio = model_bytes / pool["bytes_per_token_per_layer"]
    tokens = (pool["num_blocks"] - 1) * pool["block_size"]
    return {"tokens": tokens, "tokens_if_model_dtype": int(tokens / ratio),
            "tokens_vs_model_dtype": round(ratio, 4)}


def _why_not(explanation: Any) -> dict[str, list[str]]:
    chosen = explanation["chosen"]
    return {name: verdict["reasons"] or ["valid, but lower priority"
                                         if verdict["priority"] is not None
                                         else "valid, but not in this platform's priorities"]
            for name, verdict in explanation["backends"].items() if name != chosen}


def _percentile(values: list[float], pct: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(pct / 100 * len(ordered)) - 1, 0)]


def _latency(values: list[float], scale: float = 1.0, digits: int = 2) -> dict[str, Any]:
    p50, p99 = _percentile(values, 50), _percentile(values, 99)
    return {"p50": None if p50 is None else round(p50 * scale, digits),
            "p99": None if p99 is None else round(p99 * scale, digits), "count": len(values)}


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_requests", "min_len", "max_len", "step_tokens", "min_new_tokens",
                 "max_new_tokens"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.min_len > args.max_len:
        raise ValueError(f"--min-len ({args.min_len}) must be <= --max-len ({args.max_len})")
    if args.min_new_tokens > args.max_new_tokens:
        raise ValueError(f"--min-new-tokens ({args.min_new_tokens}) must be <= "
                         f"--max-new-tokens ({args.max_new_tokens})")
    if args.speculative_tokens < 0:
        raise ValueError(f"--speculative-tokens must be >= 0, got {args.speculative_tokens}")
    for name in ("check_prefill_rows", "check_decode_rows"):
        if getattr(args, name) < -1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= -1, got "
                             f"{getattr(args, name)}")


def _serve(engine: Any, total_tokens: int, show: bool, stream: IO[str] | None) -> list[Any]:
    """Step until every request is finished, with progress lines; the outputs."""
    bar = ProgressBar(total_tokens, "generate", stream=stream, enabled=show)
    outputs: list[Any] = []
    emitted = 0
    stats = engine.stats
    while engine.has_unfinished():
        step = engine.step()
        if not step.num_prefill_tokens and not step.num_decode_tokens \
                and not engine.num_running:  # pragma: no cover - blocks held elsewhere
            raise RuntimeError("the engine made no progress with no request running")
        emitted += sum(len(t) for t in step.new_tokens.values())
        outputs.extend(step.finished)
        bar.update(emitted, f"step {step.step}, {engine.num_running} running, prefill "
                            f"{stats.prefill_tokens_per_second / 1e3:.1f}k tok/s, decode "
                            f"{stats.decode_tokens_per_second:.0f} tok/s")
    bar.close()
    return outputs


def _check_all(engine: Any, outputs: list[Any], prefill_rows: int, decode_rows: int,
               dtype: torch.dtype, show: bool = False,
               stream: IO[str] | None = None) -> dict[str, Any]:
    from app.mla.checks import check_engine_outputs

    bar = ProgressBar(len(outputs), "check", stream=stream, enabled=show)
    try:
        return check_engine_outputs(engine, outputs, prefill_rows, decode_rows, dtype,
                                    progress=bar.update)
    finally:
        bar.close()


def _say(show: bool, stream: IO[str] | None, text: str) -> None:
    """One progress line on ``stream`` (stderr by default), when progress is shown."""
    if show:
        out = sys.stderr if stream is None else stream
        out.write(text + "\n")
        out.flush()


def _build_notice(show: bool, stream: IO[str] | None) -> Callable[[str], None]:
    """What ``run`` says as a native library starts compiling: the first one with the
    expected time, the others by name."""
    said: list[str] = []

    def notice(name: str) -> None:
        _say(show, stream, f"{COMPILING}: {name} ..." if not said else f"compiling {name} ...")
        said.append(name)

    return notice


def execute(args: argparse.Namespace, stream: IO[str] | None = None) -> dict[str, Any]:
    """Run the job; the summary as a dict (``ok`` False when the check fails)."""
    from app.backends.cpu.loader import on_build

    threads = apply_thread_count()
    with on_build(_build_notice(not args.no_progress, stream)):
        result = _execute(args, stream, f"threads: {threads.count} ({threads.source})")
    return {**result, "threads": threads.as_dict()}


def _execute(args: argparse.Namespace, stream: IO[str] | None, threads: str
             ) -> dict[str, Any]:
    """The job, ``threads`` said first once the command line and the sizes are checked (a
    usage error stays the only line on stderr)."""
    from app.containers import create_container
    from app.mla.checks import tolerance_rule
    from app.mla.engine import MLAEngine
    from app.mla.process import tune_malloc_for_large_tensors
    from app.mla.requests import Request
    from app.mla.workload import make_workload
    from app.model.reference import reference_tolerance
    from app.seed_api import explain_mla_decode_selection, explain_mla_prefill_selection

    wall_start = time.perf_counter()
    malloc_tuned = False if args.no_malloc_tuning else tune_malloc_for_large_tensors()
    _validate(args)
    container = None if args.deployment is None else deployment.load(args.deployment)
    base = build_config(args, EngineConfig() if container is None else container.config())
    try:
        built = build_model(args, base, progress=not args.no_progress, stream=stream)
    except ValueError as exc:  # the model's sizes may come from the deployment: name it
        if args.deployment is None or args.model is not None:
            raise
        raise ValueError(f"deployment file {str(args.deployment)!r}: {exc}") from None
    config = built.config
    if args.cache_memory is not None:
        config = _blocks_in_memory(config, args.cache_memory, built.weights.num_layers)
    if container is None:
        container = create_container(config)
    else:   # the deployment's container, with the one config this run uses
        container.config.override(providers.Object(config))
    try:
        check_cache_fits(config, container.platform().device, built.weights.num_layers)
    except ValueError as exc:  # the sizes may come from the deployment: name it
        if args.deployment is None:
            raise
        raise ValueError(f"deployment file {str(args.deployment)!r}: {exc}") from None
    check_request_fits(config, args.max_len)
    _say(not args.no_progress, stream, threads)
    explanation = explain_mla_prefill_selection(config, container=container)
    decode_explanation = explain_mla_decode_selection(
        config, query_len=1 + args.speculative_tokens, container=container)
    # A sparse model's check attends to the engine's own selections (app.mla.checks): every
    # computed row's, since a sampled row reads the keys the rows before it computed from
    # theirs. Kept as bitmasks (app.model.sparse.selections: S / 8 bytes per row and indexer
    # layer, whatever index_topk is): ~1.5 GB for the default workload on a real V3.2, not the
    # ~35 GB of int32 positions.
    engine = MLAEngine(container, weights=built.weights, step_tokens=args.step_tokens,
                       num_speculative_tokens=args.speculative_tokens,
                       keep_selections=not args.no_check
                       and built.weights.config.indexer is not None)
    workload = make_workload(args.num_requests, args.min_len, args.max_len,
                             engine.model.vocab_size, seed=args.seed,
                             min_new_tokens=args.min_new_tokens,
                             max_new_tokens=args.max_new_tokens)
    for item in workload:
        engine.add_request(Request(item.request_id, item.token_ids,
                                   max_new_tokens=item.max_new_tokens))
    serve_start = time.perf_counter()
    outputs = _serve(engine, sum(w.max_new_tokens for w in workload), not args.no_progress,
                     stream)
    serve_seconds = time.perf_counter() - serve_start
    raise_for_errors(outputs)

    dtype = config.model.dtype
    check: dict[str, Any] = {"enabled": False, "passed": None, "seconds": 0.0,
                             "tolerance": reference_tolerance(dtype),
                             "tolerance_rule": tolerance_rule(dtype,
                                                              config.cache.kv_cache_dtype)}
    if not args.no_check:
        _say(not args.no_progress, stream,
             f"checking against float64 ({len(outputs)} requests, teacher-forced) ...")
        check = _check_all(engine, outputs, args.check_prefill_rows, args.check_decode_rows,
                           dtype, not args.no_progress, stream)
    stats = engine.stats
    leaked = engine.initial_free_blocks - engine.kv_manager.num_free_blocks
    ok = check["passed"] is not False and leaked == 0
    ms = 1e3
    ttft = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    ttft_steps = [float(o.metrics.ttft_steps) for o in outputs
                  if o.metrics.ttft_steps is not None]
    tpot = [o.tpot for o in outputs if o.tpot is not None]
    tpot_steps = [o.tpot_steps for o in outputs if o.tpot_steps is not None]
    wall = time.perf_counter() - wall_start
    return {
        "ok": ok,
        "platform": engine.platform.describe(),
        "deployment": None if args.deployment is None else str(args.deployment),
        "backend": {"chosen": explanation["chosen"], "class": explanation["chosen_class"],
                    "requested": explanation["requested"],
                    "priorities": explanation["priorities"],
                    "why_not_others": _why_not(explanation)},
        "decode_backend": {"chosen": engine.decode_backend_class.get_name(),
                           "class": f"{engine.decode_backend_class.__module__}."
                                    f"{engine.decode_backend_class.__qualname__}",
                           "requested": decode_explanation["requested"],
                           "query_len": 1 + args.speculative_tokens,
                           "priorities": decode_explanation["priorities"],
                           "why_not_others": _why_not(decode_explanation)},
        "model": {**built.description, "dtype": dtype_name(config.model.dtype),
                  "compute_dtype": dtype_name(engine.model.compute_dtype),
                  "line": model_line(built.description, config.model.dtype,
                                     engine.model.compute_dtype)},
        "kv_cache": {"groups": _kv_groups(engine),
                     "pool": engine.pool_usage(), "leaked_blocks": leaked,
                     "capacity": _pool_capacity(config, engine.pool_usage()),
                     "k_scales": [c.k_scale for c in engine.model.caches]
                     if engine.model.caches[0].format.per_layer_scale else None,
                     "context_chunk_tokens": config.attention.context_chunk_tokens},
        "workload": {"num_requests": len(workload), "min_len": args.min_len,
                     "max_len": args.max_len, "min_new_tokens": args.min_new_tokens,
                     "max_new_tokens": args.max_new_tokens, "step_tokens": args.step_tokens,
                     "seed": args.seed, "prompt_tokens": stats.prompt_tokens,
                     "shared_prefix_tokens": sum(r.shared_prefix_len for r in workload)},
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "generated_tokens": stats.emitted_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "prefill_seconds": round(stats.prefill_seconds, 3),
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_second, 1),
        "decode_tokens": stats.decode_emitted_tokens,
        "decode_seconds": round(stats.decode_seconds, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_second, 1),
        "serve_seconds": round(serve_seconds, 3),
        "ttft_ms": _latency(ttft, ms), "ttft_steps": _latency(ttft_steps),
        "tpot_ms": _latency(tpot, ms), "tpot_steps": _latency(tpot_steps, digits=3),
        "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "speculative": {"tokens": args.speculative_tokens, "drafts": stats.draft_tokens,
                        "accepted": stats.accepted_tokens,
                        "acceptance_rate": round(stats.acceptance_rate, 4)},
        "check": check,
        "wall_seconds": round(wall, 3),
        "check_share_of_wall": round(check["seconds"] / wall, 4) if wall else 0.0,
        "torch_threads": torch.get_num_threads(),
        "malloc_tuned": malloc_tuned,
    }


def _kv_groups(engine: Any) -> list[dict[str, Any]]:
    """The engine's KV-cache groups, each with its model layers apart from its specs (a sparse
    model's indexer keys are a spec beside each latent layer's) and its token row's real bytes
    and layout (an ``fp8_ds_mla`` row is 656 bytes, not its spec's ``576 uint8``)."""
    from app.commands._kv_rows import count_layers, token_row

    groups: list[dict[str, Any]] = engine.describe_kv_cache_groups()
    for group, spec_group in zip(groups, engine.kv_cache_groups, strict=True):
        group["num_layers"] = count_layers(group["specs"])
        group["num_specs"] = len(group["layers"])
        group["row"] = token_row(spec_group.kv_cache_spec)
    return groups


def _kv_group_line(group: dict[str, Any]) -> str:
    from app.commands._kv_rows import row_text

    specs = group.get("specs", {})
    return (f"{group['spec']} -> {group['manager']}, block {group['block_size']} tokens x "
            f"{row_text(group['row'])}, page {group['page_size_bytes']} B, "
            f"{group['num_layers']} layer(s)"
            + ("" if len(specs) < 2 else f" ({group['num_specs']} specs: " + ", ".join(
                f"{n} {name}" for name, n in specs.items()) + ")"))


def _fmt_latency(ms: dict[str, Any], steps: dict[str, Any]) -> str:
    if ms["p50"] is None:
        return "n/a"
    return (f"median {ms['p50']:.1f} ms ({steps['p50']:g} steps), p99 {ms['p99']:.1f} ms "
            f"({steps['p99']:g} steps) over {ms['count']} requests")


def render(result: dict[str, Any]) -> str:
    """The human-readable summary."""
    plat = result["platform"]
    backend = result["backend"]
    pool = result["kv_cache"]["pool"]
    check = result["check"]
    model = result["model"]
    threads = result["threads"]
    lines = [
        f"platform        {plat['platform']} ({plat['platform_class']}), device capability "
        f"{plat['device_capability']}, fast bf16: {plat['fast_bfloat16']}",
        f"threads         {threads['count']} ({threads['source']}); OpenMP wait policy: "
        f"{threads['wait_policy']}",
        f"backend         prefill {backend['chosen']} ({backend['class']})"
        + ("" if backend["requested"] is None else f", requested {backend['requested']}"),
    ]
    width = max((len(n) for n in backend["why_not_others"]), default=0) + 2
    for name, reasons in backend["why_not_others"].items():
        lines.append(f"  not {name:<{width}}{'; '.join(reasons)}")
    decode = result["decode_backend"]
    lines.append(f"                decode {decode['chosen']} ({decode['class']}), query_len "
                 f"{decode['query_len']}"
                 + ("" if decode["requested"] is None else f", requested {decode['requested']}"))
    width = max((len(n) for n in decode["why_not_others"]), default=0) + 2
    for name, reasons in decode["why_not_others"].items():
        lines.append(f"  not {name:<{width}}{'; '.join(reasons)}")
    lines.append(f"model           {model['line']}")
    if "load" in model:
        load = model["load"]
        lines.append(f"                loaded {load['tensors']} tensors from "
                     f"{len(load['files'])} file(s) in {load['seconds']} s, peak RSS "
                     f"{load['peak_rss_ratio']:.2f}x the model's {load['model_bytes'] / 2**20:.0f}"
                     f" MiB; {load['skipped_mtp_tensors']} MTP tensors skipped")
    for i, group in enumerate(result["kv_cache"]["groups"]):
        lines.append(f"kv group {i}      {_kv_group_line(group)}")
    leaked = result["kv_cache"]["leaked_blocks"]
    lines.append(f"kv pool         {pool['num_blocks']} blocks ({pool['cache_bytes'] / 2**20:.0f}"
                 f" MiB), peak used {pool['peak_used_blocks']} ({pool['peak_use']:.1%}), "
                 f"cached {pool['cached_blocks']}, free at end {pool['free_blocks']}, "
                 f"leaked {leaked}")
    capacity = result["kv_cache"]["capacity"]
    lines.append(f"kv cache dtype  {pool['kv_cache_dtype']}: {pool['bytes_per_token_per_layer']}"
                 f" B per token and layer; the pool holds {capacity['tokens']} tokens, "
                 f"{capacity['tokens_vs_model_dtype']:.2f}x the {capacity['tokens_if_model_dtype']}"
                 f" the same memory holds in {model['dtype']}"
                 + ("" if not pool["fp8_overflows"] else
                    f"; {pool['fp8_overflows']} values saturated by the fp8 scale"))
    wl = result["workload"]
    spec = result["speculative"]
    summary = {
        "requests": f"{wl['num_requests']}, prompts {wl['min_len']}-{wl['max_len']} tokens "
                    f"({wl['prompt_tokens']} in all), {wl['min_new_tokens']}-"
                    f"{wl['max_new_tokens']} new tokens each; step budget {wl['step_tokens']}",
        "steps": f"{result['steps']} ({result['preemptions']} preemptions), "
                 f"{result['generated_tokens']} tokens generated in "
                 f"{result['serve_seconds']} s",
        "prefill": f"{result['prefill_tokens']} tokens in {result['prefill_seconds']} s = "
                   f"{result['prefill_tokens_per_s']:.0f} tokens/s",
        "decode": f"{result['decode_tokens']} tokens in {result['decode_seconds']} s = "
                  f"{result['decode_tokens_per_s']:.0f} tokens/s",
        "TTFT": _fmt_latency(result["ttft_ms"], result["ttft_steps"])
        + f", prompts {wl['min_len']}-{wl['max_len']} tokens, all queued at step 0 (from "
          "arrival to the first token: queueing and prefill)",
        "TPOT": _fmt_latency(result["tpot_ms"], result["tpot_steps"])
        + " (per token after the first)",
        "prefix cache": f"hit rate {result['prefix_cache_hit_rate']:.1%} of prompt tokens",
    }
    if spec["tokens"]:
        summary["speculative"] = (f"{spec['tokens']} n-gram drafts per step: "
                                  f"{spec['accepted']}/{spec['drafts']} accepted "
                                  f"({spec['acceptance_rate']:.1%})")
    if check["enabled"]:
        verdict = "PASS" if check["passed"] else "FAIL"
        summary["max error"] = (
            f"prefill {check['prefill_max_relative_error']:.2e}, decode "
            f"{check['decode_max_relative_error']:.2e} of the output scale "
            f"({check['ref_max_abs']:.2f}) vs dense float64; tolerance "
            f"{check['tolerance']:.2e}: {verdict}")
        summary["tolerance"] = (f"{check['tolerance_rule']}; that model's error here: "
                                f"{check['dtype_max_relative_error']:.2e}"
                                + (f" ({check['dtype_route_differences']} rows where it chose "
                                   "other experts than float64 left out)"
                                   if check["dtype_route_differences"] else ""))
        summary["rows checked"] = (
            f"prefill {check['prefill_rows_checked']} of {check['prefill_rows_computed']}, "
            f"decode {check['decode_rows_checked']} of {check['decode_rows_computed']} "
            f"({check['sample']})")
        summary["tokens"] = (f"{check['tokens_agreeing']} of {check['tokens_checked']} are the "
                             f"float64 argmax, {check['near_ties']} near-ties (either token "
                             f"within rounding), {check['token_mismatches']} mismatches; "
                             f"{check['routing_near_ties']} rows with a routing near-tie "
                             f"(experts within {check['routing_tolerance']:g}: rounding) not "
                             "compared"
                             + (f"; {check['selection_near_ties']} rows with a top-k "
                                "selection near-tie (sparse attention) not compared"
                                if check["selection_near_ties"] else ""))
        if check["selection_rows_compared"]:
            summary["selections"] = _selection_line(check)
        summary["check time"] = (f"{check['seconds']} s ({result['check_share_of_wall']:.0%} "
                                 f"of the wall time)")
    else:
        summary["max error"] = "not checked (--no-check)"
    summary["wall time"] = f"{result['wall_seconds']} s"
    lines.extend(f"{key:<16}{value}" for key, value in summary.items())
    return "\n".join(lines)


def _selection_line(check: dict[str, Any]) -> str:
    """A sparse model's selections against float64's (the check attends to the engine's)."""
    shared = check["selection_keys_shared"] / max(check["selection_keys"], 1)
    return (f"the engine's own top-k fed to the float64 reference; vs its own top-k on "
            f"{check['selection_rows_compared']} rows: {shared:.2%} of "
            f"{check['selection_keys']} keys shared, {check['selection_differences']} rows "
            f"selected otherwise, {check['selection_mismatches']} of them beyond rounding "
            f"(largest violation {check['selection_max_violation']:.2e}, limit "
            f"{check['selection_limit']:.2e} of the row's largest score)")


def run(args: argparse.Namespace) -> int:
    """Run the job and print the summary; 1 when the check fails or blocks leaked."""
    result = execute(args)
    if args.json:
        print_json(result)
    else:
        print_text(render(result))
    return 0 if result["ok"] else 1
