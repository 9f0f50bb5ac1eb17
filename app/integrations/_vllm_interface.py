"""Does the installed vLLM have the interface our adapters were written against (vLLM 0.32 CPU)?

:func:`vllm_interface_problems` lists every difference, empty when there is none. Prefill: vLLM's
``MLAPrefillBackend`` base (method signatures, abstract methods, imported: it is light), its
registry, and the prefill metadata fields :mod:`app.integrations.vllm` reads. Decode: vLLM's
attention-backend registry (``AttentionBackendEnum.CPU_MLA``, ``register_backend``), and, read
from vLLM's sources rather than imported (importing vLLM's model code from a plugin would run it
before the platform has set itself up), the CPU MLA backend / impl methods, the MLA metadata
builder and the decode metadata fields :mod:`app.integrations.vllm_decode` uses.

Nothing here imports vLLM at import time, and nothing raises.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BASE_ABSTRACT", "BASE_METHODS", "DECODE_CLASS_PATH", "DECODE_METHODS",
           "METADATA_FIELDS", "METADATA_SOURCE", "PREFILL_CLASS_PATH", "VLLM_VERIFIED_VERSION",
           "class_fields", "vllm_interface_problems"]

#: The class vLLM imports for ``MLAPrefillBackendEnum.CPU`` once the plugin has run.
PREFILL_CLASS_PATH = "app.integrations.vllm.AppCPUMLAPrefillBackend"
#: The class vLLM imports for ``AttentionBackendEnum.CPU_MLA`` once the plugin has run.
DECODE_CLASS_PATH = "app.integrations.vllm_decode.AppCPUMLABackend"
#: The vLLM build the interface below was read from and the whole-engine tests ran against.
VLLM_VERIFIED_VERSION = "0.32.0"

_PREFILL = "vllm.v1.attention.backends.mla.prefill"
_REGISTRY = "vllm.v1.attention.backends.registry"

#: vLLM's ``MLAPrefillBackend`` methods our prefill class overrides or calls, with their
#: parameter names in order (as ``inspect.signature`` gives them on the class).
BASE_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "num_heads", "scale", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "vllm_config"),
    "get_name": (),
    "is_available": (),
    "supports_compute_capability": ("device_capability",),
    "supports_dtype": ("dtype",),
    "supports_mla_dimensions": ("mla_dimensions",),
    "validate_configuration": ("device_capability", "selector_config"),
    "supports_quant_output": ("self", "quant_key"),
    "supports_out": ("self",),
    "clone": ("self",),
    "prepare_metadata": ("self", "prefill_metadata"),
    "run_prefill_new_tokens": ("self", "q", "k", "v", "return_softmax_lse", "out",
                               "output_scale"),
    "run_prefill_context_chunk": ("self", "chunk", "q", "k", "v", "out"),
}
#: The abstract methods of vLLM's prefill base (a new one would leave our class abstract).
BASE_ABSTRACT = frozenset({"get_name", "run_prefill_new_tokens", "run_prefill_context_chunk"})

#: The MLA metadata source (relative to vLLM's package directory).
METADATA_SOURCE = ("model_executor", "layers", "attention", "mla_attention.py")
_CPU_MLA_SOURCE = ("v1", "attention", "backends", "mla", "cpu_mla.py")
#: Fields our adapters read, per dataclass (qualified name) of ``mla_attention.py``.
METADATA_FIELDS: dict[tuple[str, ...], frozenset[str]] = {
    ("MLACommonPrefillMetadata",): frozenset({"query_start_loc", "query_lens_cpu",
                                              "chunked_context"}),
    ("MLACommonPrefillMetadata", "ChunkedContextMetadata"): frozenset({"chunks"}),
    ("MLACommonPrefillMetadata", "ContextChunk"): frozenset({"index", "request_slice",
                                                             "seq_lens"}),
    ("MLACommonDecodeMetadata",): frozenset({"block_table", "seq_lens"}),
    ("MLACommonMetadata",): frozenset({"num_decodes", "num_decode_tokens", "decode",
                                       "head_dim"}),
}
#: vLLM's decode-side methods our decode classes override or call: (source, class, method)
#: -> parameter names in order (``**name`` for a catch-all keyword parameter).
DECODE_METHODS: dict[tuple[tuple[str, ...], str, str], tuple[str, ...]] = {
    (_CPU_MLA_SOURCE, "CPUMLAImpl", "__init__"): (
        "self", "num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
        "sliding_window", "kv_cache_dtype", "logits_soft_cap", "attn_type",
        "kv_sharing_target_layer_name", "**mla_args"),
    (_CPU_MLA_SOURCE, "CPUMLAImpl", "forward_mqa"): (
        "self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"),
    (_CPU_MLA_SOURCE, "CPUMLAImpl", "do_kv_cache_update"): (
        "self", "kv_c_normed", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype",
        "k_scale"),
    (_CPU_MLA_SOURCE, "CPUMLABackend", "get_name"): (),
    (_CPU_MLA_SOURCE, "CPUMLABackend", "get_impl_cls"): (),
    (_CPU_MLA_SOURCE, "CPUMLABackend", "supports_block_size"): ("cls", "block_size"),
    (METADATA_SOURCE, "MLACommonMetadataBuilder", "__init__"): (
        "self", "kv_cache_spec", "layer_names", "vllm_config", "device", "metadata_cls",
        "supports_dcp_with_varlen"),
    (METADATA_SOURCE, "MLACommonMetadataBuilder", "build"): (
        "self", "common_prefix_len", "common_attn_metadata", "fast_build"),
}
#: Attributes vLLM's ``MLACommonMetadataBuilder.__init__`` sets that our builder reads.
BUILDER_ATTRIBUTES = frozenset({"num_heads", "mla_dims", "kv_cache_spec"})


def _parameter_names(func: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def _prefill_registry_problems(registry: Any, class_path: str) -> list[str]:
    problems = []
    enum = getattr(registry, "MLAPrefillBackendEnum", None)
    register = getattr(registry, "register_mla_prefill_backend", None)
    if enum is None or "CPU" not in getattr(enum, "__members__", {}):
        problems.append(f"{_PREFILL}.registry has no MLAPrefillBackendEnum.CPU")
    if not callable(register):
        problems.append(f"{_PREFILL}.registry has no register_mla_prefill_backend")
    elif enum is not None and not problems:
        try:
            inspect.signature(register).bind(enum.CPU, class_path)
        except TypeError as exc:
            problems.append(f"register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, "
                            f"class_path) does not bind: {exc}")
    return problems


def _base_problems(base: type) -> list[str]:
    problems = []
    for name, expected in BASE_METHODS.items():
        method = getattr(base, name, None)
        if method is None:
            problems.append(f"MLAPrefillBackend.{name} is missing")
            continue
        try:
            got = _parameter_names(method)
        except (TypeError, ValueError) as exc:
            problems.append(f"MLAPrefillBackend.{name}: no signature ({exc})")
            continue
        if got != expected:
            problems.append(f"MLAPrefillBackend.{name}{got} differs from {expected}")
    abstract = frozenset(getattr(base, "__abstractmethods__", ()))
    if abstract - BASE_ABSTRACT:
        problems.append(f"MLAPrefillBackend has new abstract methods "
                        f"{sorted(abstract - BASE_ABSTRACT)}")
    return problems


def _find_class(tree: ast.Module, qualname: tuple[str, ...]) -> ast.ClassDef | None:
    body: list[ast.stmt] = tree.body
    node: ast.ClassDef | None = None
    for part in qualname:
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def class_fields(tree: ast.Module, qualname: tuple[str, ...]) -> set[str] | None:
    """The annotated fields of class ``qualname`` (nested names) in ``tree``; None if absent."""
    node = _find_class(tree, qualname)
    if node is None:
        return None
    return {n.target.id for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | None:
    node = _find_class(tree, (cls,))
    if node is None:
        return None
    return next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name),
                None)


def _ast_parameters(func: ast.FunctionDef) -> tuple[str, ...]:
    a = func.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return tuple(names)


def _self_attributes(func: ast.FunctionDef) -> set[str]:
    return {t.attr for n in ast.walk(func) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


class _Sources:
    """vLLM's source files, each parsed once."""

    def __init__(self, vllm_dir: Path) -> None:
        self.vllm_dir = vllm_dir
        self._trees: dict[tuple[str, ...], ast.Module | str] = {}

    def tree(self, parts: tuple[str, ...]) -> ast.Module | str:
        if parts not in self._trees:
            source = self.vllm_dir.joinpath(*parts)
            try:
                self._trees[parts] = ast.parse(source.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, ValueError) as exc:
                self._trees[parts] = f"cannot read {source}: {exc}"
        return self._trees[parts]


