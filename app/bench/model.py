"""``python -m app bench model``: the engine on a DeepSeek checkpoint vs transformers' generate.

The checkpoint: ``--model DIR``, or (default) one made with transformers in a temporary
directory at production attention dims (H=16, kv_lora_rank 512, rope 64, nope 128, v 128; q
LoRA, yarn, 4 layers, the first dense, then MoE with 16 experts in 4 groups, top-4, 2 shared
experts; hidden 1024, vocabulary 16384) in ``--dtype`` (bfloat16).

The same random prompts (``--prompt-len`` tokens each, batch 1 and ``--batch``) run through
each engine, interleaved, best of ``--repeat``:

- ours: ``MLAEngine`` over the checkpoint (``load_checkpoint``; the backends the container
  selects), prefix caching off so every repetition computes everything;
- ``transformers``: the same checkpoint loaded with ``from_pretrained`` in the same dtype, its
  own ``generate`` (greedy, no eos stop).

- ``vllm`` (``--baseline vllm --vllm-python PATH``): the whole vLLM CPU engine with its own
  backends (``VLLM_PLUGINS=none``), one engine kept in a subprocess of that python
  (``app.bench.vllm.model``).

Each engine is timed generating 1 token (the prefill) and ``--new-tokens`` tokens; prefill
tokens/s = ``batch * prompt_len / t_1``. Decode tokens/s is measured inside the ``--new-tokens``
run itself: each engine reports when every request had its first token (ours: its own step
timestamps; transformers: a logits processor's first call, right after the prefill's forward;
vLLM: its engine stepped by the worker) and how many tokens came after, and decode tokens/s =
those tokens / the seconds after (``decode_seconds``). It was the difference of the two runs,
which came out 0.0 (or null) whenever the longer run was no longer than the short one on a
busy machine; a runner that returns bare seconds still gets that difference (``decode_measure``
says which). Reported per batch size: both engines' rates and our speed-up. Targets (issue 23):
against transformers a decode speed-up of at least 5x at batch 16; against whole vLLM at
least 2x prefill (prefill-heavy) and 1.5x decode (decode-heavy), at every batch size. Also:
our load report (peak RSS over the loaded model's size), our process's peak RSS (the
checkpoint is written by a child process, so with ``--baseline vllm`` it is our engine's
alone; with transformers it holds both models) and the vLLM worker's. ``--threads`` sets the
torch threads of this process (default: torch's).

Other engines plug in through ``BASELINES`` (name -> ``factory(directory, dtype, options)``,
``options`` this command's arguments, returning ``runner(prompts, new_tokens) -> seconds`` or
a ``RunTiming`` (``app.bench._timing``); a runner may also have ``describe() -> dict`` and
``close()``); ``--baseline NAME`` selects one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.bench._load import load_text
from app.bench._timing import RunTiming
from app.bench.vllm.prefill import VLLM_PYTHON_ENV, _cpu_name, _load
from app.commands._args import positive_float, positive_int
from app.commands._output import raise_for_errors
from app.config import DTYPE_ALIASES, EngineConfig, dtype_name, parse_dtype
from app.model.loader import read_rss

HELP = "the engine on a DeepSeek checkpoint vs transformers' generate: prefill/decode tokens/s"

#: Decode speed-up over transformers at batch 16 that the issue asks for.
TARGET_DECODE_SPEEDUP = 5.0
#: Speed-ups over the whole vLLM engine the issue asks for (prefill, decode).
TARGET_VLLM_SPEEDUPS = {"prefill_speedup": 2.0, "decode_speedup": 1.5}

#: The routing keys of DeepSeek-V3's Hub config, which transformers' own config omits (it
#: implies them): vLLM reads them to build the sigmoid gate with its score bias.
HUB_ROUTING_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}

#: The production-dims checkpoint made when no ``--model`` is given (transformers kwargs).
BENCH_MODEL: dict[str, Any] = {
    "vocab_size": 16384, "hidden_size": 1024, "intermediate_size": 2816,
    "moe_intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 16, "n_shared_experts": 2, "num_experts_per_tok": 4, "n_group": 4,
    "topk_group": 2, "first_k_dense_replace": 1, "max_position_embeddings": 163840,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    "initializer_range": 0.02,
}

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the workload, the baseline."""
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="a DeepSeek-V2/V3 checkpoint (default: a production-dims one made "
                             "with transformers in a temporary directory)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_ALIASES),
                        help="dtype of both engines (default: %(default)s)")
    parser.add_argument("--prompt-len", type=positive_int, default=256,
                        help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=positive_int, default=32,
                        help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=16,
                        help="the larger batch (the other is 1) (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=2,
                        help="repetitions, interleaved; the best is kept (default: %(default)s)")
    parser.add_argument("--baseline", default="transformers",
                        help="the engine compared against: transformers, vllm (default: "
                             "%(default)s; others register in app.bench.model.BASELINES)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads of this process (default: torch's)")
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                        help=f"--baseline vllm: python of an environment with vLLM's CPU build "
                             f"(default ${VLLM_PYTHON_ENV})")
    parser.add_argument("--vllm-timeout", type=positive_float, default=1800.0,
                        help="--baseline vllm: seconds the engine may take to start or to "
                             "answer one run (default: %(default)s)")


