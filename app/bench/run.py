"""``python -m app bench run``: the engine's step loop on a decode-heavy and a prefill-heavy mix.

Both mixes run ``MLAEngine`` (the same path as ``python -m app run``, its random DeepSeek model,
one layer) with a ``PhaseTimer`` charging every part of each timed step. The feed-forward half
of the layer (norms, MoE: the ``mlp`` phase) is left out of the step times below: these mixes
measure the attention engine around the backends.

- **decode-heavy**: ``--decode-requests`` (64) requests decoding at ``--min-context`` to
  ``--max-context`` (2k-8k) tokens of context. The contexts are prefixes of ``--documents``
  shared documents, prefilled once (untimed) and then hit in the prefix cache, so setting up
  64 x 5k tokens of context costs 8 x 8k tokens of prefill; each request still reads its whole
  context through its own block table every step. After every request has started decoding,
  ``--decode-steps`` steps are timed. Reported: steps/s, decode tokens/s, the decode attention
  kernel's share of the step (``attention_decode``: the decode backend's ``run_decode``),
  and the scheduler + KV bookkeeping share (``schedule``: scheduling, ``allocate_slots``,
  ``cache_blocks``, drafting, token bookkeeping; ``decode_metadata``: block tables, slots,
  ``prepare_metadata``; ``cache_write``; and the step time no phase claimed). Target: <= 5%.
- **prefill-heavy**: ``--requests-per-step`` requests per step, each a cached
  ``--context-len`` context (a prefix-cache hit: gathered from the paged cache in chunks and
  up-projected) plus ``--new-tokens`` fresh tokens, one generated token each. Reported:
  prefill tokens/s, the prefill attention kernels' share (targets: >= 60%, merge + bookkeeping
  <= 10%).
"""

from __future__ import annotations

import argparse
import platform as _pyplatform
import random
import time
from typing import TYPE_CHECKING, Any

import attrs
import torch

from app.commands._args import int_in, positive_int
from app.commands._memory import check_cache_fits
from app.config import DTYPE_ALIASES, EngineConfig

if TYPE_CHECKING:
    from app.containers import Application
    from app.mla.engine import MLAEngine
    from app.model.config import DeepseekConfig
    from app.model.profiling import PhaseTimer

HELP = "engine steps: a decode-heavy mix (64 requests at 2-8k context) and a prefill-heavy mix"

#: Targets from the issues (CPU).
TARGET_DECODE_BOOKKEEPING_SHARE = 0.05
TARGET_ATTENTION_SHARE = 0.60
TARGET_MERGE_BOOKKEEPING_SHARE = 0.10

