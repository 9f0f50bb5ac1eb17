"""vLLM's general plugin for this package: our CPU MLA prefill behind vLLM's own registry.

vLLM runs every function of the ``vllm.general_plugins`` entry-point group once per process
(``vllm.plugins.load_general_plugins``). Ours, :func:`register_vllm_plugin`, checks that the
installed vLLM has the interface :mod:`app.integrations.vllm` was written against (vLLM 0.33:
its ``MLAPrefillBackend`` base, its registry and its prefill metadata), resolves our TORCH_SDPA
class through our container, and then calls vLLM's own
``register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, VLLM_BACKEND_CLASS_PATH)``. When
anything differs it registers nothing and logs why; it never raises (vLLM does not catch what
a general plugin raises).

This module imports no vLLM at import time: ``import app`` never imports vLLM. The plugin logs
to ``vllm.plugins.app`` (under vLLM's own ``vllm`` logger, so its lines appear in vLLM's
output, where our ``app`` logger has no handler).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "VLLM_BACKEND_CLASS_PATH",
    "VLLM_ENTRY_POINT",
    "VLLM_VERIFIED_VERSION",
    "register_vllm_plugin",
    "vllm_interface_problems",
]

#: The class vLLM imports for ``MLAPrefillBackendEnum.CPU`` once the plugin has run.
VLLM_BACKEND_CLASS_PATH = "app.integrations.vllm.AppCPUMLAPrefillBackend"
#: The entry point's name in the ``vllm.general_plugins`` group (what ``VLLM_PLUGINS`` lists).
VLLM_ENTRY_POINT = "app_cpu_mla_prefill"
#: The vLLM version the interface below was read from and the integration tests ran against.
VLLM_VERIFIED_VERSION = "0.33.0"

logger = logging.getLogger("vllm.plugins.app")

_PREFILL = "vllm.v1.attention.backends.mla.prefill"

#: vLLM 0.33's ``MLAPrefillBackend`` methods our class overrides or calls, with their
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
#: The abstract methods of vLLM 0.33's base (a new one would leave our class abstract).
BASE_ABSTRACT = frozenset({"get_name", "run_prefill_new_tokens", "run_prefill_context_chunk"})
#: The prefill metadata fields our class reads, per dataclass of
#: ``vllm/model_executor/layers/attention/mla_attention.py`` (read from its source, not
#: imported: importing vLLM's model code from a plugin would run it before the platform has
#: set itself up).
METADATA_SOURCE = ("model_executor", "layers", "attention", "mla_attention.py")
METADATA_FIELDS: dict[tuple[str, ...], frozenset[str]] = {
    ("MLACommonPrefillMetadata",): frozenset({"query_start_loc", "query_lens_cpu",
                                              "chunked_context"}),
    ("MLACommonPrefillMetadata", "ChunkedContextMetadata"): frozenset({"chunks"}),
    ("MLACommonPrefillMetadata", "ContextChunk"): frozenset({"index", "request_slice",
                                                             "seq_lens"}),
}


def _parameter_names(func: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def _registry_problems(registry: Any) -> list[str]:
    problems = []
    enum = getattr(registry, "MLAPrefillBackendEnum", None)
    register = getattr(registry, "register_mla_prefill_backend", None)
    if enum is None or "CPU" not in getattr(enum, "__members__", {}):
        problems.append(f"{_PREFILL}.registry has no MLAPrefillBackendEnum.CPU")
    if not callable(register):
        problems.append(f"{_PREFILL}.registry has no register_mla_prefill_backend")
    elif enum is not None and not problems:
        try:
            inspect.signature(register).bind(enum.CPU, VLLM_BACKEND_CLASS_PATH)
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


def _class_fields(tree: ast.Module, qualname: tuple[str, ...]) -> set[str] | None:
    body: list[ast.stmt] = tree.body
    node: ast.ClassDef | None = None
    for part in qualname:
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return {n.target.id for n in body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _metadata_problems(vllm_dir: Path) -> list[str]:
    source = vllm_dir.joinpath(*METADATA_SOURCE)
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as exc:
        return [f"cannot read vLLM's prefill metadata classes from {source}: {exc}"]
    problems = []
    for qualname, wanted in METADATA_FIELDS.items():
        fields = _class_fields(tree, qualname)
        name = ".".join(qualname)
        if fields is None:
            problems.append(f"{name} is not defined in {source.name}")
        elif wanted - fields:
            problems.append(f"{name} has no field(s) {sorted(wanted - fields)}")
    return problems


def vllm_interface_problems() -> list[str]:
    """Why the installed vLLM does not have the interface our class was written against
    (empty: it has; vLLM 0.33). Imports vLLM's registry and base (light), never its model
    code; raises nothing."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        return [f"vLLM is not installed ({exc})"]
    try:
        registry = importlib.import_module(f"{_PREFILL}.registry")
        base_module = importlib.import_module(f"{_PREFILL}.base")
    except Exception as exc:  # an import of vLLM's can fail in any way
        return [f"vLLM {getattr(vllm, '__version__', '?')} has no MLA prefill registry "
                f"({type(exc).__name__}: {exc})"]
    problems = _registry_problems(registry)
    base = getattr(base_module, "MLAPrefillBackend", None)
    if not isinstance(base, type):
        problems.append(f"{_PREFILL}.base has no MLAPrefillBackend class")
    else:
        problems += _base_problems(base)
    vllm_file = getattr(vllm, "__file__", None)
    if vllm_file is None:
        problems.append("cannot locate vLLM's sources")
    else:
        problems += _metadata_problems(Path(vllm_file).parent)
    return problems


