"""The DeepSeek-V2/V3 architecture (and V3.2's and GLM-5's sparse variants) as a Hugging Face
``config.json`` describes it.

``DeepseekConfig.from_json_file(path)`` reads both layouts a checkpoint may carry: the Hub's
(``rope_theta`` plus ``rope_scaling``, as DeepSeek ships V2, V2-Lite and V3) and transformers
5's (``rope_parameters`` holding ``rope_theta`` and the scaling). Every problem is a
``ValueError`` naming the file and the key: a value of the wrong type (a list where a name
belongs, ``true`` where an int does), out of range (every int is at most ``MAX_CONFIG_INT``),
not finite, or one that would turn a part of the model off or make it divide by zero (yarn
with ``rope_theta`` <= 1, an ``attention_factor`` of 0). The file itself is read as
``app._files`` reads any file a user names: a regular file of at most 16 MiB, never a FIFO or
a device. Sizes are required; behaviour keys a config may omit take transformers' defaults for
the architecture (listed in ``_DEFAULTS``).

Semantics (the ones transformers' ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` and
DeepSeek's own code agree on):

- rope on the ``qk_rope_head_dim`` dims in adjacent pairs (``rope_interleave``, DeepSeek's
  layout; a config saying ``false`` gets the rotate-half layout), scaled by ``rope``;
- yarn: interpolated frequencies, ``attention_factor`` on cos/sin, and
  ``mscale(factor, mscale_all_dim) ** 2`` on the softmax scale (``softmax_scale``);
- a MoE layer where ``layer >= first_k_dense_replace`` and ``layer % moe_layer_freq == 0``
  (``moe`` set), a dense SwiGLU MLP elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from app._files import load_json
from app.config import ModelConfig
from app.model.sparse.config import (
    SPARSE_ARCHITECTURES,
    SPARSE_DEFAULTS,
    IndexerConfig,
    read_indexer,
)

__all__ = [
    "ARCHITECTURES",
    "MAX_CONFIG_INT",
    "DeepseekConfig",
    "Fp8Quantization",
    "MoEConfig",
    "RopeConfig",
    "parse_token_ids",
]

#: The architectures this package runs, and their ``model_type``.
ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    **SPARSE_ARCHITECTURES,
}

#: transformers' defaults for the keys a config may omit, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": {
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "rope_interleave": True, "first_k_dense_replace": 0,
        "moe_layer_freq": 1, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "n_group": None, "topk_group": None, "num_nextn_predict_layers": 0,
        "max_position_embeddings": 2048},
    "DeepseekV3ForCausalLM": {
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "rope_interleave": True, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 0,
        "max_position_embeddings": 4096},
    **SPARSE_DEFAULTS,
}
#: The largest int any key of a ``config.json`` may hold (sizes, counts, token ids).
MAX_CONFIG_INT = 2**31 - 1
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate", "partial_rotary_factor"}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _Reader:
    """Typed reads of one config dict; every error names the file and the key."""

    def __init__(self, raw: Mapping[str, Any], source: str, defaults: Mapping[str, Any]) -> None:
        self.raw = raw
        self.source = source
        self.defaults = defaults

    def error(self, key: str, expected: str) -> ValueError:
        value = self.raw[key] if key in self.raw else self.defaults.get(key, "<missing>")
        return ValueError(f"{self.source}: {key} = {_shown(value)}: expected {expected}")

    def get(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        if key in self.defaults:
            return self.defaults[key]
        raise ValueError(f"{self.source}: required key {key!r} is missing")

    def integer(self, key: str, minimum: int = 1) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not (
                minimum <= value <= MAX_CONFIG_INT):
            raise self.error(key, f"an int >= {minimum} (and at most {MAX_CONFIG_INT})")
        return value

    def opt_int(self, key: str, minimum: int = 1) -> int | None:
        return None if self.get(key) is None else self.integer(key, minimum)

    def number(self, key: str, positive: bool = True, minimum: float | None = None) -> float:
        """A finite number: > 0 when ``positive``, else >= ``minimum`` when given."""
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or (positive and value <= 0) \
                or (minimum is not None and value < minimum):
            raise self.error(key, "a positive finite number" if positive else
                             "a finite number" + ("" if minimum is None else f" >= {minimum}"))
        return float(value)

    def optional_number(self, key: str, positive: bool = True, minimum: float | None = None
                        ) -> float | None:
        """``number``, or None when the key is absent or null."""
        return None if self.raw.get(key) is None else self.number(key, positive, minimum)

    def boolean(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise self.error(key, "true or false")
        return value

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.get(key)
        if value not in allowed:
            raise self.error(key, f"one of {list(allowed)}")
        return str(value)


def _check_rope_number(name: str, value: object, positive: bool) -> None:
    """``ValueError`` unless ``value`` is None (the three optional keys) or a finite number,
    > 0 when ``positive``, else >= 0."""
    if value is None and name in ("attention_factor", "mscale", "mscale_all_dim"):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"RopeConfig: {name} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}, got {value!r}")


@attrs.frozen(kw_only=True)
class RopeConfig:
    """Rotary embedding: ``theta`` and a scaling (``rope_type`` ``default``, ``linear`` or
    ``yarn``, with yarn's ``factor``, ``original_max_position_embeddings``, ``beta_fast``,
    ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor`` and ``truncate``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __attrs_post_init__(self) -> None:
        # What from_dict refuses naming the file and the key, refused here too for a
        # RopeConfig built in code: each would divide by zero or bend the rope silently later.
        if self.rope_type not in ("default", "linear", "yarn"):
            raise ValueError(f"RopeConfig: rope_type must be 'default', 'linear' or 'yarn', got "
                             f"{self.rope_type!r}")
        for name in ("theta", "factor", "beta_fast", "beta_slow", "attention_factor"):
            _check_rope_number(name, getattr(self, name), positive=True)
        for name in ("mscale", "mscale_all_dim"):
            _check_rope_number(name, getattr(self, name), positive=False)
        if self.rope_type == "yarn" and self.theta <= 1:
            raise ValueError(f"RopeConfig: yarn needs theta > 1 (it divides by ln(theta)), got "
                             f"{self.theta!r}")

    @staticmethod
    def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
        """yarn's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        """What cos/sin are multiplied by: yarn's ``attention_factor`` (explicit, or
        ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
        ``mscale(factor)``); 1 for the other types."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(
                self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor)

    @property
    def softmax_scale_multiplier(self) -> float:
        """``mscale(factor, mscale_all_dim) ** 2`` for a scaled rope with ``mscale_all_dim``
        set (DeepSeek's yarn), else 1."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return self.yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, theta: float, max_positions: int,
                  source: str) -> RopeConfig:
        """From a ``rope_scaling`` / ``rope_parameters`` dict (None: plain rope)."""
        if raw is None:
            return cls(theta=theta)
        if not isinstance(raw, Mapping):
            raise ValueError(f"{source}: expected a dict or null, got {raw!r}")
        unknown = sorted(set(raw) - _ROPE_KEYS)
        if unknown:
            raise ValueError(f"{source}: unknown rope key(s) {unknown}; known: "
                             f"{sorted(_ROPE_KEYS)}")
        r = _Reader(raw, source, {"rope_theta": theta, "partial_rotary_factor": 1.0,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True})
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type not in ("default", "linear", "yarn"):
            raise ValueError(f"{source}: rope_type = {rope_type!r}: expected one of "
                             "['default', 'linear', 'yarn']")
        if r.number("partial_rotary_factor") != 1.0:
            raise r.error("partial_rotary_factor", "1.0 (DeepSeek ropes every rope dim)")
        theta = r.number("rope_theta")
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type == "yarn" and theta <= 1:
            raise r.error("rope_theta", "a number > 1 (yarn divides by ln(rope_theta))")
        original = r.opt_int("original_max_position_embeddings") \
            if "original_max_position_embeddings" in raw else None
        factor = raw.get("factor")
        if factor is None and rope_type == "yarn" and original:
            factor = max_positions / original
        # transformers reads a beta of null or 0 as its default (``get(...) or 32``); any other
        # value must be a positive finite number (a NaN or negative one failed at the first
        # step, or bent the frequencies silently).
        betas = {k: (raw.get(k) or r.defaults[k]) for k in ("beta_fast", "beta_slow")}
        r = _Reader({**raw, "factor": factor, **betas}, source, r.defaults)
        # mscale / mscale_all_dim of 0 mean "unset" (as in transformers); an attention factor
        # of 0 would multiply cos and sin by 0: rope silently off.
        return cls(theta=theta, rope_type=str(rope_type), factor=r.number("factor"),
                   original_max_position_embeddings=original or max_positions,
                   beta_fast=r.number("beta_fast"), beta_slow=r.number("beta_slow"),
                   truncate=r.boolean("truncate"),
                   mscale=r.optional_number("mscale", positive=False, minimum=0),
                   mscale_all_dim=r.optional_number("mscale_all_dim", positive=False, minimum=0),
                   attention_factor=r.optional_number("attention_factor"))


@attrs.frozen(kw_only=True)
class MoEConfig:
    """The routed experts of a MoE layer.

    ``scoring_func`` ``softmax`` (V2) with ``topk_method`` ``greedy`` or
    ``group_limited_greedy``, or ``sigmoid`` (V3) with ``noaux_tc`` (the
    ``e_score_correction_bias`` chooses, the plain scores weigh). ``n_group`` / ``topk_group``
    limit the choice to the best groups; ``norm_topk_prob`` normalises the chosen weights and
    ``routed_scaling_factor`` multiplies them; ``n_shared_experts`` always run.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @property
    def experts_per_group(self) -> int:
        """Routed experts in each group."""
        return self.n_routed_experts // self.n_group