_PREFILL_BOOKKEEPING = ("schedule", "metadata", "cache_write")
_PREFILL_ATTENTION = ("attention_new", "attention_context")
_DECODE_BOOKKEEPING = ("schedule", "decode_metadata", "cache_write")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Which mixes, their sizes, dtype, backend, block size, seed."""
    parser.add_argument("--mix", choices=("both", "decode", "prefill"), default="both",
                        help="which mix to run (default: %(default)s)")
    parser.add_argument("--decode-requests", type=positive_int, default=64,
                        help="requests decoding at once (default: %(default)s)")
    parser.add_argument("--min-context", type=positive_int, default=2048,
                        help="shortest decode context, tokens (default: %(default)s)")
    parser.add_argument("--max-context", type=positive_int, default=8192,
                        help="longest decode context, tokens (default: %(default)s)")
    parser.add_argument("--documents", type=positive_int, default=8,
                        help="shared documents the decode contexts are prefixes of "
                             "(default: %(default)s)")
    parser.add_argument("--decode-steps", type=positive_int, default=8,
                        help="timed decode steps (default: %(default)s)")
    parser.add_argument("--speculative-tokens", type=int_in(0, 15), default=0,
                        help="n-gram drafts per decode step (default: %(default)s)")
    parser.add_argument("--context-len", type=positive_int, default=4096,
                        help="prefill mix: cached context per request (default: %(default)s)")
    parser.add_argument("--new-tokens", type=positive_int, default=2048,
                        help="prefill mix: new tokens per request (default: %(default)s)")
    parser.add_argument("--requests-per-step", type=positive_int, default=4,
                        help="prefill mix: requests per step (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=3,
                        help="prefill mix: timed steps after one warm-up step "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_ALIASES),
                        help="model dtype (default: bfloat16)")
    parser.add_argument("--backend", default=None, help="MLA prefill backend (default: auto)")
    parser.add_argument("--chunk-tokens", type=positive_int, default=None,
                        help="context chunk bound (default: 65536)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="KV-cache block size (default: %(default)s)")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0,
                        help="seed (default: %(default)s)")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="leave glibc malloc as it is (see app.mla.process)")


def _config(args: argparse.Namespace, num_blocks: int) -> EngineConfig:
    data: dict[str, Any] = {"cache": {"block_size": args.block_size, "num_blocks": num_blocks}}
    if args.dtype is not None:
        data["model"] = {"dtype": args.dtype}
    attention: dict[str, Any] = {}
    if args.backend is not None:
        attention["mla_prefill_backend"] = args.backend
    if args.chunk_tokens is not None:
        attention["context_chunk_tokens"] = args.chunk_tokens
    if attention:
        data["attention"] = attention
    return EngineConfig.from_dict(data)


def _fitted_config(args: argparse.Namespace, num_blocks: int
                   ) -> tuple[EngineConfig, Application, DeepseekConfig]:
    """The mix's engine config, its container and its random architecture; raises
    ``ValueError`` where a pool of ``num_blocks`` does not fit the device's memory."""
    from app.containers import create_container
    from app.model.random import random_config

    config = _config(args, num_blocks)
    arch = random_config(config.model, num_layers=1)
    config = attrs.evolve(config, model=arch.model_config(config.model.dtype))
    container = create_container(config)
    check_cache_fits(config, container.platform().device)
    return config, container, arch


def _engine(args: argparse.Namespace, num_blocks: int, step_tokens: int, timer: PhaseTimer,
            speculative: int = 0) -> MLAEngine:
    from app.mla.engine import MLAEngine
    from app.model.random import random_weights

    config, container, arch = _fitted_config(args, num_blocks)
    return MLAEngine(container, weights=random_weights(arch, config.model.dtype, args.seed),
                     step_tokens=step_tokens, keep_outputs=False, timer=timer,
                     num_speculative_tokens=speculative, max_num_seqs=max(256, step_tokens))


def _share(x: float, total: float) -> float:
    return round(x / total, 4) if total > 0 else 0.0


def _timed_steps(engine: MLAEngine, timer: PhaseTimer, steps: int
                 ) -> tuple[float, int, int, dict[str, float]]:
    """Run ``steps`` steps with the timer on: seconds, decode tokens emitted, prefill tokens,
    phase seconds."""
    timer.reset()
    timer.enabled = True
    seconds = 0.0
    emitted = prefilled = 0
    for _ in range(steps):
        before = engine.stats.decode_emitted_tokens
        out = engine.step()
        seconds += out.seconds
        emitted += engine.stats.decode_emitted_tokens - before
        prefilled += out.num_prefill_tokens
    timer.enabled = False
    return seconds, emitted, prefilled, dict(timer.seconds)


def _decode_mix_new_tokens(args: argparse.Namespace) -> int:
    # never reached: the timed steps end first
    return int((args.decode_steps + 8) * (1 + args.speculative_tokens))