def _our_class_problems() -> tuple[list[str], str]:
    """Import our class (vLLM's base is importable by now), resolve TORCH_SDPA once."""
    try:
        module = importlib.import_module(VLLM_BACKEND_CLASS_PATH.rpartition(".")[0])
        cls = getattr(module, VLLM_BACKEND_CLASS_PATH.rpartition(".")[2])
        if inspect.isabstract(cls):
            return [f"{VLLM_BACKEND_CLASS_PATH} is abstract: "
                    f"{sorted(cls.__abstractmethods__)}"], ""
        backend = cls.backend_class()
        describe: str = cls.describe_backend()
    except Exception as exc:  # our side must not take vLLM down either
        return [f"{VLLM_BACKEND_CLASS_PATH} is not usable: {type(exc).__name__}: {exc}"], ""
    return [], f"{backend.__module__}.{backend.__qualname__} ({describe})"


def register_vllm_plugin() -> None:
    """vLLM general plugin: make ``MLAPrefillBackendEnum.CPU`` our CPU prefill backend.

    Registers :data:`VLLM_BACKEND_CLASS_PATH` through vLLM's own
    ``register_mla_prefill_backend`` when vLLM's interface is the one it was written against
    (vLLM 0.33) and nothing else already overrides ``CPU``; otherwise registers nothing and
    logs why. Never raises. Turn it off with vLLM's allow-list: ``VLLM_PLUGINS`` not naming
    ``app_cpu_mla_prefill``.
    """
    try:
        _register()
    except Exception:  # vLLM calls general plugins unguarded: never take it down
        logger.exception("app: CPU MLA prefill plugin failed; vLLM keeps its own backend")


def _register() -> None:
    problems = vllm_interface_problems()
    if problems:
        logger.warning("app: not registering the CPU MLA prefill backend (written against "
                       "vLLM %s's interface): %s", VLLM_VERIFIED_VERSION, "; ".join(problems))
        return
    registry = importlib.import_module(f"{_PREFILL}.registry")
    member = registry.MLAPrefillBackendEnum.CPU
    current = member.get_path()
    if member.is_overridden() and current != VLLM_BACKEND_CLASS_PATH:
        logger.warning("app: MLAPrefillBackendEnum.CPU is already overridden by %s; leaving it",
                       current)
        return
    ours, described = _our_class_problems()
    if ours:
        logger.warning("app: not registering the CPU MLA prefill backend: %s", "; ".join(ours))
        return
    registry.register_mla_prefill_backend(member, VLLM_BACKEND_CLASS_PATH)
    logger.info("app: vLLM's CPU MLA prefill backend is now %s, running %s",
                VLLM_BACKEND_CLASS_PATH, described)
