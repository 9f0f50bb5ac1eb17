"""What an engine embeds: MLA prefill and absorbed decode over a paged latent cache, a
scheduler, and a generating engine loop.

- ``layer``: a DeepSeek-form MLA layer (weights from a seed) and a seeded token embedding;
- ``reference``: the dense float64 reference of the same layer on a whole sequence;
- ``cache``: the paged latent cache (``[num_blocks, block_size, kv_lora_rank + rope]``);
- ``executor``: one chunked-prefill step: new tokens causal through the selected backend, the
  cached context gathered in chunks, up-projected, attended and merged by LSE, then ``W_o``;
- ``decode``: one decode step in the absorbed form through the selected decode backend;
- ``model``: embedding, ``N`` stacked layers sharing one block table, tied LM head, greedy;
- ``scheduler``: vLLM-v1-style continuous batching (decode first, then chunked prefill under
  one token budget, prefix caching, preemption of the newest request, recompute);
- ``speculative``: the prompt-lookup (n-gram) drafter and greedy verification;
- ``requests``: ``Request`` (prompt, ``max_new_tokens``, stop tokens) and ``RequestOutput``;
- ``engine``: ``MLAEngine``: ``add_request`` / ``step`` / ``abort``; everything resolved through
  the container once at start-up;
- ``workload``: synthetic requests with shared prefixes; ``profiling``: per-phase timing;
  ``process``: allocator tuning for the command-line jobs.

``python -m app run`` is the main job built on this package.
"""

from app.mla.cache import PagedLatentCache, slot_indices
from app.mla.decode import DecodePlan, MLADecodeExecutor, plan_decode_step
from app.mla.engine import (
    DEFAULT_VOCAB_SIZE,
    EngineStats,
    MLAEngine,
    RequestTooLargeError,
    StepOutput,
)
from app.mla.executor import MLAPrefillExecutor, PrefillSlice, StepPlan, plan_context_chunks
from app.mla.layer import (
    MLALayer,
    MLALayerWeights,
    RotaryEmbedding,
    TokenEmbedding,
    apply_rope,
    default_compute_dtype,
    rms_norm,
)
from app.mla.model import MLAModel, layer_names
from app.mla.process import tune_malloc_for_large_tensors
from app.mla.profiling import NULL_TIMER, PHASES, PhaseTimer
from app.mla.reference import (
    REFERENCE_TOLERANCES,
    ReferenceCheck,
    check_against_reference,
    reference_forward,
    reference_tolerance,
)
from app.mla.requests import FinishReason, Request, RequestMetrics, RequestOutput, RowKind
from app.mla.scheduler import RequestState, RequestStatus, Scheduler, SchedulerOutput
from app.mla.speculative import NgramDrafter, NgramIndex, accept_greedy
from app.mla.workload import WorkloadRequest, make_workload

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "NULL_TIMER",
    "PHASES",
    "REFERENCE_TOLERANCES",
    "DecodePlan",
    "EngineStats",
    "FinishReason",
    "MLADecodeExecutor",
    "MLAEngine",
    "MLALayer",
    "MLALayerWeights",
    "MLAModel",
    "MLAPrefillExecutor",
    "NgramDrafter",
    "NgramIndex",
    "PagedLatentCache",
    "PhaseTimer",
    "PrefillSlice",
    "ReferenceCheck",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestState",
    "RequestStatus",
    "RequestTooLargeError",
    "RotaryEmbedding",
    "RowKind",
    "Scheduler",
    "SchedulerOutput",
    "StepOutput",
    "StepPlan",
    "TokenEmbedding",
    "WorkloadRequest",
    "accept_greedy",
    "apply_rope",
    "check_against_reference",
    "default_compute_dtype",
    "layer_names",
    "make_workload",
    "plan_context_chunks",
    "plan_decode_step",
    "reference_forward",
    "reference_tolerance",
    "rms_norm",
    "slot_indices",
    "tune_malloc_for_large_tensors",
]
