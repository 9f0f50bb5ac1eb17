"""The whole vLLM CPU engine as ``bench model``'s baseline (``--baseline vllm``).

One vLLM engine, built once in a subprocess of ``--vllm-python`` (or ``$APP_BENCH_VLLM_PYTHON``)
with its own backends (``VLLM_PLUGINS=none``: ``CPU_SDPA_MLA`` prefill, ``CPU_MLA`` decode,
vLLM's CPU MoE and linears) and kept for the whole run: ``app.bench.vllm.engine_worker
--serve`` (an in-process engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) reads one job per call
and answers with the seconds the job took, so vLLM's start-up is never timed, as our engine's
construction is not; the job steps vLLM's engine itself (``timeline``), so the answer also
says when every request had its first token and how many tokens came after (the decode
phase, measured inside the run). Prefix caching is off (every repetition computes
everything, as ours does), the step budget holds the largest batch's prompts in one step (as
ours: ``max(8192, batch * prompt_len)`` tokens), ``max_num_seqs`` is the largest batch.

The worker's peak RSS (the whole vLLM process: its imports, weights, KV cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB, activations) comes back with every answer.
"""

from __future__ import annotations

import argparse
import json
import select
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

from app.bench._timing import RunTiming
from app.bench.vllm.engine import vllm_worker_env
from app.config import dtype_name

__all__ = ["VLLM_KV_CACHE_GIB", "WholeVLLM", "check_vllm_python"]

#: ``VLLM_CPU_KVCACHE_SPACE`` of the baseline engine, GiB (vLLM preallocates it).
VLLM_KV_CACHE_GIB = 1


def check_vllm_python(python: str | None) -> str:
    """``python``, or ``ValueError`` when it is unset or no file."""
    if not python:
        raise ValueError("bench model --baseline vllm needs --vllm-python PATH (or "
                         "$APP_BENCH_VLLM_PYTHON): the python of an environment with "
                         "vLLM's CPU build")
    if not Path(python).is_file():
        raise ValueError(f"--vllm-python {python!r}: no such file (the python of an "
                         f"environment with vLLM's CPU build)")
    return python


class WholeVLLM:
    """``runner(prompts, new_tokens) -> seconds`` over one vLLM engine in a subprocess.

    ``options`` are ``bench model``'s arguments (``vllm_python``, ``prompt_len``,
    ``new_tokens``, ``batch``, ``vllm_timeout``). ``ValueError`` without a vLLM python;
    ``RuntimeError`` (with the worker's last output) when the engine cannot start or a job
    fails. ``close()`` ends the subprocess.
    """

    def __init__(self, directory: Path, dtype: torch.dtype,
                 options: argparse.Namespace) -> None:
        python = check_vllm_python(getattr(options, "vllm_python", None))
        self.timeout = float(getattr(options, "vllm_timeout", 1800.0))
        longest = options.prompt_len + options.new_tokens + 16
        self.engine = {"label": "vllm", "model": str(directory), "dtype": dtype_name(dtype),
                       "max_model_len": longest, "max_num_seqs": max(options.batch, 1),
                       "max_num_batched_tokens": max(8192, options.batch * options.prompt_len,
                                                     longest),
                       "enable_prefix_caching": False}
        env = vllm_worker_env({"VLLM_PLUGINS": "none",
                           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)})
        # Held for the worker's lifetime (its log, read back on errors); closed in close().
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            [python, "-m", "app.bench.vllm.engine_worker", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            text=True, encoding="utf-8")
        self.peak_rss_bytes = 0
        self.info = self._ask(self.engine)
        if not self.info.get("ready"):
            self.close()
            raise RuntimeError(f"the vLLM engine did not start: {self.info.get('error')}\n"
                               f"{self.info.get('traceback', '')}")
        self.peak_rss_bytes = int(self.info.get("peak_rss_bytes", 0))

    def _tail(self) -> str:
        if self._stderr.closed:
            return ""
        self._stderr.seek(0, 2)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - 3000))
        return self._stderr.read().decode("utf-8", "replace")

    def _ask(self, payload: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self._proc.stdin, self._proc.stdout
        if stdin is None or stdout is None:  # pragma: no cover - both are pipes
            raise RuntimeError("the vLLM worker has no pipes")
        try:
            stdin.write(json.dumps(payload) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the vLLM worker exited ({self._proc.poll()}): "
                               f"{self._tail()}") from None
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                tail = self._tail()
                self.close()
                raise RuntimeError(f"the vLLM worker gave no answer in {self.timeout:.0f} s: "
                                   f"{tail}")
            ready, _, _ = select.select([stdout], [], [], min(left, 5.0))
            if ready:
                line = stdout.readline()
                if not line:
                    raise RuntimeError(f"the vLLM worker exited ({self._proc.wait()}): "
                                       f"{self._tail()}")
                answer: dict[str, Any] = json.loads(line)
                return answer
            if self._proc.poll() is not None:
                raise RuntimeError(f"the vLLM worker exited ({self._proc.returncode}): "
                                   f"{self._tail()}")

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> RunTiming:
        answer = self._ask({"name": f"{len(prompts)} x {new_tokens}", "prompts": prompts,
                            "max_tokens": new_tokens, "repeat": 1, "timeline": True})
        if "error" in answer:
            raise RuntimeError(f"vLLM job failed: {answer['error']}\n"
                               f"{answer.get('traceback', '')}")
        self.peak_rss_bytes = max(self.peak_rss_bytes, int(answer.get("peak_rss_bytes", 0)))
        if answer.get("generated_tokens") != len(prompts) * new_tokens:
            raise RuntimeError(f"vLLM generated {answer.get('generated_tokens')} tokens, "
                               f"expected {len(prompts) * new_tokens}")
        first, after = answer.get("first_token_seconds"), answer.get("decode_tokens")
        return RunTiming(float(answer["seconds"][0]),
                         None if not first or first[0] is None else float(first[0]),
                         None if not after else int(after[0]))

    def describe(self) -> dict[str, Any]:
        """What the baseline was: vLLM's version, threads, start-up seconds, peak RSS."""
        return {"engine": "whole vLLM (CPU build), its own backends (VLLM_PLUGINS=none)",
                "vllm_version": self.info.get("vllm_version"),
                "torch_threads": self.info.get("torch_threads"),
                "init_s": self.info.get("init_s"),
                "registered": self.info.get("registered_here"),
                "kv_cache_gib": VLLM_KV_CACHE_GIB, "engine_args": self.engine,
                "peak_rss_bytes": self.peak_rss_bytes}

    def close(self) -> None:
        """End the worker (closing its stdin ends it; killed if it lingers)."""
        if self._proc.poll() is None:
            try:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()