@attrs.frozen(kw_only=True)
class Fp8Quantization:
    """FP8 e4m3 block-quantized weights (DeepSeek-V3's ``quantization_config``): each
    quantized ``W [out, in]`` comes with ``weight_scale_inv [ceil(out / bo), ceil(in / bi)]``
    float32, ``W = fp8 * scale_inv`` per ``(bo, bi)`` block."""

    block_out: int = 128
    block_in: int = 128


@attrs.frozen(kw_only=True)
class DeepseekConfig:
    """A DeepSeek-V2/V3 model: sizes, attention, rope, MLP and MoE (see the module docstring).

    ``dtype`` is the checkpoint's own weight dtype (None: unstated), ``quantization`` its FP8
    block quantization (None: plain weights), ``indexer`` DeepSeek Sparse Attention's
    lightning indexer (``app.model.sparse``; None: a dense model).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = attrs.field(factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    moe: MoEConfig | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    dtype: torch.dtype | None = None
    quantization: Fp8Quantization | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    indexer: IndexerConfig | None = None

    def __attrs_post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: "
                             f"{sorted(ARCHITECTURES)}")
        if self.indexer is not None and (self.q_lora_rank is None or len(
                self.indexer.layer_has_indexer) not in (0, self.num_hidden_layers)):
            raise ValueError("DeepseekConfig.indexer needs a q LoRA (q_lora_rank) and one "
                             "layer_has_indexer entry per layer")
        if self.indexer is not None \
                and self.indexer.index_topk > self.max_position_embeddings:
            raise ValueError(f"DeepseekConfig.indexer.index_topk must be at most "
                             f"max_position_embeddings ({self.max_position_embeddings}: the "
                             f"most keys a query sees), got {self.indexer.index_topk}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rope, got "
                             f"{self.qk_rope_head_dim}")

    # -- derived -----------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """Prefill q/k head dim: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5`` times yarn's ``mscale(factor, mscale_all_dim) ** 2``."""
        return float(self.qk_head_dim ** -0.5) * self.rope.softmax_scale_multiplier

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts."""
        return (self.moe is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    def model_config(self, dtype: torch.dtype | None = None) -> ModelConfig:
        """The engine's ``ModelConfig``: the attention dims, the softmax scale, ``dtype``
        (default: the checkpoint's; bfloat16 when unstated or FP8)."""
        sparse: dict[str, Any] = {} if self.indexer is None else {
            "index_topk": self.indexer.index_topk, "index_head_dim": self.indexer.index_head_dim,
            "index_n_heads": self.indexer.index_n_heads}
        return ModelConfig(dtype=dtype or self.dtype or torch.bfloat16,
                           num_heads=self.num_attention_heads, hidden_size=self.hidden_size,
                           kv_lora_rank=self.kv_lora_rank,
                           qk_nope_head_dim=self.qk_nope_head_dim,
                           qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                           softmax_scale=self.softmax_scale, **sparse)

    def check_model_config(self, model: ModelConfig) -> None:
        """``ValueError`` when an engine's ``ModelConfig`` disagrees with these weights (heads,
        hidden size, latent dims, head dims, softmax scale, the sparse indexer's top-k and
        dims)."""
        want = self.model_config(model.dtype)
        names = ["num_heads", "hidden_size", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "index_topk"]
        if self.indexer is not None:
            names += ["index_head_dim", "index_n_heads"]
        diffs = [f"{name}: config {getattr(model, name)!r}, weights {getattr(want, name)!r}"
                 for name in names if getattr(model, name) != getattr(want, name)]
        if not math.isclose(model.scale, want.scale, rel_tol=1e-12):
            diffs.append(f"softmax scale: config {model.scale!r}, weights {want.scale!r}")
        if diffs:
            raise ValueError("the engine's ModelConfig does not match the model's weights: "
                             + "; ".join(diffs) + " (build it with DeepseekConfig.model_config)")

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        moe = None if self.moe is None else attrs.asdict(self.moe)
        return {"architecture": self.architecture, "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
                "intermediate_size": self.intermediate_size, "rope": attrs.asdict(self.rope),
                "rope_interleave": self.rope_interleave, "moe": moe,
                "first_k_dense_replace": self.first_k_dense_replace,
                "moe_layer_freq": self.moe_layer_freq,
                "tie_word_embeddings": self.tie_word_embeddings,
                "softmax_scale": self.softmax_scale,
                "quantization": None if self.quantization is None else "fp8 e4m3 block "
                f"{self.quantization.block_out}x{self.quantization.block_in}",
                "indexer": None if self.indexer is None else self.indexer.describe()}

    # -- reading -----------------------------------------------------------------------

    @classmethod
    def from_json_file(cls, path: str | Path) -> DeepseekConfig:
        """Read a checkpoint's ``config.json`` (``ValueError`` naming the file and the key; see
        the module docstring)."""
        path = Path(path)
        if not path.exists() and not path.is_symlink():
            raise ValueError(f"{path}: no config.json (a Hugging Face checkpoint directory "
                             "holds config.json and *.safetensors)")
        return cls.from_dict(load_json(path, "config.json"), source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> DeepseekConfig:
        """From a parsed ``config.json`` (both layouts; see the module docstring)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        arch = _architecture(raw, source)
        r = _Reader(raw, source, _DEFAULTS[arch])
        if r.get("hidden_act") != "silu":
            raise r.error("hidden_act", "'silu' (DeepSeek's SwiGLU MLP)")
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key):
                raise r.error(key, "false (DeepSeek checkpoints have no biases)")
        max_positions = r.integer("max_position_embeddings")
        layers, moe = r.integer("num_hidden_layers"), _moe(raw, r)
        first_dense, freq = r.integer("first_k_dense_replace", 0), r.integer("moe_layer_freq")
        indexer = read_indexer(arch, r, num_layers=layers,
                               qk_rope_head_dim=_even(r, "qk_rope_head_dim"),
                               q_lora_rank=r.opt_int("q_lora_rank"),
                               first_k_dense_replace=first_dense, moe_layer_freq=freq,
                               moe=moe is not None)
        return cls(
            architecture=arch, vocab_size=r.integer("vocab_size"),
            hidden_size=r.integer("hidden_size"),
            intermediate_size=r.integer("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=r.integer("num_attention_heads"),
            q_lora_rank=r.opt_int("q_lora_rank"), kv_lora_rank=r.integer("kv_lora_rank"),
            qk_nope_head_dim=r.integer("qk_nope_head_dim"),
            qk_rope_head_dim=_even(r, "qk_rope_head_dim"), v_head_dim=r.integer("v_head_dim"),
            rms_norm_eps=r.number("rms_norm_eps"), max_position_embeddings=max_positions,
            rope=_rope(raw, r, max_positions), rope_interleave=r.boolean("rope_interleave"),
            tie_word_embeddings=r.boolean("tie_word_embeddings"), moe=moe,
            first_k_dense_replace=first_dense, moe_layer_freq=freq,
            num_nextn_predict_layers=r.integer("num_nextn_predict_layers", 0),
            dtype=_dtype(raw, source), quantization=_quantization(raw, source),
            bos_token_id=_bos(r),
            eos_token_ids=parse_token_ids(raw.get("eos_token_id"), f"{source}: eos_token_id"),
            indexer=indexer)


def _shown(value: object) -> str:
    """A config value as an error shows it: its repr, cut to 200 characters."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:160]}... ({len(text)} characters)"


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    names = raw.get("architectures")
    if names is not None and not (isinstance(names, list)
                                  and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{source}: architectures = {_shown(names)}: expected a list of "
                         f"class names such as {sorted(ARCHITECTURES)}")
    if names:
        for name in names:
            if name in ARCHITECTURES:
                return str(name)
        raise ValueError(f"{source}: architectures = {_shown(names)}: unsupported; this engine "
                         f"runs {sorted(ARCHITECTURES)}")
    model_type = raw.get("model_type")
    for arch, kind in ARCHITECTURES.items():
        if model_type == kind:
            return arch
    raise ValueError(f"{source}: model_type = {_shown(model_type)}: unsupported (and no "
                     f"architectures list); expected one of {sorted(ARCHITECTURES.values())}")


def _even(r: _Reader, key: str) -> int:
    value = r.integer(key, 0)
    if value % 2:
        raise r.error(key, "an even int (rope rotates pairs)")
    return value


def _rope(raw: Mapping[str, Any], r: _Reader, max_positions: int) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is not None:
        if isinstance(params, Mapping) and "rope_theta" not in params and "rope_theta" in raw:
            params = {**params, "rope_theta": raw["rope_theta"]}
        return RopeConfig.from_dict(params, r.number("rope_theta"), max_positions,
                                    f"{r.source}: rope_parameters")
    return RopeConfig.from_dict(raw.get("rope_scaling"), r.number("rope_theta"), max_positions,
                                f"{r.source}: rope_scaling")


def _moe(raw: Mapping[str, Any], r: _Reader) -> MoEConfig | None:
    if raw.get("n_routed_experts") is None:
        return None
    experts = r.integer("n_routed_experts")
    scoring = r.choice("scoring_func", ("softmax", "sigmoid"))
    methods = ("noaux_tc",) if scoring == "sigmoid" else ("greedy", "group_limited_greedy")
    method = r.choice("topk_method", methods)
    grouped = method != "greedy"
    n_group = (r.opt_int("n_group") or 1) if grouped else 1
    topk_group = (r.opt_int("topk_group") or 1) if grouped else 1
    if experts % n_group:
        raise r.error("n_group", f"a divisor of n_routed_experts ({experts})")
    if topk_group > n_group:
        raise r.error("topk_group", f"<= n_group ({n_group})")
    if scoring == "sigmoid" and experts // n_group < 2:
        raise r.error("n_group", "at most n_routed_experts / 2 (a group scores its best two)")
    top_k = r.integer("num_experts_per_tok")
    if top_k > topk_group * (experts // n_group):
        raise r.error("num_experts_per_tok", f"<= the experts of the chosen groups "
                      f"({topk_group * (experts // n_group)})")
    return MoEConfig(n_routed_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=r.integer("moe_intermediate_size"),
                     n_shared_experts=r.opt_int("n_shared_experts", 0) or 0,
                     scoring_func=scoring, topk_method=method, n_group=n_group,
                     topk_group=topk_group, norm_topk_prob=r.boolean("norm_topk_prob"),
                     routed_scaling_factor=r.number("routed_scaling_factor"))


def _dtype(raw: Mapping[str, Any], source: str) -> torch.dtype | None:
    key = "dtype" if "dtype" in raw else "torch_dtype"
    name = raw.get(key)
    if name is None:
        return None
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"{source}: {key} = {_shown(name)}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _quantization(raw: Mapping[str, Any], source: str) -> Fp8Quantization | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        method = q.get("quant_method") if isinstance(q, Mapping) else q
        raise ValueError(f"{where}: quant_method = {method!r}: unsupported; this loader "
                         "dequantizes FP8 e4m3 block-quantized weights (quant_method 'fp8')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: fmt = {q.get('fmt')!r}: only 'e4m3' is supported")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_CONFIG_INT
                    for b in block)):
        raise ValueError(f"{where}: weight_block_size = {_shown(block)}: expected [rows, cols] "
                         f"of positive ints (at most {MAX_CONFIG_INT}; per-tensor FP8 is not "
                         "supported)")
    return Fp8Quantization(block_out=block[0], block_in=block[1])


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) \
        and 0 <= value <= MAX_CONFIG_INT


def parse_token_ids(value: object, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` value (an int, a list of ints, or null: none) as a tuple;
    ``ValueError`` naming ``where`` (the file and the key) for anything else (``true`` is not a
    token id)."""
    if value is None:
        return ()
    if _is_token_id(value):
        return (value,)  # type: ignore[return-value]
    if isinstance(value, list) and all(_is_token_id(v) for v in value):
        return tuple(value)
    raise ValueError(f"{where} = {_shown(value)}: expected a token id (an int in [0, "
                     f"{MAX_CONFIG_INT}]), a list of them, or null")


def _bos(r: _Reader) -> int | None:
    value = r.raw.get("bos_token_id")
    if value is None:
        return None
    if not _is_token_id(value):
        raise r.error("bos_token_id", f"a token id (an int in [0, {MAX_CONFIG_INT}]) or null")
    return int(value)
