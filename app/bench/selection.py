"""``python -m app bench selection``: the cost of choosing the MLA prefill backend.

- **cached**: ``get_mla_prefill_backend(config)`` once it has answered (the seed API's path
  when it is asked again); target <= 0.5 us.
- **uncached**: ``app.backends.selection.select_backend`` without a cache, so every call walks
  the whole priority list; target <= 200 us with all five classes validated.

It runs on a fresh container that pretends to be an SM100 GPU (so all five backends are in the
priority list). ``--backends stub`` (default) overrides the five backends with small stand-in
classes, the first four invalid for different reasons and ``TORCH_SDPA`` valid, so exactly five
classes are validated whatever is installed; ``--backends builtin`` uses the real classes (an
``ImportError`` counts as a validation). Informational extras: an explicit backend, the
container's ``mla_prefill_backend_class`` provider, and ``uncached_like_vllm``: the uncached walk
over the same four stand-ins vLLM's side uses (three invalid, ``TOKENSPEED_MLA`` valid).

With ``--vllm-python PATH`` vLLM's selector is timed the same way in that interpreter, round by
round with ours (``app.bench._timing.InterpreterLoops``), so that load on a shared machine hits
both alike; ``vllm.ours_vs_vllm`` gives the ratios (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform as _pyplatform
import statistics
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from app._types import DeviceCapability, MLADimensions
from app.bench._timing import InterpreterLoops
from app.commands._args import positive_int

HELP = "cost of a cached and of an uncached MLA prefill backend selection"

#: Targets from the issue, in microseconds per call.
TARGET_CACHED_US = 0.5
TARGET_UNCACHED_US = 200.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--backends``, ``--number``, ``--repeat`` and ``--vllm-python``."""
    parser.add_argument("--backends", choices=("stub", "builtin"), default="stub",
                        help="stand-in classes (five validated whatever is installed) or the "
                             "real built-in classes")
    parser.add_argument("--number", type=positive_int, default=200_000,
                        help="calls per timed loop for the cached path (uncached: /100)")
    parser.add_argument("--repeat", type=positive_int, default=7,
                        help="timed loops; the median counts")
    parser.add_argument("--vllm-python", type=Path, default=None, metavar="PATH",
                        help="also time vLLM's selector with this interpreter, round by round "
                             "with ours (optional)")


def _stub_backends() -> dict[str, type[Any]]:
    """Five stand-in backends: four invalid (capability, dtype, availability, dimensions), then
    a valid ``TORCH_SDPA``."""
    from app.testing import SelectionOnlyBackend

    class _Stub(SelectionOnlyBackend):
        @staticmethod
        def get_name() -> str:
            return "STUB"

    class WrongCapability(_Stub):
        @classmethod
        def supports_compute_capability(cls, device_capability: DeviceCapability) -> bool:
            return device_capability.major == 9

    class WrongDtype(_Stub):
        supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16,)

    class Unavailable(_Stub):
        @classmethod
        def is_available(cls) -> bool:
            return False

    class WrongDimensions(_Stub):
        supported_mla_dimensions: ClassVar[tuple[MLADimensions, ...]] = (
            MLADimensions(qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256),)

    class Valid(_Stub):
        pass

    return {"FLASH_ATTN": WrongCapability, "TRTLLM_RAGGED": WrongDtype,
            "FLASHINFER": Unavailable, "TOKENSPEED_MLA": WrongDimensions, "TORCH_SDPA": Valid}


def _like_vllm_backends() -> dict[str, type[Any]]:
    """The four stand-ins vLLM's side uses: three invalid (capability, dtype, availability),
    then a valid ``TOKENSPEED_MLA``: the same work as vLLM's uncached walk."""
    stubs = _stub_backends()
    return {"FLASH_ATTN": stubs["FLASH_ATTN"], "TRTLLM_RAGGED": stubs["TRTLLM_RAGGED"],
            "FLASHINFER": stubs["FLASHINFER"], "TOKENSPEED_MLA": stubs["TORCH_SDPA"]}


def _summary(per_call_s: list[float], number: int) -> dict[str, float]:
    return {"median_us": round(statistics.median(per_call_s) * 1e6, 4),
            "min_us": round(min(per_call_s) * 1e6, 4),
            "max_us": round(max(per_call_s) * 1e6, 4),
            "number": number, "repeat": len(per_call_s)}


