"""What every attention backend declares about itself, shared by the prefill and decode bases.

A backend declares, as class attributes:

- ``name``: its name. A built-in takes it from its line in ``app.catalog`` (where every
  name is written once); a third-party backend sets it, or defines vLLM's ``get_name()``.
- ``supported_dtypes``: the input dtypes its kernels accept.
- ``compute_capabilities``: the GPUs its kernels run on (``ComputeCapabilities``), and
  ``requires_device_capability``: whether it needs a GPU at all (False: it also runs where there
  is no capability, on a CPU).
- ``supports_dense`` / ``supports_sparse``: which attention the kernels run: dense (every
  causal key) and / or DeepSeek Sparse Attention (each query attends to the cache rows its
  top-k indices name: the kinds' ``run_sparse_*`` verbs). A sparse model gets only backends
  that support sparse attention and a dense model only those that support dense attention
  (``sparsity_reasons``, the last reason of ``validate_configuration``; vLLM's ``is_sparse()``
  reads it).
- ``probe``: a function of no arguments that returns None (or False) when the kernel package is
  missing; ``install_hint``: what to install then; ``kernel_package``: the package's import
  name, asked instead of the probe where the device already rules the backend out (below).

The registry refuses a class whose declarations have the wrong type (``TypeError`` naming the
attribute, what is expected and what was given: ``declaration_problems()``), so one bad
override cannot break selection for a whole container. An availability check (the probe, or an
overridden ``is_available``) that raises is a reason, not a failure: the backend is reported
unavailable with the exception named (a CUDA library that fails to load raises ``OSError``).

The seed's classmethods (``get_name()``, ``supports_compute_capability()``, ``supports_dtype()``,
``is_available()``) read these attributes, and ``platform_reasons`` gives the first three reasons
of ``validate_configuration`` in their fixed order: capability, dtype, availability
(``platform_reason_slots``: the same, one list per slot). A backend
may still override any classmethod (vLLM's documentation shows ``get_name`` and
``is_available`` overridden that way).

Where the capability reason is already there (a GPU backend asked about a CPU, or a GPU its
kernels do not run on) and the backend declares ``kernel_package`` and keeps the base
``is_available``, the availability reason asks only whether the package is installed
(``importlib.util.find_spec``), without importing it: importing flashinfer to learn that it
cannot run on a CPU cost ~1 s of every CPU start-up where it is installed, and a GPU kernel
package has no business being imported on a host that cannot run it. The reasons are the
same, but for an installed package that fails to import: where the device rules the backend
out anyway, that is no longer reported.
"""

from __future__ import annotations

import importlib.util
from abc import ABC
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import ClassVar

import torch

from app._imports import object_path
from app._types import ANY_GPU, ComputeCapabilities, DeviceCapability
from app.catalog import CATALOGS

__all__ = [
    "DEFAULT_UNAVAILABLE_REASON",
    "BackendDeclarations",
    "DeclarationRule",
    "collection_of",
    "find_declaration_problems",
]

DEFAULT_UNAVAILABLE_REASON = "required dependencies not available"

#: ``(attribute, whether a value is acceptable, what is expected)``: one declaration's type.
DeclarationRule = tuple[str, Callable[[object], bool], str]


def collection_of(item: Callable[[object], bool]) -> Callable[[object], bool]:
    """A rule's check: a collection (tuple, list, set; not a string or a mapping) whose every
    item passes ``item``."""
    def check(value: object) -> bool:
        return (isinstance(value, Collection) and not isinstance(value, (str, bytes, Mapping))
                and all(item(v) for v in value))
    return check


def find_declaration_problems(cls: type, rules: Iterable[DeclarationRule]) -> list[str]:
    """``"<attribute> = <value>: expected <what>, got <type>"`` for every attribute of ``cls``
    that breaks its rule (empty: none)."""
    problems = []
    for attribute, ok, expected in rules:
        value = getattr(cls, attribute, None)
        if not ok(value):
            problems.append(f"{attribute} = {value!r}: expected {expected}, got "
                            f"{type(value).__name__}")
    return problems


_DECLARATIONS: tuple[DeclarationRule, ...] = (
    ("name", lambda v: v is None or (isinstance(v, str) and v != ""),
     "a non-empty string or None"),
    ("supported_dtypes", collection_of(lambda v: isinstance(v, torch.dtype)),
     "a tuple of torch.dtype"),
    ("compute_capabilities", lambda v: isinstance(v, ComputeCapabilities),
     "a ComputeCapabilities"),
    ("requires_device_capability", lambda v: isinstance(v, bool), "a bool"),
    ("probe", lambda v: v is None or callable(v),
     "a function of no arguments (in staticmethod()) or None"),
    ("install_hint", lambda v: isinstance(v, str), "a string"),
    ("kernel_package", lambda v: v is None or isinstance(v, str),
     "a package's import name (a string) or None"),
    ("supports_dense", lambda v: isinstance(v, bool), "a bool"),
    ("supports_sparse", lambda v: isinstance(v, bool), "a bool"),
)