def make_bench_checkpoint(directory: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Save ``BENCH_MODEL`` (transformers' init, ``seed``) in ``dtype`` to ``directory``, its
    ``config.json`` with the Hub's routing keys (``HUB_ROUTING_KEYS``) added."""
    try:
        import transformers
    except ImportError:
        raise ImportError("bench model makes its checkpoint with transformers: pip install "
                          "'app[test]' (or pass --model DIR)") from None
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**BENCH_MODEL)
    model: Any = transformers.DeepseekV3ForCausalLM(config)
    model = model.to(dtype)
    model.save_pretrained(directory)
    del model
    path = directory / "config.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**saved, **HUB_ROUTING_KEYS}, indent=2) + "\n",
                    encoding="utf-8")
    return directory


def _child_checkpoint(directory: Path, dtype: torch.dtype) -> Path:
    """``make_bench_checkpoint`` in a child process (transformers' model never enters this
    process's resident set)."""
    code = ("import sys, torch\nfrom pathlib import Path\n"
            "from app.bench.model import make_bench_checkpoint\n"
            "make_bench_checkpoint(Path(sys.argv[1]), getattr(torch, sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", code, str(directory), dtype_name(dtype)],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout)[-2000:]
        if "ImportError" in tail and "transformers" in tail:
            raise ImportError("bench model makes its checkpoint with transformers: pip install "
                              "'app[test]' (or pass --model DIR)")
        raise RuntimeError(f"making the bench checkpoint failed: {tail}")
    return directory


#: What a runner returns: bare seconds (the old form) or a :class:`RunTiming`.
Timed = float | RunTiming


class _Ours:
    """Our engine over one checkpoint, loaded once; one fresh engine per timed run."""

    def __init__(self, directory: Path, dtype: torch.dtype) -> None:
        from app.model import load_checkpoint

        self.loaded = load_checkpoint(directory, dtype)
        self.dtype = dtype
        self.reordered_weight_bytes = 0

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> RunTiming:
        from app.containers import create_container
        from app.mla import MLAEngine, Request

        blocks = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 8
        config = EngineConfig.from_dict({"cache": {"block_size": 16, "num_blocks": blocks,
                                                   "enable_prefix_caching": False}})
        config = EngineConfig(model=self.loaded.config.model_config(self.dtype),
                              cache=config.cache)
        engine = MLAEngine(create_container(config), weights=self.loaded.weights,
                           step_tokens=max(8192, sum(len(p) for p in prompts)),
                           keep_outputs=False)
        self.reordered_weight_bytes = engine.model.reordered_weight_bytes
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", p, max_new_tokens=new_tokens))
        outputs: list[Any] = []
        got, first, at_first = dict.fromkeys(range(len(prompts)), 0), None, 0
        while engine.has_unfinished():   # the engine's own steps, timestamped
            step = engine.step()
            for request_id, tokens in step.new_tokens.items():
                got[int(request_id[1:])] += len(tokens)
            outputs.extend(step.finished)
            if first is None and all(got.values()):
                first, at_first = time.perf_counter() - start, sum(got.values())
        seconds = time.perf_counter() - start
        raise_for_errors(outputs)   # NaN logits: an error, not a timing
        return RunTiming(seconds, first, sum(got.values()) - at_first)


class _Transformers:
    """transformers' ``generate`` on the same checkpoint (loaded once)."""

    def __init__(self, directory: Path, dtype: torch.dtype,
                 options: argparse.Namespace | None = None) -> None:
        import transformers

        model: Any = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        self.model = model.eval()

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> RunTiming:
        import transformers

        class FirstToken(transformers.LogitsProcessor):
            """Notes when the first logits are scored: right after the prefill's forward."""

            at: float | None = None

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                if self.at is None:
                    self.at = time.perf_counter()
                return scores

        ids, clock = torch.tensor(prompts), FirstToken()
        start = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0,
                                logits_processor=transformers.LogitsProcessorList([clock]))
        seconds = time.perf_counter() - start
        first = None if clock.at is None else clock.at - start
        return RunTiming(seconds, first, len(prompts) * (new_tokens - 1))


