"""Our backend classes behind vLLM's CPU MLA hooks, resolved through a container once per process.

vLLM builds its prefill backend and its attention impl once per layer; each of our adapters asks
this module for our class. The first ask in a process resolves it through the active container
(``mla_prefill_backends.TORCH_SDPA`` for prefill, ``mla_decode_backends.CPU_MLA`` for decode;
the general plugin makes that first ask at vLLM's start-up), and every later ask gets the kept
class: nothing resolves through the container per layer or per step. An engine with its own
container binds it with :func:`bind_container`.

This module imports no vLLM: the plugin uses it before vLLM's model code is importable.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Literal

from app.backends.cpu.prefill_kernel import native_kernel_status
from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.cpu_mla import CpuMLADecodeBackend, decode_kernel_status
from app.backends.prefill.base import MLAPrefillBackend
from app.containers import get_container

if TYPE_CHECKING:
    from app.containers import Application

__all__ = ["DECODE_BACKEND", "KINDS", "PREFILL_BACKEND", "Kind", "bind_container",
           "decode_backend_class", "decode_unavailable_reason", "describe_decode",
           "describe_prefill", "prefill_backend_class"]

#: Our backend behind vLLM's ``MLAPrefillBackendEnum.CPU``.
PREFILL_BACKEND = "TORCH_SDPA"
#: Our backend behind vLLM's ``AttentionBackendEnum.CPU_MLA`` (its decode).
DECODE_BACKEND = "CPU_MLA"
Kind = Literal["prefill", "decode"]
#: The kinds of backend bound: vLLM's prefill and its decode.
KINDS: tuple[Kind, ...] = ("prefill", "decode")

_lock = threading.Lock()
_resolved: dict[Kind, type] = {}


def _resolve(container: Application, kind: Kind) -> type:
    group, name, base = (("mla_prefill_backends", PREFILL_BACKEND, MLAPrefillBackend)
                         if kind == "prefill" else
                         ("mla_decode_backends", DECODE_BACKEND, MLADecodeBackend))
    backends = getattr(container, group, None)
    if backends is None:
        raise TypeError(f"expected an app.containers.Application, got "
                        f"{type(container).__name__}")
    cls = getattr(backends, name)()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"the container's {name} {kind} provider gave {cls!r}, expected an "
                        f"{base.__module__}.{base.__qualname__} subclass")
    return cls


def _get(kind: Kind) -> type:
    with _lock:
        cls = _resolved.get(kind)
        if cls is None:
            cls = _resolved[kind] = _resolve(get_container(), kind)
        return cls


def prefill_backend_class() -> type[MLAPrefillBackend]:
    """Our prefill class (TORCH_SDPA): resolved through the active container on the first
    call in the process, then kept."""
    cls: type[MLAPrefillBackend] = _get("prefill")
    return cls


def decode_backend_class() -> type[MLADecodeBackend]:
    """Our decode class (CPU_MLA): resolved through the active container on the first call
    in the process, then kept."""
    cls: type[MLADecodeBackend] = _get("decode")
    return cls


def bind_container(container: Application, kind: Kind | None = None) -> None:
    """Resolve our class of ``kind`` (both when None) through ``container`` now and keep it:
    an engine that builds its own container calls this once at start-up; vLLM's layers
    built later use it (``TypeError`` when ``container`` is not an ``Application``,
    ``ValueError`` for a ``kind`` other than ``"prefill"``, ``"decode"`` or None)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"bind_vllm_container: kind must be one of {list(KINDS)} or None "
                         f"(both), got {kind!r}")
    kinds: tuple[Kind, ...] = KINDS if kind is None else (kind,)
    classes = {k: _resolve(container, k) for k in kinds}
    with _lock:
        _resolved.update(classes)


def describe_prefill() -> str:
    """Our prefill class and the CPU kernel it runs here (the native one, or aten's and why)."""
    cls = prefill_backend_class()
    status = native_kernel_status()
    kernel = (f"native CPU kernel {status.library}" if status.available else
              f"aten CPU kernel (native kernel: {'; '.join(status.reasons)})")
    return f"{cls.__module__}.{cls.__qualname__} ({PREFILL_BACKEND}, {kernel})"


def decode_unavailable_reason() -> str | None:
    """Why our decode class cannot run here (None: it can)."""
    cls = decode_backend_class()
    return None if cls.is_available() else cls.unavailable_reason()


def describe_decode() -> str:
    """Our decode class and the kernel it runs here."""
    cls = decode_backend_class()
    where = f"{cls.__module__}.{cls.__qualname__} ({cls.get_name()}"
    if issubclass(cls, CpuMLADecodeBackend) and cls.is_available():
        return f"{where}, native CPU kernel {decode_kernel_status()[0].path})"
    return f"{where})"
