"""Whole vLLM engines driven from a JSON spec, inside the vLLM environment (a subprocess).

``python -m app.bench.vllm.engine_worker SPEC.json OUT.json``: for each engine of the spec, in
order, in this one process (vLLM is imported once; each engine is built, used and dropped), it
builds ``vllm.LLM(model=..., skip_tokenizer_init=True, enforce_eager=True, seed=0, ...)``, runs
the engine's jobs (prompts as token ids, greedy) and writes what came out. Which backends vLLM
uses is the process's affair: ``VLLM_PLUGINS=none`` keeps vLLM's own, anything else loads our
general plugin; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in this process.

Spec: ``{"fake_amx": bool, "engines": [{"label", "model", "dtype", "max_model_len",
"max_num_seqs", "tensor_parallel_size", "attention_backend", "jobs": [{"name", "prompts":
[[token ids]], "max_tokens", "prompt_logprobs": bool, "logprobs": bool, "repeat": int,
"warmup": bool, "timeline": bool}]}]}``. Out: ``{"vllm_version", "pid", "torch_threads",
"engines": [{"label", "init_s", "registered_here", "impl_classes", "prefill_classes", "jobs":
[{"name", "tokens", "prompt_logprobs", "logprobs", "seconds", "prompt_tokens",
"generated_tokens", "first_token_seconds", "decode_tokens"}]} or {"label", "error"}]}``.

``timeline``: the job's requests are added to vLLM's engine and it is stepped here
(``llm.llm_engine.step()``, the loop ``LLM.generate`` runs, with cumulative outputs), each step
timestamped, so one run says when every request had its first token
(``first_token_seconds``, per repeat) and how many tokens came after (``decode_tokens``): the
decode phase measured inside the run, never as the difference of two runs.
``fake_amx`` makes torch report AMX tiles (vLLM's check) before vLLM is imported, in this
process only (an in-process engine), to test what vLLM and our plugin do on an AMX CPU.

``python -m app.bench.vllm.engine_worker --serve``: one engine kept for a caller that sends
work as it goes (``bench model --baseline vllm``). The first line on stdin is the engine
(the keys above, and ``enable_prefix_caching``); the answer is one line ``{"ready": true,
"init_s", "vllm_version", "torch_threads", "registered_here", "peak_rss_bytes"}`` (or
``{"error", "traceback"}``). Then each line on stdin is a job; each answer one line, the job's
result with ``peak_rss_bytes`` (this process's peak resident set so far: the in-process
engine's). End of stdin ends the process. Only these lines go to stdout (vLLM's own output is
sent to stderr).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "run_spec"]


def _prompt_logprobs(result: Any, prompt: list[int]) -> list[float]:
    """The logprob of each prompt token given the ones before it (the first has none)."""
    rows = result.prompt_logprobs or []
    return [float(row[token].logprob) for row, token in zip(rows, prompt, strict=False)
            if row is not None]


def _run_job(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(p)} for p in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(job.get("max_tokens", 16)),
                            ignore_eos=True, detokenize=False,
                            prompt_logprobs=0 if job.get("prompt_logprobs") else None,
                            logprobs=0 if job.get("logprobs") else None)
    if job.get("warmup"):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2,
                                                 ignore_eos=True, detokenize=False),
                     use_tqdm=False)
    seconds: list[float] = []
    results: list[Any] = []
    first: list[float | None] = []
    decode: list[int] = []
    for _ in range(int(job.get("repeat", 1))):
        start = time.perf_counter()
        if job.get("timeline"):
            results, first_s, after = _stepped(llm, prompts, params)
            first.append(first_s)
            decode.append(after)
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    out: dict[str, Any] = {
        "name": job.get("name", ""), "seconds": seconds,
        **({"first_token_seconds": first, "decode_tokens": decode} if first else {}),
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "prompt_tokens": sum(len(p) for p in job["prompts"]),
        "generated_tokens": sum(len(r.outputs[0].token_ids) for r in results)}
    if job.get("prompt_logprobs"):
        out["prompt_logprobs"] = [_prompt_logprobs(r, p)
                                  for r, p in zip(results, job["prompts"], strict=True)]
    if job.get("logprobs"):
        out["logprobs"] = [[float(step[t].logprob) for step, t in
                            zip(r.outputs[0].logprobs or [], r.outputs[0].token_ids,
                                strict=False)] for r in results]
    return out


def _stepped(llm: Any, prompts: list[dict[str, Any]], params: Any
             ) -> tuple[list[Any], float | None, int]:
    """Run the requests by stepping vLLM's engine here (what ``LLM.generate`` does, with
    cumulative outputs, each step timestamped): the final outputs in prompt order, the seconds
    until every request had its first token (None if one never did) and the tokens after."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    base = f"app-timeline-{os.getpid()}-{time.monotonic_ns()}"
    ids = [f"{base}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    # vLLM may add a suffix to the id it keeps internally: outputs carry either form
    known = {engine.add_request(i, prompt, params): i for i, prompt in zip(ids, prompts,
                                                                           strict=True)}
    known.update({i: i for i in ids})
    counts, finals = dict.fromkeys(ids, 0), {}
    first, at_first = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            request = known.get(output.request_id)
            if request is not None:
                counts[request] = len(output.outputs[0].token_ids)
                if output.finished:
                    finals[request] = output
        if first is None and all(counts.values()):
            first, at_first = time.perf_counter() - start, sum(counts.values())
    return [finals[i] for i in ids], first, sum(counts.values()) - at_first


def _classes_in_use() -> tuple[list[str], list[str]]:
    """The MLA impl and prefill backend classes alive in this process (in-process engines)."""
    impls, prefills = set(), set()
    frozen = gc.get_freeze_count()
    gc.unfreeze()          # vLLM freezes its start-up objects (gc.freeze), out of get_objects
    objects = gc.get_objects()
    if frozen:
        gc.freeze()
    for obj in objects:
        cls = type(obj)
        names = {c.__name__ for c in cls.__mro__}
        if "MLACommonBaseImpl" in names:
            impls.add(f"{cls.__module__}.{cls.__qualname__}")
        elif "MLAPrefillBackend" in names and cls.__module__.startswith(("vllm", "app.int")):
            prefills.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(impls), sorted(prefills)


def _registered() -> dict[str, str]:
    """The classes vLLM's registries name in this process (the front-end of a multiprocess
    engine loads general plugins too)."""
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return {"prefill_CPU": MLAPrefillBackendEnum.CPU.get_path(),
            "CPU_MLA": AttentionBackendEnum.CPU_MLA.get_path()}


def _build(engine: dict[str, Any]) -> tuple[Any, float]:
    """The engine's ``vllm.LLM`` and the seconds it took to build."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": engine["model"], "skip_tokenizer_init": True, "enforce_eager": True,
        "seed": 0, "dtype": engine.get("dtype", "float32"),
        "max_model_len": int(engine.get("max_model_len", 512)),
        "max_num_seqs": int(engine.get("max_num_seqs", 8)),
        "tensor_parallel_size": int(engine.get("tensor_parallel_size", 1))}
    if engine.get("attention_backend"):
        kwargs["attention_backend"] = engine["attention_backend"]
    if engine.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(engine["max_num_batched_tokens"])
    if "enable_prefix_caching" in engine:
        kwargs["enable_prefix_caching"] = bool(engine["enable_prefix_caching"])
    if engine.get("kv_cache_dtype"):     # an FP8 latent cache (issue 36)
        kwargs["kv_cache_dtype"] = str(engine["kv_cache_dtype"])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, round(time.perf_counter() - start, 2)


def _run_engine(engine: dict[str, Any]) -> dict[str, Any]:
    llm, init_s = _build(engine)
    result: dict[str, Any] = {"label": engine.get("label", ""), "init_s": init_s}
    result["registered_here"] = _registered()
    result["jobs"] = [_run_job(llm, job) for job in engine.get("jobs", [])]
    result["impl_classes"], result["prefill_classes"] = _classes_in_use()
    del llm
    gc.collect()
    return result


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run every engine of ``spec`` (see the module docstring); an engine that fails is
    reported with its error and the next one still runs."""
    if spec.get("fake_amx"):
        import torch

        torch.cpu._is_amx_tile_supported = lambda: True
    import torch
    import vllm

    out: dict[str, Any] = {"vllm_version": vllm.__version__, "pid": os.getpid(),
                           "torch_threads": torch.get_num_threads(), "engines": []}
    for engine in spec.get("engines", []):
        try:
            out["engines"].append(_run_engine(engine))
        except Exception as exc:  # reported to the caller, which decides
            out["engines"].append({"label": engine.get("label", ""),
                                   "error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()[-4000:]})
            gc.collect()
    return out


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def serve(requests: Any, answers: Any) -> int:
    """``--serve``: the engine from the first line of ``requests``, then one answer line on
    ``answers`` per job line (see the module docstring)."""
    def answer(payload: dict[str, Any]) -> None:
        answers.write(json.dumps(payload) + "\n")
        answers.flush()

    line = requests.readline()
    try:
        import torch

        llm, init_s = _build(json.loads(line))
        answer({"ready": True, "init_s": init_s, "vllm_version": _vllm_version(),
                "torch_threads": torch.get_num_threads(), "registered_here": _registered(),
                "peak_rss_bytes": _peak_rss_bytes()})
    except Exception as exc:  # reported to the caller, which decides
        answer({"error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:]})
        return 1
    for line in requests:
        if not line.strip():
            continue
        try:
            result = _run_job(llm, json.loads(line))
        except Exception as exc:
            answer({"error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:]})
            continue
        answer({**result, "peak_rss_bytes": _peak_rss_bytes()})
    return 0


def main(argv: list[str] | None = None) -> int:
    """``SPEC.json OUT.json``: run the spec, write the result; 0 unless the spec is unusable.
    ``--serve``: the line protocol of the module docstring."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--serve"]:
        # Our answers keep the real stdout; everything else printed here goes to stderr.
        answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        return serve(sys.stdin, answers)
    if len(args) != 2:
        sys.stderr.write("usage: python -m app.bench.vllm.engine_worker SPEC.json OUT.json\n")
        return 2
    spec = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(json.dumps(run_spec(spec)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