class BackendDeclarations(ABC):  # noqa: B024 - abstract through the kinds' run methods
    """Class-level declarations of a backend; the kind's base adds its own dimension checks."""

    #: The backend's name (``"FLASHINFER"``, ``"CPU_MLA"``); built-ins take it from the catalog.
    name: ClassVar[str | None] = None
    #: Input dtypes the kernels accept.
    supported_dtypes: ClassVar[Sequence[torch.dtype]] = (torch.float16, torch.bfloat16)
    #: The GPUs the kernels run on.
    compute_capabilities: ClassVar[ComputeCapabilities] = ANY_GPU
    #: Whether the backend needs a GPU compute capability (False: runs where it is None).
    requires_device_capability: ClassVar[bool] = False
    #: Called with no arguments; None or False means the kernel package is missing. None: the
    #: backend is always available.
    probe: ClassVar[Callable[[], object] | None] = None
    #: The reason given when the probe finds nothing (an install hint, ideally).
    install_hint: ClassVar[str] = DEFAULT_UNAVAILABLE_REASON
    #: The kernel package's top-level import name (``"flashinfer"``), or None: see the module.
    kernel_package: ClassVar[str | None] = None
    #: Whether the kernels run dense attention (every causal key).
    supports_dense: ClassVar[bool] = True
    #: Whether the kernels run DeepSeek Sparse Attention (the kind's ``run_sparse_*`` verb).
    supports_sparse: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in vars(cls):
            for catalog in CATALOGS.values():
                builtin = catalog.name_of(object_path(cls))
                if builtin is not None:
                    cls.name = builtin
                    break

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """What is wrong with the class's declarations, one line per attribute
        (``"supported_dtypes = None: expected a tuple of torch.dtype, got NoneType"``); empty
        when nothing is. The registry refuses a class with any (``TypeError``); a kind's base
        adds its own attributes."""
        return find_declaration_problems(cls, _DECLARATIONS)

    @classmethod
    def get_name(cls) -> str:
        """The backend's name (``name``); ``TypeError`` when the class declares none."""
        if not cls.name:
            raise TypeError(f"{object_path(cls)} declares no backend name: set the class "
                            f"attribute name = 'MY_BACKEND' or define get_name()")
        return cls.name

    @classmethod
    def supports_compute_capability(cls, device_capability: DeviceCapability) -> bool:
        """Whether the kernels run on a GPU of this capability (``compute_capabilities``)."""
        return device_capability in cls.compute_capabilities

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        """Whether ``dtype`` is in ``supported_dtypes``."""
        return dtype in cls.supported_dtypes

    @classmethod
    def is_sparse(cls) -> bool:
        """vLLM's name for ``supports_sparse``: whether the backend runs sparse attention."""
        return bool(cls.supports_sparse)

    @classmethod
    def sparsity_reasons(cls, index_topk: int | None) -> list[str]:
        """The reason this backend cannot run a model's attention pattern (empty: it can):
        ``index_topk`` is the model's (None: a dense model). vLLM's words first."""
        if index_topk is not None and not cls.supports_sparse:
            return [f"sparse not supported: the model uses DeepSeek Sparse Attention "
                    f"(index_topk={index_topk}) and this backend runs dense attention only"]
        if index_topk is None and not cls.supports_dense:
            return ["non-sparse not supported: this backend runs only DeepSeek Sparse "
                    "Attention and the model is dense (no index_topk)"]
        return []

    @classmethod
    def is_available(cls) -> bool:
        """Whether the kernel package / native kernel is usable (``probe``, asked on every
        call, never assumed at module import)."""
        probe = cls.probe
        if probe is None:
            return True
        found = probe()
        return found is not None and found is not False

    @classmethod
    def unavailable_reason(cls) -> str:
        """The reason given when ``is_available()`` is False (``install_hint``)."""
        return cls.install_hint

    @classmethod
    def platform_reasons(cls, device_capability: DeviceCapability | None,
                         dtype: torch.dtype) -> list[str]:
        """The first reasons of ``validate_configuration``, in order: capability, dtype,
        availability."""
        capability, dtypes, availability = cls.platform_reason_slots(device_capability, dtype)
        return capability + dtypes + availability

    @classmethod
    def platform_reason_slots(cls, device_capability: DeviceCapability | None,
                              dtype: torch.dtype) -> tuple[list[str], list[str], list[str]]:
        """``platform_reasons`` by slot: (capability, dtype, availability), at most one reason
        in each, for a subclass that adds reasons of its own to a slot."""
        capability: list[str] = []
        if device_capability is None:
            if cls.requires_device_capability:
                capability.append("device capability not available")
        elif not cls.supports_compute_capability(device_capability):
            capability.append(f"compute capability {device_capability.major}."
                              f"{device_capability.minor} not supported")
        dtypes = [] if cls.supports_dtype(dtype) else [f"dtype {dtype} not supported"]
        try:
            available = cls.available_for_reasons(bool(capability))
        except Exception as exc:  # a third party's probe: any failure means "not available"
            message = " ".join(str(exc).split())
            return capability, dtypes, [f"availability check raised {type(exc).__name__}"
                                        f"{': ' if message else ''}{message}"]
        return capability, dtypes, [] if available else [cls.unavailable_reason()]

    @classmethod
    def available_for_reasons(cls, ruled_out: bool) -> bool:
        """Whether no availability reason is due: ``is_available()``, or where the device
        already rules the backend out (``ruled_out``: a capability reason was given) and it
        declares ``kernel_package``, whether that package is installed (see the module)."""
        return cls._installed() if ruled_out and cls._asks_package() else cls.is_available()

    @classmethod
    def _asks_package(cls) -> bool:
        """Whether availability may be read off the installed packages (see the module): a
        ``kernel_package`` is declared, ``is_available`` is the base one, and no subclass
        swapped the probe without naming its package."""
        base = vars(BackendDeclarations)["is_available"].__func__
        if cls.kernel_package is None or getattr(cls.is_available, "__func__", None) is not base:
            return False
        for klass in cls.__mro__:
            if "kernel_package" in vars(klass):
                return True
            if "probe" in vars(klass):
                return False
        return False

    @classmethod
    def _installed(cls) -> bool:
        """Whether ``kernel_package`` is installed: found on the path, not imported."""
        try:
            return importlib.util.find_spec(str(cls.kernel_package)) is not None
        except (ImportError, ValueError):  # a broken or half-removed install
            return False
