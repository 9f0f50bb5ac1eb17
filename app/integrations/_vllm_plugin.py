"""vLLM's general plugin for this package: our CPU MLA prefill and decode behind vLLM's registries.

vLLM runs every function of the ``vllm.general_plugins`` entry-point group once per process
(``vllm.plugins.load_general_plugins``). Ours, :func:`register_vllm_plugin`, checks that the
installed vLLM has the interface our adapters were written against (vLLM 0.32's CPU build:
:mod:`app.integrations._vllm_interface`), resolves our classes through our container once, and
then calls vLLM's own ``register_mla_prefill_backend(MLAPrefillBackendEnum.CPU, ...)`` and
``register_backend(AttentionBackendEnum.CPU_MLA, ...)``. When vLLM's interface differs it
registers nothing and logs why; where our decode kernel cannot run (no AVX-512, no C compiler)
only the prefill is replaced. It never raises (vLLM does not catch what a general plugin raises).

**AMX.** On a CPU with AMX tiles vLLM selects ``AMX_MLA``, its own AMX prefill and decode, which
bypass both registries, and which serve bfloat16 only (a float32 model fails there). Where our
decode is registered the plugin also wraps ``CpuPlatform.check_and_update_config``
(:mod:`app.integrations._vllm_amx`): models ``AMX_MLA`` cannot serve (float32, float16, a
non-auto KV cache) get ``CPU_MLA``, i.e. ours; bfloat16 stays on ``AMX_MLA`` until ours is
measured faster there (``APP_VLLM_AMX=ours``, or the engine option
``attention_backend="CPU_MLA"``, runs ours). Each config's decision is logged.

**One line per process** says what was replaced, on the logger ``vllm.plugins.app`` (under
vLLM's ``vllm`` logger, so it appears in vLLM's output). vLLM loads plugins before it sets up
its logging in an in-process engine (``EngineArgs.__post_init__``), so when nothing would show
the line yet it is kept and logged by the first of our classes vLLM builds in that process.

This module imports no vLLM at import time: ``import app`` never imports vLLM.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading

import app.integrations._vllm_backends as _vllm_backends
from app.integrations._vllm_amx import AMX_ENV, install_amx_routing
from app.integrations._vllm_interface import (
    DECODE_CLASS_PATH,
    PREFILL_CLASS_PATH,
    VLLM_VERIFIED_VERSION,
    vllm_interface_problems,
)

__all__ = [
    "VLLM_BACKEND_CLASS_PATH",
    "VLLM_DECODE_CLASS_PATH",
    "VLLM_ENTRY_POINT",
    "VLLM_VERIFIED_VERSION",
    "amx_note",
    "announce_pending",
    "register_vllm_plugin",
    "vllm_interface_problems",
]

#: The class vLLM imports for ``MLAPrefillBackendEnum.CPU`` once the plugin has run.
VLLM_BACKEND_CLASS_PATH = PREFILL_CLASS_PATH
#: The class vLLM imports for ``AttentionBackendEnum.CPU_MLA`` once the plugin has run.
VLLM_DECODE_CLASS_PATH = DECODE_CLASS_PATH
#: The entry point's name in the ``vllm.general_plugins`` group (what ``VLLM_PLUGINS`` lists).
VLLM_ENTRY_POINT = "app_cpu_mla"

logger = logging.getLogger("vllm.plugins.app")

_announce_lock = threading.Lock()
_pending: list[str] = []


def _can_show_info() -> bool:
    return logger.isEnabledFor(logging.INFO) and logger.hasHandlers()


def _announce(line: str) -> None:
    """Log ``line`` now if a handler would show it, else keep it for :func:`announce_pending`
    (the plugin's line: it replaces any kept one)."""
    with _announce_lock:
        _pending[:] = [line]
    announce_pending()


def _say(line: str) -> None:
    """Log ``line`` (a later one: the AMX routing's decision) now if a handler would show it,
    else keep it after the plugin's line."""
    with _announce_lock:
        _pending.append(line)
    announce_pending()


def announce_pending() -> None:
    """Log the plugin's kept lines, once, if vLLM's logging now shows INFO (our classes call
    this when vLLM builds them: by then vLLM has set up its logging in every engine)."""
    with _announce_lock:
        if not _pending or not _can_show_info():
            return
        lines = list(_pending)
        _pending.clear()
    for line in lines:
        logger.info("%s", line)


def amx_note(routing: str | None = "not installed") -> str | None:
    """What happens on this CPU if it has AMX tiles (vLLM's own check), else None.
    ``routing``: None when the AMX routing is installed, else why not."""
    try:
        import torch

        has_amx = bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # an old torch without the probe: no AMX path in vLLM either
        return None
    if not has_amx:
        return None
    if routing is None:
        return ("this CPU has AMX: vLLM's AMX_MLA (its own AMX prefill and decode, which "
                "bypass both registrations) keeps bfloat16 models until ours is measured "
                "faster there; models it cannot serve (float32, float16) get CPU_MLA, which "
                f"runs ours; {AMX_ENV}=ours or attention_backend='CPU_MLA' runs ours for all")
    return ("this CPU has AMX: vLLM selects AMX_MLA (its own AMX prefill and decode, which "
            "bypass both registrations) unless the engine is given "
            "attention_backend='CPU_MLA' (--attention-backend CPU_MLA), which runs ours "
            f"(the AMX routing is off: {routing})")


def register_vllm_plugin() -> None:
    """vLLM general plugin: make vLLM's CPU MLA prefill and decode ours.

    Registers :data:`VLLM_BACKEND_CLASS_PATH` for ``MLAPrefillBackendEnum.CPU`` and
    :data:`VLLM_DECODE_CLASS_PATH` for ``AttentionBackendEnum.CPU_MLA`` through vLLM's own
    registries when vLLM's interface is the one they were written against (vLLM 0.32 CPU);
    otherwise registers nothing and logs why. A member something else already overrides is
    left alone. Never raises. Turn it off with vLLM's allow-list: ``VLLM_PLUGINS`` not naming
    ``app_cpu_mla``.
    """
    try:
        _register()
    except Exception:  # vLLM calls general plugins unguarded: never take it down
        logger.exception("app: the CPU MLA plugin failed; vLLM keeps its own backends")


def _foreign_override(member: object, ours: str) -> str | None:
    """The class path another party registered for ``member``, if any."""
    current = member.get_path()  # type: ignore[attr-defined]
    if member.is_overridden() and current != ours:  # type: ignore[attr-defined]
        return str(current)
    return None


def _prefill_problems() -> tuple[list[str], str]:
    """Import our prefill class (vLLM's prefill base is light), resolve TORCH_SDPA once."""
    module_name, _, name = PREFILL_CLASS_PATH.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        if inspect.isabstract(cls):
            return [f"{PREFILL_CLASS_PATH} is abstract: {sorted(cls.__abstractmethods__)}"], ""
        return [], _vllm_backends.describe_prefill()
    except Exception as exc:  # our side must not take vLLM down either
        return [f"{PREFILL_CLASS_PATH} is not usable: {type(exc).__name__}: {exc}"], ""


def _decode_problems() -> tuple[list[str], str]:
    """Resolve CPU_MLA once (our decode class; vLLM's model code is not imported here)."""
    try:
        reason = _vllm_backends.decode_unavailable_reason()
        if reason is not None:
            return [reason], ""
        return [], _vllm_backends.describe_decode()
    except Exception as exc:
        return [f"our CPU_MLA decode is not usable: {type(exc).__name__}: {exc}"], ""


def _register() -> None:
    problems = vllm_interface_problems()
    if problems:
        logger.warning("app: not registering the CPU MLA prefill and decode backends (written "
                       "against vLLM %s CPU's interface): %s", VLLM_VERIFIED_VERSION,
                       "; ".join(problems))
        return
    prefill_registry = importlib.import_module("vllm.v1.attention.backends.mla.prefill.registry")
    registry = importlib.import_module("vllm.v1.attention.backends.registry")
    parts: list[str] = []
    prefill = prefill_registry.MLAPrefillBackendEnum.CPU
    if (other := _foreign_override(prefill, PREFILL_CLASS_PATH)) is not None:
        parts.append(f"vLLM's CPU MLA prefill is already overridden by {other}; left alone")
    elif (failed := _prefill_problems())[0]:
        parts.append(f"vLLM keeps its CPU MLA prefill: {'; '.join(failed[0])}")
    else:
        prefill_registry.register_mla_prefill_backend(prefill, PREFILL_CLASS_PATH)
        parts.append(f"vLLM's CPU MLA prefill (MLAPrefillBackendEnum.CPU) is now "
                     f"{PREFILL_CLASS_PATH}, running {failed[1]}")
    decode = registry.AttentionBackendEnum.CPU_MLA
    routing: str | None = "our CPU_MLA decode is not registered"
    if (other := _foreign_override(decode, DECODE_CLASS_PATH)) is not None:
        parts.append(f"CPU_MLA is already overridden by {other}; left alone")
    elif (failed := _decode_problems())[0]:
        parts.append(f"vLLM keeps its CPU_MLA decode: {'; '.join(failed[0])}")
    else:
        registry.register_backend(decode, DECODE_CLASS_PATH)
        parts.append(f"its CPU MLA decode (AttentionBackendEnum.CPU_MLA) is now "
                     f"{DECODE_CLASS_PATH}, running {failed[1]}")
        routing = install_amx_routing(say=_say) if amx_note() is not None else "no AMX"
    if (note := amx_note(routing)) is not None:
        parts.append(note)
    _announce("app: " + "; ".join(parts))
