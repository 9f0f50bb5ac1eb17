"""``python -m app bench vllm-engine --vllm-python PATH``: a whole vLLM engine (its CPU build) on a
DeepSeek checkpoint at production attention dims, vLLM's own CPU MLA backends against ours, in
the same run.

The vLLM side runs in subprocesses of the vLLM environment's python (``--vllm-python``, or
``$APP_BENCH_VLLM_PYTHON``; ``.ci/vllm_env.sh`` builds one, with this package installed). It
writes a random checkpoint there (:mod:`app.testing.deepseek_checkpoint`, the Hub's DeepSeek-V2
layout: 16 heads, ``kv_lora_rank`` 512, rope 64, nope 128, v 128, hidden 2048, yarn rope; a dense
MLP of ``--mlp-size`` and a vocabulary of ``--vocab-size``, the layers both sides share), then
starts engines alternately, round by round: ``VLLM_PLUGINS=none`` (vLLM's ``CPU_SDPA_MLA``
prefill and ``CPU_MLA`` decode) and with our plugin (our TORCH_SDPA prefill and CPU_MLA decode),
each an in-process engine in its own process (``app.bench.vllm.engine_worker``).

Workloads (greedy, token-id prompts, contexts of 1-4k):

- **prefill-heavy**: prompts of 1024, 2048, 3072 and 4096 tokens, one output token each;
  tokens/s = prompt tokens / seconds.
- **decode-heavy**: 8 requests with contexts of 1024-4000 tokens, ``--decode-tokens`` output
  tokens each. The decode phase is timed inside the run: the worker steps vLLM's engine itself
  and timestamps each step (``engine_worker``'s ``timeline``), and the decode phase's
  tokens/s = the tokens generated after every request had its first token / the seconds after
  that moment (so our faster prefill does not inflate it). It was the difference between this
  run and a run of the same requests with one output token, which came out null on an AMX
  machine where the one-token run took longer than the whole one. The whole requests'
  tokens/s is reported beside it.

On a CPU with AMX tiles vLLM's own side runs its ``AMX_MLA`` (what it selects there), and ours
runs with ``APP_VLLM_AMX=ours``, so the comparison is ours against AMX_MLA whatever the model's
dtype (the plugin would otherwise leave bf16 models to AMX_MLA until this is measured: see
:mod:`app.integrations._vllm_amx`); each side's ``impl_classes`` say what ran.

Each engine times every workload ``--repeat`` times (default once: vLLM's own prefill of 1-4k
contexts takes minutes per engine on 2 cores) after a warm-up; a side's figure is its best over
all rounds (default 2). ``speedup`` is ours over vLLM's; targets (issue 24): prefill-heavy >= 3x,
decode-heavy >= 1.5x. A missed target does not fail the command; ``ok`` is False only when an
engine could not run. ``--quick`` shrinks everything (for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from app.bench._load import load_text
from app.bench.vllm.prefill import VLLM_PYTHON_ENV, _cpu_name, _load
from app.commands._args import int_in, positive_float, positive_int

HELP = ("a whole vLLM engine (CPU build): its own CPU MLA backends vs ours, prefill- and "
        "decode-heavy tokens/s (--vllm-python)")

TARGETS = {"prefill-heavy": 3.0, "decode-heavy": 1.5}
_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_SIDES = {"vllm": False, "ours": True}        # side -> our plugin loaded


def workloads(quick: bool, decode_tokens: int) -> dict[str, Any]:
    """Prompt lengths per workload (token ids made from them) and output tokens."""
    if quick:
        return {"prefill": [96, 160], "decode": [64, 128, 96], "decode_tokens": 4,
                "max_model_len": 256}
    return {"prefill": [1024, 2048, 3072, 4096],
            "decode": [1024, 1536, 2048, 2560, 3072, 3584, 4000, 1024],
            "decode_tokens": decode_tokens, "max_model_len": 4096 + decode_tokens + 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python``, model size, ``--dtype``, ``--rounds``, ``--repeat``, ``--quick``."""
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                        help=f"python of an environment with vLLM's CPU build and this package "
                             f"(default ${VLLM_PYTHON_ENV})")
    parser.add_argument("--layers", type=int_in(1, 64), default=4,
                        help="decoder layers (default 4)")
    parser.add_argument("--heads", type=int_in(1, 128), default=16,
                        help="attention heads (default 16)")
    parser.add_argument("--hidden-size", type=int_in(64, 16384), default=2048,
                        help="hidden size (default 2048, DeepSeek-V2-Lite's)")
    parser.add_argument("--mlp-size", type=int_in(16, 65536), default=1408,
                        help="dense MLP intermediate size (default 1408)")
    parser.add_argument("--vocab-size", type=int_in(16, 262144), default=4096,
                        help="vocabulary size (default 4096)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                        help="model dtype (default bf16)")
    parser.add_argument("--decode-tokens", type=int_in(2, 1024), default=64,
                        help="output tokens per decode-heavy request (default 64)")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="engine pairs started, alternately (default 2, 1 with --quick)")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="timed runs per workload per engine (default 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and contexts")
    parser.add_argument("--vllm-timeout", type=positive_float, default=3600.0,
                        help="seconds one engine process may take (default 3600)")