def _metadata_problems(sources: _Sources) -> list[str]:
    tree = sources.tree(METADATA_SOURCE)
    if isinstance(tree, str):
        return [f"vLLM's MLA metadata classes: {tree}"]
    problems = []
    for qualname, wanted in METADATA_FIELDS.items():
        fields = class_fields(tree, qualname)
        name = ".".join(qualname)
        if fields is None:
            problems.append(f"{name} is not defined in {METADATA_SOURCE[-1]}")
        elif wanted - fields:
            problems.append(f"{name} has no field(s) {sorted(wanted - fields)}")
    return problems


def _decode_source_problems(sources: _Sources) -> list[str]:
    problems = []
    for (parts, cls, name), expected in DECODE_METHODS.items():
        tree = sources.tree(parts)
        if isinstance(tree, str):
            problems.append(f"{cls}.{name}: {tree}")
            continue
        func = _method(tree, cls, name)
        if func is None:
            problems.append(f"{cls}.{name} is not defined in {parts[-1]}")
        elif _ast_parameters(func) != expected:
            problems.append(f"{cls}.{name}{_ast_parameters(func)} differs from {expected}")
    tree = sources.tree(METADATA_SOURCE)
    init = None if isinstance(tree, str) else _method(tree, "MLACommonMetadataBuilder",
                                                      "__init__")
    if init is not None and BUILDER_ATTRIBUTES - _self_attributes(init):
        problems.append(f"MLACommonMetadataBuilder.__init__ no longer sets "
                        f"{sorted(BUILDER_ATTRIBUTES - _self_attributes(init))}")
    return problems


