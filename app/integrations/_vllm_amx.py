"""On an AMX CPU, which MLA attention vLLM's engine gets: its own ``AMX_MLA`` or ours
(``CPU_MLA``, which our plugin makes our decode and prefill).

vLLM's CPU platform picks ``AMX_MLA`` (SGLang's AMX kernels) whenever the CPU has AMX tiles
and the engine did not ask for ``CPU_MLA`` (``CpuPlatform.get_attn_backend_cls``,
``check_and_update_config``), bypassing both registries our plugin uses. ``AMX_MLA`` declares
bfloat16 only and an ``auto`` KV cache: a float32 or float16 DeepSeek model there fails while
its weights are packed ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8",
``torch.ops._C.convert_weight_packed``), so vLLM's own engine cannot run it at all.

The rule (:func:`decide_amx_backend`; ``APP_VLLM_AMX`` = ``auto``, ``ours`` or ``vllm``):

- the engine asked for a backend (``attention_backend=...``, ``backend_per_kind``): left alone;
- ``ours``: ``CPU_MLA`` (ours) for every dtype; ``vllm``: ``AMX_MLA`` left for every dtype;
- ``auto`` (default): ours where ``AMX_MLA`` cannot serve the model (a dtype it does not
  declare, read from vLLM's source; a KV cache dtype other than ``auto``); for the dtypes it
  serves, whichever measured faster on an AMX CPU (:data:`MEASURED_DECODE_SPEEDUP`, ours over
  ``AMX_MLA``'s decode phase in ``bench vllm-engine``): until that is measured, ``AMX_MLA``
  stays (the behaviour before this rule), and the log line says so and how to run ours.

It acts in ``CpuPlatform.check_and_update_config``, the hook where vLLM settles the attention
backend and the cache's block size for the config, by setting
``vllm_config.attention_config.backend`` before vLLM's own code reads it (our wrapper calls
vLLM's method after). The decision is logged once per config on ``vllm.plugins.app``. The
wrapper is installed only where vLLM's sources have the shape it was written against
(:func:`amx_routing_problems`); otherwise vLLM's choice stands and the plugin's line says why.
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from app.integrations._vllm_interface import _ast_parameters, _method, _Sources, class_fields

__all__ = ["AMX_ENV", "AMX_VALUES", "MEASURED_DECODE_SPEEDUP", "AmxDecision", "amx_mla_dtypes",
           "amx_routing_problems", "decide_amx_backend", "install_amx_routing", "route_config"]

logger = logging.getLogger("vllm.plugins.app")

#: The setting, and its values.
AMX_ENV = "APP_VLLM_AMX"
AMX_VALUES = ("auto", "ours", "vllm")
#: Ours over ``AMX_MLA``, decode-phase tokens/s of ``bench vllm-engine`` (bf16) on an AMX CPU;
#: None until measured there (no AMX machine has run it yet). At 1.0 or more ``auto`` gives
#: bf16 models ours.
MEASURED_DECODE_SPEEDUP: float | None = None

_CPU_PLATFORM = ("platforms", "cpu.py")
_AMX_MLA = ("v1", "attention", "backends", "mla", "amx_mla.py")
_ATTENTION_CONFIG = ("config", "attention.py")
_MARK = "_app_amx_routing"


@attrs.frozen
class AmxDecision:
    """``ours``: make the engine's attention ``CPU_MLA``; ``reason``: the log line's body."""

    ours: bool
    reason: str


def read_setting() -> str:
    """``APP_VLLM_AMX`` (default ``auto``); ``ValueError`` for another value."""
    raw = os.environ.get(AMX_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in AMX_VALUES:
        raise ValueError(f"{AMX_ENV}: expected one of {', '.join(AMX_VALUES)} (or unset), got "
                         f"{raw!r}")
    return value


def decide_amx_backend(dtype: str, kv_cache_dtype: str, requested: str | None,
                       amx_dtypes: tuple[str, ...], setting: str,
                       measured: float | None = MEASURED_DECODE_SPEEDUP) -> AmxDecision:
    """The rule of the module docstring, on plain names (``dtype`` e.g. ``"float32"``)."""
    if requested is not None:
        return AmxDecision(False, f"the engine asked for attention backend {requested}: left "
                                  f"as it is")
    if setting == "vllm":
        return AmxDecision(False, f"{AMX_ENV}=vllm: vLLM's AMX_MLA kept for every dtype")
    if setting == "ours":
        return AmxDecision(True, f"{AMX_ENV}=ours: CPU_MLA (ours) instead of vLLM's AMX_MLA")
    if dtype not in amx_dtypes or kv_cache_dtype != "auto":
        what = (f"a {kv_cache_dtype} KV cache" if dtype in amx_dtypes
                else f"{dtype} (it declares {', '.join(amx_dtypes)} only)")
        return AmxDecision(True, f"vLLM's AMX_MLA cannot serve {what}: CPU_MLA (ours) serves "
                                 f"this model instead")
    if measured is None:
        return AmxDecision(False, f"vLLM's AMX_MLA serves this {dtype} model: ours has not "
                                  f"been measured against it on an AMX CPU yet (python -m app "
                                  f"bench vllm-engine); {AMX_ENV}=ours or "
                                  f"attention_backend='CPU_MLA' runs ours")
    if measured >= 1.0:
        return AmxDecision(True, f"CPU_MLA (ours) serves this {dtype} model: measured "
                                 f"{measured:.2f}x vLLM's AMX_MLA decode on an AMX CPU")
    return AmxDecision(False, f"vLLM's AMX_MLA serves this {dtype} model: measured faster than "
                              f"ours on an AMX CPU (ours {measured:.2f}x); {AMX_ENV}=ours runs "
                              f"ours")


def amx_mla_dtypes(sources: _Sources) -> tuple[str, ...] | str:
    """The dtypes vLLM's ``AMXMLABackend.supported_dtypes`` lists (``torch.bfloat16`` ->
    ``"bfloat16"``), read from its source (importing it would import vLLM's model code);
    a string saying why not when it cannot be read."""
    tree = sources.tree(_AMX_MLA)
    if isinstance(tree, str):
        return tree
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AMXMLABackend"):
        for node in cls.body:
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and target.id == "supported_dtypes" \
                    and isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.List):
                names = [e.attr for e in node.value.elts if isinstance(e, ast.Attribute)]
                if names and len(names) == len(node.value.elts):
                    return tuple(names)
        return "AMXMLABackend.supported_dtypes is not a list of torch dtypes"
    return f"{_AMX_MLA[-1]} defines no AMXMLABackend"


def amx_routing_problems(sources: _Sources, registry: Any) -> list[str]:
    """Why the routing cannot be installed on this vLLM (empty: it can)."""
    problems = []
    tree = sources.tree(_CPU_PLATFORM)
    method = None if isinstance(tree, str) else _method(tree, "CpuPlatform",
                                                        "check_and_update_config")
    if method is None:
        problems.append("vllm/platforms/cpu.py has no CpuPlatform.check_and_update_config")
    elif _ast_parameters(method) != ("cls", "vllm_config"):
        problems.append(f"CpuPlatform.check_and_update_config{_ast_parameters(method)} differs "
                        f"from ('cls', 'vllm_config')")
    members = getattr(getattr(registry, "AttentionBackendEnum", None), "__members__", {})
    if not {"AMX_MLA", "CPU_MLA"} <= set(members):
        problems.append("AttentionBackendEnum has no AMX_MLA or CPU_MLA")
    attention = sources.tree(_ATTENTION_CONFIG)
    fields = None if isinstance(attention, str) else class_fields(attention, ("AttentionConfig",))
    if fields is None or not {"backend", "backend_per_kind"} <= fields:
        problems.append("vLLM's AttentionConfig has no backend / backend_per_kind")
    dtypes = amx_mla_dtypes(sources)
    if isinstance(dtypes, str):
        problems.append(dtypes)
    return problems


def _has_amx() -> bool:
    """vLLM's own test for AMX (its CPU platform asks torch)."""
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # an old torch without the probe: vLLM has no AMX path either
        return False


def _log(line: str) -> None:
    logger.info("%s", line)


def route_config(vllm_config: Any, amx_dtypes: tuple[str, ...], enum: Any,
                 say: Callable[[str], None] = _log) -> AmxDecision | None:
    """Apply the rule to a ``VllmConfig`` about to be settled (None: not an MLA model on an
    AMX CPU, or DeepSeek-V4, whose AMX path vLLM keeps apart); sets its attention backend to
    ``CPU_MLA`` when the rule says ours, and says the decision (``say``: a log line)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None or not getattr(model, "use_mla", False) or not _has_amx():
        return None
    if getattr(getattr(model, "hf_config", None), "model_type", None) == "deepseek_v4":
        return None
    attention = vllm_config.attention_config
    requested = attention.backend.name if attention.backend is not None else (
        "per kind" if attention.backend_per_kind else None)
    cache = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    dtype = str(model.dtype).removeprefix("torch.")
    decision = decide_amx_backend(dtype, str(cache), requested, amx_dtypes, read_setting())
    if decision.ours:
        attention.backend = enum.CPU_MLA
    say(f"app: this CPU has AMX: {decision.reason}")
    return decision


def install_amx_routing(platform_class: Any = None, say: Callable[[str], None] = _log
                        ) -> str | None:
    """Wrap ``CpuPlatform.check_and_update_config`` (or ``platform_class``'s: tests) with
    :func:`route_config` (its decisions to ``say``), once; None when installed (or already),
    else why not."""
    try:
        vllm = importlib.import_module("vllm")
        registry = importlib.import_module("vllm.v1.attention.backends.registry")
        sources = _Sources(Path(str(vllm.__file__)).parent)
        problems = amx_routing_problems(sources, registry)
        if problems:
            return "; ".join(problems)
        if platform_class is None:
            platform_class = importlib.import_module("vllm.platforms.cpu").CpuPlatform
    except Exception as exc:  # vLLM's imports can fail in any way: then no routing
        return f"{type(exc).__name__}: {exc}"
    amx_dtypes = amx_mla_dtypes(sources)
    original = platform_class.__dict__.get("check_and_update_config")
    if getattr(getattr(original, "__func__", None), _MARK, False):
        return None
    if not isinstance(original, classmethod) or isinstance(amx_dtypes, str):
        return "CpuPlatform.check_and_update_config is not a classmethod"
    settle = original.__func__
    enum = registry.AttentionBackendEnum

    def check_and_update_config(cls: Any, vllm_config: Any) -> Any:
        try:
            route_config(vllm_config, amx_dtypes, enum, say)
        except ValueError as exc:  # a bad APP_VLLM_AMX: said, and vLLM's choice stands
            logger.warning("app: %s; vLLM's choice of attention backend stands", exc)
        except Exception:  # never take vLLM's configuration down
            logger.exception("app: the AMX routing failed; vLLM's choice stands")
        return settle(cls, vllm_config)

    setattr(check_and_update_config, _MARK, True)
    check_and_update_config.__doc__ = settle.__doc__
    platform_class.check_and_update_config = classmethod(check_and_update_config)
    return None