def _prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 2) + 2 for j in range(n)]
            for i, n in enumerate(lengths)]


def _jobs(load: dict[str, Any], vocab: int, repeat: int) -> list[dict[str, Any]]:
    decode = _prompts(load["decode"], vocab)
    return [
        {"name": "prefill-heavy", "prompts": _prompts(load["prefill"], vocab), "max_tokens": 1,
         "repeat": repeat, "warmup": True},
        {"name": "decode-heavy", "prompts": decode, "max_tokens": load["decode_tokens"],
         "repeat": repeat, "timeline": True}]


def vllm_worker_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a vLLM worker subprocess: ours, minus ``VLLM_PLUGINS``, with vLLM's
    CPU settings (in-process engine, KV cache size, quieter logs), this checkout on
    ``PYTHONPATH``, then ``extra``."""
    root = str(Path(__file__).resolve().parents[3])   # the tree holding app/
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING",
                "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                              if p)})
    env.update(extra)
    return env


def _call(python: str, argv: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run ``python argv``; None when it succeeded, else why not."""
    try:
        proc = subprocess.run([python, *argv], capture_output=True, text=True, env=env,
                              timeout=timeout, check=False)
    except FileNotFoundError:
        return f"--vllm-python {python!r} does not exist"
    except subprocess.TimeoutExpired:
        return f"the vLLM side took longer than {timeout:.0f} s"
    if proc.returncode:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return f"the vLLM side exited with {proc.returncode}: {tail}"
    return None


def _write_checkpoint(python: str, path: Path, spec: dict[str, Any], timeout: float
                      ) -> str | None:
    code = ("import json, sys\nfrom app.testing.deepseek_checkpoint import "
            "DeepseekCheckpointSpec, write_deepseek_checkpoint\n"
            "write_deepseek_checkpoint(sys.argv[1], DeepseekCheckpointSpec(**json.loads("
            "sys.argv[2])))")
    return _call(python, ["-c", code, str(path), json.dumps(spec)], vllm_worker_env({}), timeout)


def _engine_run(python: str, work: Path, name: str, engine: dict[str, Any], plugin: bool,
                timeout: float) -> dict[str, Any]:
    spec_file, out_file = work / f"{name}.json", work / f"{name}.out.json"
    spec_file.write_text(json.dumps({"engines": [engine]}))
    env = vllm_worker_env({"APP_VLLM_AMX": "ours"} if plugin else {"VLLM_PLUGINS": "none"})
    error = _call(python, ["-m", "app.bench.vllm.engine_worker", str(spec_file),
                           str(out_file)], env, timeout)
    if error is not None:
        return {"error": error}
    result: dict[str, Any] = json.loads(out_file.read_text())["engines"][0]
    return result


def _side_figures(runs: list[dict[str, Any]], load: dict[str, Any]) -> dict[str, Any]:
    """Best seconds per job over every run of one side, and the tokens/s made of them."""
    best: dict[str, float] = {}
    phases: list[tuple[float, int]] = []   # (decode-phase seconds, tokens) of every run
    for run in runs:
        for job in run["jobs"]:
            best[job["name"]] = min(best.get(job["name"], float("inf")), *job["seconds"])
            for total, first, tokens in zip(job["seconds"], job.get("first_token_seconds", []),
                                            job.get("decode_tokens", []), strict=False):
                if first is not None and tokens and total > first:
                    phases.append((total - first, tokens))
    requests = len(load["decode"])
    rate = max((tokens / seconds for seconds, tokens in phases), default=None)
    return {
        "best_seconds": {k: round(v, 4) for k, v in best.items()},
        "prefill_heavy_tokens_per_s": round(sum(load["prefill"]) / best["prefill-heavy"], 1),
        "decode_heavy_tokens_per_s": None if rate is None else round(rate, 2),
        "decode_phase_runs": [{"seconds": round(seconds, 4), "tokens": tokens}
                              for seconds, tokens in phases],
        "decode_heavy_whole_tokens_per_s": round(requests * load["decode_tokens"]
                                                 / best["decode-heavy"], 2),
        "seconds_per_engine": [{job["name"]: [round(x, 4) for x in job["seconds"]]
                                for job in run["jobs"]} for run in runs],
        "init_s": [r["init_s"] for r in runs],
        "impl_classes": runs[-1].get("impl_classes"),
        "prefill_classes": runs[-1].get("prefill_classes")}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 2) if ours and theirs else None


