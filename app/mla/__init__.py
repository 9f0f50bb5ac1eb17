"""The engine loop an engine embeds: a scheduler and a generating engine over the DeepSeek
model of ``app.model`` (which holds the layers, the paged latent cache and the executors).

- ``scheduler``: vLLM-v1-style continuous batching (decode first, then chunked prefill under
  one token budget, prefix caching, preemption of the newest request, recompute);
- ``speculative``: the prompt-lookup (n-gram) drafter and greedy verification;
- ``requests``: ``Request`` (prompt, ``max_new_tokens``, stop tokens) and ``RequestOutput``;
- ``engine``: ``MLAEngine``: ``add_request`` / ``step`` / ``abort``; everything built from its
  container once at start-up;
- ``nonfinite``: what a (speculative) decode step may emit when some of its rows are not
  finite, whichever decode backend computed them;
- ``checks``: teacher-forced checks of finished requests against the float64 model;
- ``workload``: synthetic requests with shared prefixes; ``process``: allocator tuning for the
  command-line jobs.

``python -m app run`` and ``python -m app generate`` are built on this package.
"""

from app.mla.checks import GenerationCheck, check_generation, check_generations, sample_rows
from app.mla.engine import EngineStats, MLAEngine, RequestTooLargeError, StepOutput
from app.mla.process import tune_malloc_for_large_tensors
from app.mla.requests import FinishReason, Request, RequestMetrics, RequestOutput, RowKind
from app.mla.scheduler import RequestState, RequestStatus, Scheduler, SchedulerOutput
from app.mla.speculative import NgramDrafter, NgramIndex, accept_greedy
from app.mla.workload import WorkloadRequest, make_workload

__all__ = [
    "EngineStats",
    "FinishReason",
    "GenerationCheck",
    "MLAEngine",
    "NgramDrafter",
    "NgramIndex",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestState",
    "RequestStatus",
    "RequestTooLargeError",
    "RowKind",
    "Scheduler",
    "SchedulerOutput",
    "StepOutput",
    "WorkloadRequest",
    "accept_greedy",
    "check_generation",
    "check_generations",
    "make_workload",
    "sample_rows",
    "tune_malloc_for_large_tensors",
]
