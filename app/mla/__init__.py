"""The MLA prefill executor an engine embeds, and a minimal engine loop around it.

- ``layer``: a DeepSeek-form MLA layer (weights from a seed) and a seeded token embedding;
- ``reference``: the dense float64 reference of the same layer on a whole sequence;
- ``cache``: the paged latent cache (``[num_blocks, block_size, kv_lora_rank + rope]``);
- ``executor``: one chunked-prefill step: new tokens causal through the selected backend, the
  cached context gathered in chunks, up-projected, attended and merged by LSE, then ``W_o``;
- ``engine``: a queue, a token budget per step, ``KVCacheManager`` allocation with prefix
  sharing, freeing finished requests; everything resolved through the container at start-up;
- ``workload``: synthetic requests with shared prefixes; ``profiling``: per-phase timing;
  ``process``: allocator tuning for the command-line jobs.

``python -m app run`` is the main job built on this package.
"""

from app.mla.cache import PagedLatentCache, slot_indices
from app.mla.engine import (
    LAYER_NAME,
    EngineStats,
    MLAPrefillEngine,
    RequestOutput,
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
from app.mla.process import tune_malloc_for_large_tensors
from app.mla.profiling import NULL_TIMER, PHASES, PhaseTimer
from app.mla.reference import (
    REFERENCE_TOLERANCES,
    ReferenceCheck,
    check_against_reference,
    reference_forward,
    reference_tolerance,
)
from app.mla.workload import WorkloadRequest, make_workload

__all__ = [
    "LAYER_NAME",
    "NULL_TIMER",
    "PHASES",
    "REFERENCE_TOLERANCES",
    "EngineStats",
    "MLALayer",
    "MLALayerWeights",
    "MLAPrefillEngine",
    "MLAPrefillExecutor",
    "PagedLatentCache",
    "PhaseTimer",
    "PrefillSlice",
    "ReferenceCheck",
    "RequestOutput",
    "RequestTooLargeError",
    "RotaryEmbedding",
    "StepOutput",
    "StepPlan",
    "TokenEmbedding",
    "WorkloadRequest",
    "apply_rope",
    "check_against_reference",
    "default_compute_dtype",
    "make_workload",
    "plan_context_chunks",
    "reference_forward",
    "reference_tolerance",
    "rms_norm",
    "slot_indices",
    "tune_malloc_for_large_tensors",
]