def _decode_registry_problems(registry: Any, class_path: str) -> list[str]:
    enum = getattr(registry, "AttentionBackendEnum", None)
    register = getattr(registry, "register_backend", None)
    if enum is None or "CPU_MLA" not in getattr(enum, "__members__", {}):
        return [f"{_REGISTRY} has no AttentionBackendEnum.CPU_MLA"]
    if not callable(register):
        return [f"{_REGISTRY} has no register_backend"]
    try:
        inspect.signature(register).bind(enum.CPU_MLA, class_path)
    except TypeError as exc:
        return [f"register_backend(AttentionBackendEnum.CPU_MLA, class_path) does not bind: "
                f"{exc}"]
    return []


def vllm_interface_problems() -> list[str]:
    """Why the installed vLLM does not have the interface our classes were written against
    (empty: it has; vLLM 0.32 CPU). Imports vLLM's registries and prefill base (light), never
    its model code; raises nothing."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        return [f"vLLM is not installed ({exc})"]
    except Exception as exc:  # a broken install fails in any way (an OSError loading _C ...)
        return [f"vLLM cannot be imported ({type(exc).__name__}: {exc})"]
    try:
        prefill_registry = importlib.import_module(f"{_PREFILL}.registry")
        base_module = importlib.import_module(f"{_PREFILL}.base")
        registry = importlib.import_module(_REGISTRY)
    except Exception as exc:  # an import of vLLM's can fail in any way
        return [f"vLLM {getattr(vllm, '__version__', '?')} has no MLA backend registries "
                f"({type(exc).__name__}: {exc})"]
    problems = _prefill_registry_problems(prefill_registry, PREFILL_CLASS_PATH)
    base = getattr(base_module, "MLAPrefillBackend", None)
    if not isinstance(base, type):
        problems.append(f"{_PREFILL}.base has no MLAPrefillBackend class")
    else:
        problems += _base_problems(base)
    problems += _decode_registry_problems(registry, DECODE_CLASS_PATH)
    vllm_file = getattr(vllm, "__file__", None)
    if vllm_file is None:
        return [*problems, "cannot locate vLLM's sources"]
    sources = _Sources(Path(vllm_file).parent)
    return problems + _metadata_problems(sources) + _decode_source_problems(sources)
