"""The DeepSeek-V2/V3 model the engine serves: one implementation of the architecture as the
Hugging Face checkpoints define it, run over the paged latent cache through the selected
prefill and decode backends.

- ``config``: ``DeepseekConfig`` from a checkpoint's ``config.json`` (both layouts);
- ``rope``: rope in the checkpoint's layout, yarn frequencies and magnitude correction;
- ``weights``: the tensors by name and shape (``weight_specs``), ``ModelWeights``;
- ``random``: random models made in memory (``random_config``, ``random_weights``);
- ``loader``: ``load_checkpoint`` with ``safetensors`` (shards, bf16/fp16/fp32, FP8 block
  dequantization, MTP layers skipped, peak RSS measured);
- ``linear``: matmul weights reordered once for oneDNN (``Linear``);
- ``attention``: the MLA layer's projections (q LoRA or not, latent, rope, absorption);
- ``moe``: the SwiGLU MLP and the mixture of experts (V2 softmax / V3 sigmoid routing);
- ``cache``, ``prefill``, ``decode``: the paged latent cache and the two executors;
- ``model``: ``DeepseekModel``, the whole model on the cache, greedy with float32 margins;
- ``reference``: the dense float64 reference of the same model;
- ``profiling``: per-phase timing.
"""

from app.model.attention import MLAAttention, rms_norm
from app.model.cache import PagedLatentCache, slot_indices
from app.model.config import (
    ARCHITECTURES,
    DeepseekConfig,
    Fp8Quantization,
    MoEConfig,
    RopeConfig,
)
from app.model.decode import DecodePlan, MLADecodeExecutor, plan_decode_step
from app.model.loader import (
    LoadedCheckpoint,
    LoadReport,
    check_checkpoint,
    dequantize_fp8_block,
    load_checkpoint,
    quantize_fp8_block,
    read_rss,
)
from app.model.model import (
    GREEDY_CANDIDATES,
    DeepseekModel,
    GreedyChoice,
    default_compute_dtype,
    layer_names,
)
from app.model.moe import MoE, Routing, SwiGLU, route
from app.model.prefill import (
    MLAPrefillExecutor,
    PrefillPlan,
    PrefillSlice,
    StepPlan,
    plan_context_chunks,
    plan_prefill_step,
)
from app.model.profiling import NULL_TIMER, PHASES, PhaseTimer
from app.model.random import random_config, random_weights
from app.model.reference import (
    REFERENCE_CACHE_BYTES,
    REFERENCE_TOLERANCES,
    ROUTING_TOLERANCES,
    ReferenceModel,
    ReferenceRows,
    reference_attention,
    reference_tolerance,
    routing_margins,
)
from app.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from app.model.weights import (
    AttentionWeights,
    LayerWeights,
    MLPWeights,
    ModelWeights,
    MoEWeights,
    WeightSpec,
    weight_specs,
)

__all__ = [
    "ARCHITECTURES",
    "GREEDY_CANDIDATES",
    "NULL_TIMER",
    "PHASES",
    "REFERENCE_CACHE_BYTES",
    "REFERENCE_TOLERANCES",
    "ROUTING_TOLERANCES",
    "AttentionWeights",
    "DecodePlan",
    "DeepseekConfig",
    "DeepseekModel",
    "Fp8Quantization",
    "GreedyChoice",
    "LayerWeights",
    "LoadReport",
    "LoadedCheckpoint",
    "MLAAttention",
    "MLADecodeExecutor",
    "MLAPrefillExecutor",
    "MLPWeights",
    "MoE",
    "MoEConfig",
    "MoEWeights",
    "ModelWeights",
    "PagedLatentCache",
    "PhaseTimer",
    "PrefillPlan",
    "PrefillSlice",
    "ReferenceModel",
    "ReferenceRows",
    "RopeConfig",
    "RotaryEmbedding",
    "Routing",
    "StepPlan",
    "SwiGLU",
    "WeightSpec",
    "apply_rope",
    "check_checkpoint",
    "default_compute_dtype",
    "dequantize_fp8_block",
    "layer_names",
    "load_checkpoint",
    "plan_context_chunks",
    "plan_decode_step",
    "plan_prefill_step",
    "quantize_fp8_block",
    "random_config",
    "random_weights",
    "read_rss",
    "reference_attention",
    "reference_tolerance",
    "rms_norm",
    "rope_inv_freq",
    "route",
    "routing_margins",
    "slot_indices",
    "weight_specs",
]