def _whole_vllm(directory: Path, dtype: torch.dtype, options: argparse.Namespace
                ) -> Callable[[list[list[int]], int], Timed]:
    from app.bench.vllm.model import WholeVLLM

    return WholeVLLM(directory, dtype, options)


#: Baseline engines by name: each ``factory(directory, dtype, options)`` returns a callable
#: ``(prompts, new_tokens) -> seconds`` (see the module docstring).
BASELINES: dict[str, Callable[[Path, torch.dtype, argparse.Namespace],
                              Callable[[list[list[int]], int], Timed]]] = {
    "transformers": _Transformers,
    "vllm": _whole_vllm,
}


def _timing(result: Timed) -> RunTiming:
    return result if isinstance(result, RunTiming) else RunTiming(float(result))


def _rates(t_first: float, run: RunTiming, batch: int, prompt_len: int, new: int
           ) -> dict[str, Any]:
    """Prefill from the 1-token run; decode from inside the ``new``-token run (``run``, its
    best), else (a runner that gives bare seconds) the difference of the two runs."""
    rates: dict[str, Any] = {
        "prefill_seconds": round(t_first, 4), "generate_seconds": round(run.seconds, 4),
        "prefill_tokens_per_s": round(batch * prompt_len / t_first, 1)}
    if run.first_token_seconds is not None and run.decode_tokens:
        decode, tokens = run.seconds - run.first_token_seconds, run.decode_tokens
        rates["first_token_seconds"] = round(run.first_token_seconds, 4)
        rates["decode_measure"] = "within the run: the tokens after every request's first"
    else:
        decode, tokens = run.seconds - t_first, batch * (new - 1)
        rates["decode_measure"] = "difference of the two runs (the runner gives bare seconds)"
    rates["decode_seconds"] = round(decode, 4)
    rates["decode_tokens_per_s"] = round(tokens / decode, 1) if decode > 0 else None
    return rates


