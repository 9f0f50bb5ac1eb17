"""``python -m app bench selection``: the cost of choosing the MLA prefill backend.

- **cached**: ``get_mla_prefill_backend(config)`` once the selection is cached (the path an
  engine takes when it asks again); target <= 2 us.
- **uncached**: ``app.backends.selection.select_backend`` without a cache, so every call walks
  the whole priority list; target <= 200 us with all five classes validated.

It runs on a fresh container that pretends to be an SM100 GPU (so all five backends are in the
priority list). ``--backends stub`` (default) overrides the five backends with small stand-in
classes, the first four invalid for different reasons and ``TORCH_SDPA`` valid, so exactly five
classes are validated whatever is installed; ``--backends builtin`` uses the real classes (an
``ImportError`` counts as a validation). Informational extras: an explicit backend, the
container's ``mla_prefill_backend_class`` provider, and with ``--vllm-python PATH`` vLLM's
selector measured the same way in that interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform as _pyplatform
import subprocess
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import torch

from app._types import DeviceCapability, MLADimensions
from app.bench._timing import time_loop
from app.commands._args import positive_int

HELP = "cost of a cached and of an uncached MLA prefill backend selection"

#: Targets from the issue, in microseconds per call.
TARGET_CACHED_US = 2.0
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
                        help="also time vLLM's selector with this interpreter (optional)")


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


def _us(timing: dict[str, float]) -> dict[str, float]:
    return {"median_us": round(timing["median_s"] * 1e6, 4),
            "min_us": round(timing["min_s"] * 1e6, 4),
            "max_us": round(timing["max_s"] * 1e6, 4),
            "number": timing["number"], "repeat": timing["repeat"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time the cached and the uncached selection; the JSON result."""
    from app.backends.kinds import PREFILL
    from app.backends.registry import MLAPrefillBackendEnum, override_mla_prefill_backend
    from app.backends.selection import explain_selection, select_backend
    from app.backends.selector import get_mla_prefill_backend
    from app.config import EngineConfig
    from app.containers import create_container, use_container
    from app.platforms import platform_for_device

    number = max(1, int(args.number))
    uncached_number = max(1, number // 100)
    repeat = max(1, int(args.repeat))
    platform = platform_for_device("cuda", DeviceCapability(10, 0))
    config = EngineConfig()
    container = create_container(config, platform)
    backends = container.mla_prefill_backends()
    result: dict[str, Any] = {
        "benchmark": "selection",
        "backends": args.backends,
        "platform": repr(platform),
        "python": _pyplatform.python_version(),
        "torch": torch.__version__,
        "targets_us": {"cached": TARGET_CACHED_US, "uncached": TARGET_UNCACHED_US},
    }
    with use_container(container), contextlib.ExitStack() as stack:
        if args.backends == "stub":
            for name, cls in _stub_backends().items():
                stack.enter_context(override_mla_prefill_backend(MLAPrefillBackendEnum[name],
                                                                 cls))
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
        result["priorities"] = platform.mla_prefill_backend_priorities(
            _selector_config(config))

        def cached() -> object:
            return get_mla_prefill_backend(config)

        def uncached() -> object:
            return select_backend(PREFILL, config, platform, backends, None)

        cached_us = _us(time_loop(cached, number=number, repeat=repeat))
        uncached_us = _us(time_loop(uncached, number=uncached_number, repeat=repeat))
        if get_mla_prefill_backend(config) is not chosen:
            raise RuntimeError("the selection changed while it was being timed")

        explicit_config = EngineConfig.from_dict(
            {"attention": {"mla_prefill_backend": chosen_name}})
        get_mla_prefill_backend(explicit_config)
        extras = {
            "cached_explicit_backend": _us(time_loop(
                lambda: get_mla_prefill_backend(explicit_config), number=number,
                repeat=repeat)),
            "cached_via_container_provider": _us(time_loop(
                container.mla_prefill_backend_class, number=max(1, number // 4),
                repeat=repeat)),
        }
    result["cached"] = cached_us
    result["uncached"] = uncached_us
    result["informational"] = extras
    passed = {"cached": cached_us["median_us"] <= TARGET_CACHED_US,
              "uncached": uncached_us["median_us"] <= TARGET_UNCACHED_US}
    if result["validated_classes"] < 5:
        result["note"] = (f"only {result['validated_classes']} classes were validated on the "
                          f"uncached path (the target is for five)")
    result["pass"] = passed
    result["ok"] = all(passed.values())
    if args.vllm_python is not None:
        result["vllm"] = _time_vllm(args.vllm_python, number, uncached_number, repeat)
    return result


def _selector_config(config: Any) -> Any:
    from app.backends.prefill.base import MLAPrefillSelectorConfig

    return MLAPrefillSelectorConfig.from_engine_config(config)


#: Runs in vLLM's interpreter: its registry with four stand-ins (three invalid, TOKENSPEED_MLA
#: valid) on a pretend SM100 platform; cached = ``get_mla_prefill_backend``'s work on a cache
#: hit (selector config + ``@cache`` lookup), uncached = the platform's priority walk.
_VLLM_SCRIPT = textwrap.dedent("""
    import json, sys, time, statistics, functools
    import torch
    from vllm.platforms.interface import Platform, DeviceCapability
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend, MLADimensions
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum as E, register_mla_prefill_backend)
    from vllm.v1.attention.backends.mla.prefill import selector

    number, uncached_number, repeat = (int(a) for a in sys.argv[1:4])

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

    def loop(fn, n):
        per = []
        for _ in range(repeat):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            per.append((time.perf_counter() - t) / n * 1e6)
        return {"median_us": round(statistics.median(per), 4), "min_us": round(min(per), 4),
                "max_us": round(max(per), 4), "number": n, "repeat": repeat}

    import vllm
    sys.stdout.write(json.dumps({"vllm_version": vllm.__version__, "validated_classes": 4,
                                 "cached": loop(cached, number),
                                 "uncached": loop(uncached, uncached_number)}) + "\\n")
""")


def _time_vllm(python: Path, number: int, uncached_number: int, repeat: int) -> dict[str, Any]:
    if not python.exists():
        return {"error": f"{python} does not exist"}
    try:
        proc = subprocess.run(
            [str(python), "-c", _VLLM_SCRIPT, str(number), str(uncached_number), str(repeat)],
            capture_output=True, text=True, timeout=600, cwd="/tmp", check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    try:
        data: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"unexpected output: {lines[-1][:200]}"}
    data["note"] = ("vLLM's cached path on a hit: build the selector config, then its @cache "
                    "lookup; its uncached path walks its four-entry SM100 list (no TORCH_SDPA)")
    return data


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
            lines.append(f"vLLM {v['vllm_version']}: cached {v['cached']['median_us']:.3f} us, "
                         f"uncached {v['uncached']['median_us']:.3f} us")
    return "\n".join(lines)