def _seconds_per_call(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def _override(stack: contextlib.ExitStack, backends: dict[str, type[Any]]) -> None:
    """Override each named backend of the active container until ``stack`` closes."""
    from app.seed_api import MLAPrefillBackendEnum, override_mla_prefill_backend

    for name, cls in backends.items():
        stack.enter_context(override_mla_prefill_backend(MLAPrefillBackendEnum[name], cls))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time the cached and the uncached selection (round by round with vLLM's when
    ``--vllm-python`` is given); the JSON result."""
    from app.backends.registry import PREFILL
    from app.backends.selection import explain_selection, select_backend
    from app.config import EngineConfig
    from app.containers import create_container, use_container
    from app.platforms import platform_for_device
    from app.seed_api import get_mla_prefill_backend

    number = max(1, int(args.number))
    uncached_number = max(1, number // 100)
    repeat = max(1, int(args.repeat))
    platform = platform_for_device("cuda", DeviceCapability(10, 0))
    config = EngineConfig()
    container, like_vllm = create_container(config, platform), create_container(config, platform)
    backends, like_vllm_backends = (container.mla_prefill_backends(),
                                    like_vllm.mla_prefill_backends())
    result: dict[str, Any] = {
        "benchmark": "selection", "backends": args.backends, "platform": repr(platform),
        "python": _pyplatform.python_version(), "torch": torch.__version__,
        "targets_us": {"cached": TARGET_CACHED_US, "uncached": TARGET_UNCACHED_US},
    }
    with contextlib.ExitStack() as stack:
        worker = None if args.vllm_python is None else _start_vllm(args.vllm_python, result)
        if worker is not None:
            stack.callback(worker.close)
        with use_container(like_vllm):
            _override(stack, _like_vllm_backends())
        stack.enter_context(use_container(container))
        if args.backends == "stub":
            _override(stack, _stub_backends())
        try:
            chosen = get_mla_prefill_backend(config)
        except ValueError as exc:
            result.update(ok=False, error=str(exc))
            return result
        explanation = explain_selection(PREFILL, config, platform, backends)
        chosen_name = explanation["chosen"]
        result["chosen"] = chosen_name
        result["validated_classes"] = (explanation["priorities"].index(chosen_name) + 1
                                       if chosen_name is not None else 0)
        result["priorities"] = explanation["priorities"]
        explicit_config = EngineConfig.from_dict(
            {"attention": {"mla_prefill_backend": chosen_name}})
        loops: dict[str, tuple[Callable[[], object], int]] = {
            "cached": (lambda: get_mla_prefill_backend(config), number),
            "uncached": (lambda: select_backend(PREFILL, config, platform, backends, None),
                         uncached_number),
            "uncached_like_vllm": (lambda: select_backend(
                PREFILL, config, platform, like_vllm_backends, None), uncached_number),
            "cached_explicit_backend": (lambda: get_mla_prefill_backend(explicit_config),
                                        number),
            "cached_via_container_provider": (container.mla_prefill_backend_class,
                                              max(1, number // 4)),
        }
        samples = _time_rounds(loops, worker, repeat)
        if get_mla_prefill_backend(config) is not chosen:
            raise RuntimeError("the selection changed while it was being timed")
    for key in ("cached", "uncached"):
        result[key] = _summary(samples[key], loops[key][1])
    result["informational"] = {key: _summary(samples[key], loops[key][1])
                               for key in loops if key not in ("cached", "uncached")}
    if worker is not None:
        _compare(result, samples, loops)
    passed = {"cached": result["cached"]["median_us"] <= TARGET_CACHED_US,
              "uncached": result["uncached"]["median_us"] <= TARGET_UNCACHED_US}
    if result["validated_classes"] < 5:
        result["note"] = (f"only {result['validated_classes']} classes were validated on the "
                          f"uncached path (the target is for five)")
    result["pass"] = passed
    result["ok"] = all(passed.values())
    return result


#: The loops vLLM's side times, by the name of ours they are compared with.
_THEIRS = ("cached", "uncached")


def _time_rounds(loops: dict[str, tuple[Callable[[], object], int]],
                 worker: InterpreterLoops | None, repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each loop, ``repeat`` rounds; in each round vLLM's loop of the same
    name runs right after ours."""
    samples: dict[str, list[float]] = {key: [] for key in loops}
    samples.update({f"vllm_{key}": [] for key in _THEIRS})
    for fn, _ in loops.values():
        fn()
    for _ in range(repeat):
        for key, (fn, n) in loops.items():
            samples[key].append(_seconds_per_call(fn, n))
            if worker is not None and key in _THEIRS:
                samples[f"vllm_{key}"].append(worker.seconds(key, n) / n)
    return samples


def _compare(result: dict[str, Any], samples: dict[str, list[float]],
             loops: dict[str, tuple[Callable[[], object], int]]) -> None:
    vllm = result["vllm"]
    for key in _THEIRS:
        vllm[key] = _summary(samples[f"vllm_{key}"], loops[key][1])
    same_four = result["informational"]["uncached_like_vllm"]["median_us"]
    vllm["ours_vs_vllm"] = {
        "cached_speedup": round(vllm["cached"]["median_us"] / result["cached"]["median_us"], 2),
        "uncached_speedup_same_four_classes": round(vllm["uncached"]["median_us"] / same_four,
                                                    2),
        "uncached_speedup_our_five_classes": round(
            vllm["uncached"]["median_us"] / result["uncached"]["median_us"], 2)}


def _start_vllm(python: Path, result: dict[str, Any]) -> InterpreterLoops | None:
    """vLLM's timing loops in ``python``, or None (the reason in ``result["vllm"]``)."""
    if not python.exists():
        result["vllm"] = {"error": f"{python} does not exist"}
        return None
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
    try:
        worker = InterpreterLoops(str(python), _VLLM_SCRIPT, env=env)
    except (OSError, RuntimeError) as exc:
        result["vllm"] = {"error": f"{type(exc).__name__}: {exc}"}
        return None
    result["vllm"] = {**worker.info, "note": (
        "vLLM's cached path on a hit: build the selector config, then its @cache lookup; its "
        "uncached path walks its four-entry SM100 list (no TORCH_SDPA); timed round by round "
        "with ours")}
    return worker


#: Runs in vLLM's interpreter: its registry with four stand-ins (three invalid, TOKENSPEED_MLA
#: valid) on a pretend SM100 platform; cached = ``get_mla_prefill_backend``'s work on a cache
#: hit (selector config + ``@cache`` lookup), uncached = the platform's priority walk. Defines
#: the ``LOOPS`` and ``INFO`` that ``InterpreterLoops`` serves.
_VLLM_SCRIPT = textwrap.dedent("""
    import functools
    import torch
    import vllm
    from vllm.platforms.interface import Platform, DeviceCapability
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend, MLADimensions
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum as E, register_mla_prefill_backend)
    from vllm.v1.attention.backends.mla.prefill import selector

    class Stub(MLAPrefillBackend):
        @staticmethod
        def get_name(): return "STUB"
        def run_prefill_new_tokens(self, *a, **k): raise NotImplementedError
        def run_prefill_context_chunk(self, *a, **k): raise NotImplementedError
    class WrongCapability(Stub):
        @classmethod
        def supports_compute_capability(cls, cap): return cap.major == 9
    class WrongDtype(Stub):
        supported_dtypes = [torch.float16]
    class Unavailable(Stub):
        @classmethod
        def is_available(cls): return False
    class Valid(Stub):
        pass
    for member, cls in ((E.FLASH_ATTN, WrongCapability), (E.TRTLLM_RAGGED, WrongDtype),
                        (E.FLASHINFER, Unavailable), (E.TOKENSPEED_MLA, Valid)):
        register_mla_prefill_backend(member, "__main__." + cls.__name__)

    class SM100(Platform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(10, 0)

    dims = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    if SM100.get_mla_prefill_backend_cls(selector.MLAPrefillSelectorConfig(
            dtype=torch.bfloat16, mla_dimensions=dims)) is not Valid:
        raise SystemExit("vLLM's selector did not pick the stand-in backend")

    @functools.cache
    def auto_select(sc):
        return SM100.get_mla_prefill_backend_cls(sc)

    def cached():
        sc = selector.MLAPrefillSelectorConfig(
            dtype=torch.bfloat16, mla_dimensions=MLADimensions(
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
        return auto_select(sc)

    def uncached():
        auto_select.cache_clear()
        return cached()

    LOOPS = {"cached": cached, "uncached": uncached}
    INFO = {"vllm_version": vllm.__version__, "validated_classes": 4}
""")


def render(result: dict[str, Any]) -> str:
    """A short readable summary."""
    if "error" in result:
        return f"selection benchmark failed: {result['error']}"
    lines = [
        f"platform {result['platform']}, backends: {result['backends']}, chosen "
        f"{result['chosen']}, {result['validated_classes']} classes validated when uncached",
    ]
    for key, target in (("cached", TARGET_CACHED_US), ("uncached", TARGET_UNCACHED_US)):
        t = result[key]
        verdict = "pass" if result["pass"][key] else "FAIL"
        lines.append(f"{key:9s} {t['median_us']:9.3f} us/call (min {t['min_us']:.3f}); "
                     f"target <= {target:g} us: {verdict}")
    for key, t in result["informational"].items():
        lines.append(f"  {key}: {t['median_us']:.3f} us/call")
    if "vllm" in result:
        v = result["vllm"]
        if "error" in v:
            lines.append(f"vLLM: {v['error']}")
        else:
            ratios = v["ours_vs_vllm"]
            lines.append(f"vLLM {v['vllm_version']} (round by round with ours): cached "
                         f"{v['cached']['median_us']:.3f} us (ours {ratios['cached_speedup']}x "
                         f"faster), uncached {v['uncached']['median_us']:.3f} us (ours on the "
                         f"same four classes {ratios['uncached_speedup_same_four_classes']}x "
                         f"faster)")
    return "\n".join(lines)