def _speedups(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    return {key: round(mine[rate] / max(theirs[rate], 1e-9), 2)
            if mine[rate] is not None and theirs[rate] is not None else None
            for key, rate in (("prefill_speedup", "prefill_tokens_per_s"),
                              ("decode_speedup", "decode_tokens_per_s"))}


def _decode_rate(run: RunTiming) -> float | None:
    """Tokens/s after every request's first token, where the run measured it."""
    if run.first_token_seconds is None or not run.decode_tokens \
            or run.seconds <= run.first_token_seconds:
        return None
    return run.decode_tokens / (run.seconds - run.first_token_seconds)


def _best_run(runs: list[RunTiming]) -> RunTiming:
    """The run with the best decode rate (runs that measured it), else the fastest."""
    measured = [(rate, r) for r in runs if (rate := _decode_rate(r)) is not None]
    if measured:
        return max(measured, key=lambda pair: pair[0])[1]
    return min(runs, key=lambda r: r.seconds)


def _measure(args: argparse.Namespace, ours: _Ours,
             baseline: Callable[[list[list[int]], int], Timed]) -> list[dict[str, Any]]:
    """Both engines on the same prompts, batch 1 and ``--batch``, interleaved, best of
    ``--repeat``, after one untimed warm-up run of each (one-time set-up such as oneDNN's
    kernel generation is no engine's steady state)."""
    vocab = ours.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(2, vocab, (1, args.prompt_len), generator=gen).tolist()
    for runner in (ours, baseline):
        runner(warm, 2)
    results = []
    for batch in sorted({1, args.batch}):
        prompts = torch.randint(2, vocab, (batch, args.prompt_len), generator=gen).tolist()
        seconds: dict[str, list[list[float]]] = {"ours": [[], []], "baseline": [[], []]}
        runs: dict[str, list[RunTiming]] = {"ours": [], "baseline": []}
        for _ in range(args.repeat):
            for name, runner in (("ours", ours), ("baseline", baseline)):
                seconds[name][0].append(round(_timing(runner(prompts, 1)).seconds, 4))
                runs[name].append(_timing(runner(prompts, args.new_tokens)))
                seconds[name][1].append(round(runs[name][-1].seconds, 4))
        mine, theirs = (_rates(min(seconds[name][0]), _best_run(runs[name]), batch,
                               args.prompt_len, args.new_tokens)
                        for name in ("ours", "baseline"))
        results.append({"batch": batch, "ours": mine, args.baseline: theirs,
                        **_speedups(mine, theirs),
                        "seconds": {"ours": seconds["ours"], args.baseline: seconds["baseline"],
                                    "runs": f"[1 token, {args.new_tokens} tokens] x repeat"}})
    return results


def _targets(baseline: str, results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if baseline == "vllm":
        wanted = [(r, key, target) for r in results
                  for key, target in TARGET_VLLM_SPEEDUPS.items()]
    else:
        wanted = [(results[-1], "decode_speedup", TARGET_DECODE_SPEEDUP)]
    return {f"{key}_at_batch_{r['batch']}": {"target": f">= {target}", "measured": r[key],
                                             "pass": r[key] is not None and r[key] >= target}
            for r, key, target in wanted}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison; the JSON-friendly result (``ok``: every target met, both engines
    ran)."""
    dtype = parse_dtype(args.dtype, "--dtype")
    if args.baseline not in BASELINES:
        raise ValueError(f"--baseline {args.baseline!r}: known baselines "
                         f"{sorted(BASELINES)}")
    if args.new_tokens < 2:
        raise ValueError("--new-tokens must be >= 2 (decode is timed after the first token)")
    if args.baseline == "vllm":
        from app.bench.vllm.model import check_vllm_python

        check_vllm_python(args.vllm_python)
    if args.threads:
        torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), _load()
    error: str | None = None
    results: list[dict[str, Any]] = []
    baseline_info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="app-bench-model-") as tmp:
        directory = args.model or _child_checkpoint(Path(tmp), dtype)
        ours = _Ours(directory, dtype)        # the load resets the peak-RSS mark
        baseline: Any = None
        try:
            baseline = BASELINES[args.baseline](directory, dtype, args)
            results = _measure(args, ours, baseline)
        except RuntimeError as exc:
            error = str(exc)
        finally:
            if baseline is not None and hasattr(baseline, "describe"):
                baseline_info = baseline.describe()
            if baseline is not None and hasattr(baseline, "close"):
                baseline.close()
        report = ours.loaded.report
    _, peak = read_rss()
    targets = _targets(args.baseline, results) if results else {}
    result: dict[str, Any] = {
        "benchmark": "model",
        "ok": error is None and all(t["pass"] for t in targets.values()),
        "model": {"source": str(args.model) if args.model else "BENCH_MODEL (transformers "
                  "init, temporary directory)", **ours.loaded.config.describe(),
                  "dtype": dtype_name(dtype)},
        "workload": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "batches": sorted({1, args.batch}), "repeat": args.repeat},
        "baseline": args.baseline,
        "results": results,
        "targets": targets,
        "load": report.describe(),
        # Our engine's weight copies reordered for oneDNN (app.model.linear), beside the
        # checkpoint's own tensors (the load report's model_bytes).
        "reordered_weight_bytes": ours.reordered_weight_bytes,
        "peak_rss_bytes": {
            "ours": peak, "ours_is_since_load": report.peak_rss_is_load_peak,
            "ours_holds": "our engine" if args.baseline != "transformers" else
                          "our engine and transformers' model (one process)",
            "baseline": baseline_info.get("peak_rss_bytes")},
        "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch_threads": torch.get_num_threads(),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count()},
        "load_average_before": load_before, "load_average_after": _load(),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    if baseline_info:
        result["baseline_info"] = baseline_info
    if error is not None:
        result["error"] = error
    return result


def render(result: dict[str, Any]) -> str:
    """A readable summary."""
    load_line = load_text(result["load_average_before"], result["load_average_after"],
                          result["machine"]["cores"])
    lines = [f"model: {result['model']['architecture']} {result['model']['dtype']}, "
             f"{result['model']['num_hidden_layers']} layers, baseline {result['baseline']} "
             f"({result['machine']['cpu']}, {result['torch_threads']} torch threads, "
             f"{load_line})"]
    if "error" in result:
        lines.append(f"the baseline failed: {result['error']}")
    for r in result["results"]:
        ours, theirs = r["ours"], r[result["baseline"]]
        lines.append(f"batch {r['batch']:>3}: prefill {ours['prefill_tokens_per_s']:.0f} vs "
                     f"{theirs['prefill_tokens_per_s']:.0f} tok/s ({r['prefill_speedup']}x), "
                     f"decode {ours['decode_tokens_per_s'] or 0:.0f} vs "
                     f"{theirs['decode_tokens_per_s'] or 0:.0f} tok/s ({r['decode_speedup']}x)")
    for name, t in result["targets"].items():
        lines.append(f"target {name}: {t['measured']}x vs {t['target']}x: "
                     f"{'pass' if t['pass'] else 'MISS'}")
    load, rss = result["load"], result["peak_rss_bytes"]
    lines.append(f"load: {load['seconds']} s, peak RSS {load['peak_rss_ratio']:.2f}x the "
                 f"model's {load['model_bytes'] / 2**20:.0f} MiB")
    baseline_rss = (f", {result['baseline']} {rss['baseline'] / 2**20:.0f} MiB"
                    if rss.get("baseline") else "")
    lines.append(f"peak RSS: ours {rss['ours'] / 2**20:.0f} MiB{baseline_rss}")
    return "\n".join(lines)