def _decode_mix_blocks(args: argparse.Namespace) -> int:
    bs = args.block_size
    per_request = 2 + -(-(_decode_mix_new_tokens(args) + args.speculative_tokens) // bs)
    return int(1 + args.documents * -(-args.max_context // bs)
               + args.decode_requests * per_request + 16)


def _prefill_mix_blocks(args: argparse.Namespace) -> int:
    per_request = args.context_len + args.new_tokens
    return int(1 + 4 * args.requests_per_step * -(-per_request // args.block_size))


def run_decode_mix(args: argparse.Namespace, timer: PhaseTimer) -> dict[str, Any]:
    """The decode-heavy mix (see the module docstring)."""
    from app.mla.requests import Request

    n, steps, spec = args.decode_requests, args.decode_steps, args.speculative_tokens
    rng = random.Random(args.seed)
    max_new = _decode_mix_new_tokens(args)
    engine = _engine(args, _decode_mix_blocks(args), max(8192, n * (1 + spec)), timer, spec)
    vocab = engine.model.vocab_size
    docs = [[rng.randrange(vocab) for _ in range(args.max_context)]
            for _ in range(args.documents)]
    fill_start = time.perf_counter()
    engine.run(Request(f"doc-{i}", doc, max_new_tokens=1) for i, doc in enumerate(docs))
    for i in range(n):
        length = rng.randint(args.min_context, args.max_context)
        prompt = [*docs[i % len(docs)][:length - 1], rng.randrange(vocab)]
        engine.add_request(Request(f"dec-{i}", prompt, max_new_tokens=max_new))
    while engine.scheduler.waiting or any(
            st.num_tokens - st.num_computed_tokens > 1 for st in engine.scheduler.running):
        engine.step()
    engine.step()  # one decode step untimed (warm-up)
    fill_seconds = time.perf_counter() - fill_start
    if engine.num_running != n:
        raise RuntimeError(f"expected {n} running requests, {engine.num_running} run")
    contexts = [st.num_computed_tokens for st in engine.scheduler.running]
    seconds, emitted, _, phases = _timed_steps(engine, timer, steps)
    ffn_seconds = phases.pop("mlp", 0.0)
    seconds -= ffn_seconds
    hits = engine.kv_manager.num_prefix_hits
    for rid in [st.request_id for st in engine.scheduler.running]:
        engine.abort(rid)
    attention = phases.get("attention_decode", 0.0)
    other = max(seconds - sum(phases.values()), 0.0)
    bookkeeping = sum(phases.get(p, 0.0) for p in _DECODE_BOOKKEEPING) + other
    book_share = _share(bookkeeping, seconds)
    return {
        "mix": "decode-heavy",
        "decode_backend": engine.decode_backend_class.get_name(),
        "workload": {"running_requests": n, "min_context": args.min_context,
                     "max_context": args.max_context, "mean_context": round(
                         sum(contexts) / len(contexts)), "documents": args.documents,
                     "timed_steps": steps, "speculative_tokens": spec,
                     "prefix_hit_tokens": hits, "setup_seconds": round(fill_seconds, 3)},
        "step_seconds": round(seconds / steps, 4),
        "steps_per_s": round(steps / seconds, 3) if seconds else 0.0,
        "decode_tokens_per_s": round(emitted / seconds, 1) if seconds else 0.0,
        "phase_seconds_per_step": {p: round(v / steps, 5) for p, v in phases.items() if v},
        "unaccounted_seconds_per_step": round(other / steps, 5),
        "share_of_step": {"attention_decode": _share(attention, seconds),
                          "scheduler_and_kv_bookkeeping": book_share,
                          "projections": _share(phases.get("projection", 0.0), seconds),
                          "absorption": _share(phases.get("absorption", 0.0), seconds),
                          "lm_head_and_sampling": _share(phases.get("lm_head", 0.0)
                                                         + phases.get("sample", 0.0), seconds)},
        "targets": {"scheduler_and_kv_bookkeeping_share_of_step": {
            "target": f"<= {TARGET_DECODE_BOOKKEEPING_SHARE}", "measured": book_share,
            "pass": book_share <= TARGET_DECODE_BOOKKEEPING_SHARE}},
    }


def run_prefill_mix(args: argparse.Namespace, timer: PhaseTimer) -> dict[str, Any]:
    """The prefill-heavy mix (see the module docstring)."""
    from app.mla.requests import Request

    n = args.requests_per_step
    engine = _engine(args, _prefill_mix_blocks(args), n * args.new_tokens, timer)
    rng = random.Random(args.seed)
    vocab = engine.model.vocab_size
    contexts = [[rng.randrange(vocab) for _ in range(args.context_len)] for _ in range(n)]
    fill_start = time.perf_counter()
    engine.run(Request(f"context-{i}", ctx, max_new_tokens=1) for i, ctx in enumerate(contexts))
    fill_seconds = time.perf_counter() - fill_start

    def add(tag: str) -> None:
        for i, ctx in enumerate(contexts):
            engine.add_request(Request(f"{tag}-{i}", ctx + [rng.randrange(vocab) for _ in
                                                             range(args.new_tokens)],
                                       max_new_tokens=1))

    add("warmup")
    engine.step()
    hits_before = engine.stats.cached_tokens
    seconds = 0.0
    phases: dict[str, float] = {}
    for s in range(args.steps):
        add(f"step{s}")
        step_seconds, _, prefilled, step_phases = _timed_steps(engine, timer, 1)
        step_seconds -= step_phases.pop("mlp", 0.0)
        if engine.has_unfinished() or prefilled != n * args.new_tokens:
            raise RuntimeError(f"a timed step did not run all {n} requests in one step")
        seconds += step_seconds
        for name, value in step_phases.items():
            phases[name] = phases.get(name, 0.0) + value
    if engine.stats.cached_tokens - hits_before != args.steps * n * args.context_len:
        raise RuntimeError(f"expected every timed request to hit its {args.context_len}-token "
                           "context in the prefix cache")
    attention = sum(phases.get(p, 0.0) for p in _PREFILL_ATTENTION)
    other = max(seconds - sum(phases.values()), 0.0)
    mb = phases.get("merge", 0.0) + sum(phases.get(p, 0.0) for p in _PREFILL_BOOKKEEPING) \
        + other
    attention_share, mb_share = _share(attention, seconds), _share(mb, seconds)
    path = seconds - phases.get("projection", 0.0) - phases.get("lm_head", 0.0) \
        - phases.get("sample", 0.0)
    steps = args.steps
    return {
        "mix": "prefill-heavy",
        "prefill_backend": engine.backend_class.get_name(),
        "workload": {"context_len": args.context_len, "new_tokens": args.new_tokens,
                     "requests_per_step": n, "timed_steps": steps,
                     "step_tokens": n * args.new_tokens, "block_size": args.block_size,
                     "context_fill_seconds": round(fill_seconds, 3)},
        "step_seconds": round(seconds / steps, 4),
        "steps_per_s": round(steps / seconds, 3) if seconds else 0.0,
        "prefill_tokens_per_s": round(steps * n * args.new_tokens / seconds, 1)
        if seconds else 0.0,
        "phase_seconds_per_step": {p: round(v / steps, 4) for p, v in phases.items() if v},
        "unaccounted_seconds_per_step": round(other / steps, 4),
        "share_of_step": {"attention_kernels": attention_share,
                          "gather": _share(phases.get("gather", 0.0), seconds),
                          "up_projection": _share(phases.get("up_projection", 0.0), seconds),
                          "merge_and_bookkeeping": mb_share,
                          "dense_projections": _share(phases.get("projection", 0.0), seconds)},
        # The step without the dense projections (which any layer has, whatever the attention).
        "share_of_attention_path": {
            "attention_kernels": _share(attention, path),
            "outside_attention_kernels": _share(path - attention, path),
            "merge_and_bookkeeping": _share(mb, path)},
        "targets": {
            "attention_kernels_share_of_step": {
                "target": f">= {TARGET_ATTENTION_SHARE}", "measured": attention_share,
                "pass": attention_share >= TARGET_ATTENTION_SHARE},
            "merge_and_bookkeeping_share_of_step": {
                "target": f"<= {TARGET_MERGE_BOOKKEEPING_SHARE}", "measured": mb_share,
                "pass": mb_share <= TARGET_MERGE_BOOKKEEPING_SHARE}},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the mixes; the JSON-friendly result (``ok``: every target met)."""
    from app.mla.process import tune_malloc_for_large_tensors
    from app.model.profiling import PhaseTimer

    for name in ("decode_requests", "min_context", "max_context", "documents", "decode_steps",
                 "context_len", "new_tokens", "requests_per_step", "steps", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_context > args.max_context:
        raise ValueError(f"--min-context ({args.min_context}) must be <= --max-context "
                         f"({args.max_context})")
    if args.speculative_tokens < 0:
        raise ValueError("--speculative-tokens must be >= 0")
    if args.mix in ("both", "prefill") and args.context_len % args.block_size:
        raise ValueError(f"--context-len ({args.context_len}) must be a multiple of "
                         f"--block-size ({args.block_size}): only full blocks are cached")
    # Every mix's pool is checked before any mix runs: a refusal never comes after minutes.
    if args.mix in ("both", "decode"):
        _fitted_config(args, _decode_mix_blocks(args))
    if args.mix in ("both", "prefill"):
        _fitted_config(args, _prefill_mix_blocks(args))
    malloc_tuned = False if args.no_malloc_tuning else tune_malloc_for_large_tensors()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    mixes: list[dict[str, Any]] = []
    if args.mix in ("both", "decode"):
        mixes.append(run_decode_mix(args, PhaseTimer(enabled=False, sync=sync)))
    if args.mix in ("both", "prefill"):
        mixes.append(run_prefill_mix(args, PhaseTimer(enabled=False, sync=sync)))
    return {
        "benchmark": "run",
        "torch": torch.__version__,
        "python": _pyplatform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "malloc_tuned": malloc_tuned,
        "dtype": args.dtype or "bfloat16",
        "mixes": mixes,
        "ok": all(t["pass"] for mix in mixes for t in mix["targets"].values()),
    }


def render(result: dict[str, Any]) -> str:
    """A readable summary of ``run``'s result."""
    lines = [f"engine steps, {result['dtype']}, {result['torch_threads']} threads"]
    for mix in result["mixes"]:
        wl = mix["workload"]
        if mix["mix"] == "decode-heavy":
            lines.append(f"decode-heavy: {wl['running_requests']} requests at "
                         f"{wl['min_context']}-{wl['max_context']} context (mean "
                         f"{wl['mean_context']}), {mix['decode_backend']}: "
                         f"{mix['steps_per_s']:.2f} steps/s, {mix['decode_tokens_per_s']:.0f} "
                         f"decode tokens/s")
        else:
            lines.append(f"prefill-heavy: {wl['requests_per_step']} x ({wl['context_len']} "
                         f"cached + {wl['new_tokens']} new), {mix['prefill_backend']}: "
                         f"{mix['steps_per_s']:.2f} steps/s, {mix['prefill_tokens_per_s']:.0f} "
                         f"prefill tokens/s")
        step = mix["step_seconds"]
        for name, seconds in mix["phase_seconds_per_step"].items():
            pct = seconds / step if step else 0.0
            lines.append(f"  {name:<18}{seconds * 1e3:9.1f} ms  {pct:6.1%}")
        lines.append(f"  {'(unaccounted)':<18}{mix['unaccounted_seconds_per_step'] * 1e3:9.1f}"
                     f" ms")
        for name, target in mix["targets"].items():
            verdict = "PASS" if target["pass"] else "FAIL"
            lines.append(f"  {name}: {target['measured']:.1%} (target {target['target']}) "
                         f"{verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/bench_run.py [options]``: the same as ``python -m app bench run``."""
    from app.cli import main as cli_main

    return cli_main(["bench", "--json", "run", *(argv or [])])
