"""The DeepSeek-V2/V3 model the engine serves (and its sparse variants, DeepSeek-V3.2 and
GLM-5): one implementation of the architecture as the Hugging Face checkpoints define it, run
over the paged latent cache through the selected prefill and decode backends.

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
- ``profiling``: per-phase timing;
- ``sparse``: DeepSeek Sparse Attention: the lightning indexer's config, tensors and
  projections, the sparse layer's executor and plans, its key cache's KV-cache spec
  (``IndexerKeyCacheSpec``), its float64 reference.
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
    SELECTION_TOLERANCES,
    ReferenceModel,
    ReferenceRows,
    reference_attention,
    reference_tolerance,
    routing_margins,
)
from app.model.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from app.model.sparse.config import IndexerConfig
from app.model.sparse.executors import (
    SparseDecodePlan,
    SparseMLAExecutor,
    SparsePrefillPlan,
    plan_sparse_decode,
    plan_sparse_prefill,
)
from app.model.sparse.kv_spec import (
    IndexerKeyCacheSpec,
    model_kv_cache_specs,
    register_indexer_key_cache_spec,
    sparse_kv_cache_specs,
)
from app.model.sparse.layer import LayerIndexer
from app.model.sparse.weights import IndexerWeights
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
    "SELECTION_TOLERANCES",
    "AttentionWeights",
    "DecodePlan",
    "DeepseekConfig",
    "DeepseekModel",
    "Fp8Quantization",
    "GreedyChoice",
    "IndexerConfig",
    "IndexerKeyCacheSpec",
    "IndexerWeights",
    "LayerIndexer",
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
    "SparseDecodePlan",
    "SparseMLAExecutor",
    "SparsePrefillPlan",
    "StepPlan",
    "SwiGLU",
    "WeightSpec",
    "apply_rope",
    "check_checkpoint",
    "default_compute_dtype",
    "dequantize_fp8_block",
    "layer_names",
    "load_checkpoint",
    "model_kv_cache_specs",
    "plan_context_chunks",
    "plan_decode_step",
    "plan_prefill_step",
    "plan_sparse_decode",
    "plan_sparse_prefill",
    "quantize_fp8_block",
    "random_config",
    "random_weights",
    "read_rss",
    "reference_attention",
    "reference_tolerance",
    "register_indexer_key_cache_spec",
    "rms_norm",
    "rope_inv_freq",
    "route",
    "routing_margins",
    "slot_indices",
    "sparse_kv_cache_specs",
    "weight_specs",
]