def _measure(args: argparse.Namespace, work: Path, load: dict[str, Any], rounds: int,
             repeat: int) -> dict[str, Any]:
    model = work / "checkpoint"
    spec = {"family": "v2", "layout": "hub", "num_layers": args.layers,
            "num_heads": args.heads, "hidden_size": args.hidden_size,
            "intermediate_size": args.mlp_size, "vocab_size": args.vocab_size, "moe": False}
    if args.quick:
        spec.update(num_layers=2, hidden_size=256, intermediate_size=256, vocab_size=1024)
    error = _write_checkpoint(str(args.vllm_python), model, spec, args.vllm_timeout)
    if error is not None:
        return {"error": error, "checkpoint": spec}
    engine = {"label": "", "model": str(model), "dtype": _DTYPES[args.dtype],
              "max_model_len": load["max_model_len"], "max_num_seqs": len(load["decode"]),
              "jobs": _jobs(load, spec["vocab_size"], repeat)}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in _SIDES}
    for index in range(rounds):
        for side, plugin in _SIDES.items():
            run = _engine_run(str(args.vllm_python), work, f"{side}-{index}",
                              {**engine, "label": side}, plugin, args.vllm_timeout)
            if "error" in run:
                return {"error": f"{side} engine, round {index + 1}: {run['error']}",
                        "checkpoint": spec}
            runs[side].append(run)
    return {"checkpoint": spec, "sides": {side: _side_figures(r, load)
                                          for side, r in runs.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result (``ValueError`` on bad arguments)."""
    if not args.vllm_python:
        raise ValueError(f"bench vllm-engine needs --vllm-python PATH (or ${VLLM_PYTHON_ENV}): "
                         f"the python of an environment with vLLM's CPU build")
    rounds = args.rounds or (1 if args.quick else 2)
    repeat = args.repeat or 1
    load = workloads(args.quick, args.decode_tokens)
    started, load_before = time.perf_counter(), _load()
    with tempfile.TemporaryDirectory(prefix="app-bench-vllm-engine-") as tmp:
        measured = _measure(args, Path(tmp), load, rounds, repeat)
    result: dict[str, Any] = {
        "benchmark": "vllm-engine", "cpu": _cpu_name(), "cores": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": _load(),
        "vllm_python": str(args.vllm_python), "dtype": _DTYPES[args.dtype],
        "quick": bool(args.quick), "rounds": rounds, "repeat": repeat,
        "workloads": load, **measured, "targets": [], "ok": "error" not in measured,
        "elapsed_s": round(time.perf_counter() - started, 1)}
    sides = measured.get("sides")
    if sides:
        for name, key in (("prefill-heavy", "prefill_heavy_tokens_per_s"),
                          ("decode-heavy", "decode_heavy_tokens_per_s")):
            value = _ratio(sides["ours"][key], sides["vllm"][key])
            result["targets"].append({"name": f"{name} tokens/s, ours over vLLM's own",
                                      "value": value, "target": TARGETS[name],
                                      "pass": value is not None and value >= TARGETS[name]})
        result["decode_heavy_whole_speedup"] = _ratio(
            sides["ours"]["decode_heavy_whole_tokens_per_s"],
            sides["vllm"]["decode_heavy_whole_tokens_per_s"])
        result["targets_met"] = all(t["pass"] for t in result["targets"])
    return result


def render(result: dict[str, Any]) -> str:
    """A readable summary: both sides' tokens/s and the ratios against the targets."""
    if "error" in result:
        return f"vLLM engine bench failed: {result['error']}"
    spec, sides = result["checkpoint"], result["sides"]
    load = load_text(result["load_average_before"], result["load_average_after"],
                     result["cores"])
    lines = [f"vLLM engine on {result['cpu']} ({load}), "
             f"{result['dtype']}, {spec['num_layers']} layers, {spec['num_heads']} heads, "
             f"hidden {spec['hidden_size']}, best of {result['rounds']} x {result['repeat']}",
             f"{'side':6s} {'prefill-heavy tok/s':>20s} {'decode-heavy tok/s':>19s} "
             f"{'(whole requests)':>17s}"]
    for side, s in sides.items():
        lines.append(f"{side:6s} {s['prefill_heavy_tokens_per_s']:20.1f} "
                     f"{s['decode_heavy_tokens_per_s'] or 0:19.2f} "
                     f"{s['decode_heavy_whole_tokens_per_s']:17.2f}")
    for t in result["targets"]:
        lines.append(f"target: {t['name']}: {t['value']}x vs >= {t['target']}x: "
                     f"{'pass' if t['pass'] else 'MISS'}")
    return "\n".join(lines)
