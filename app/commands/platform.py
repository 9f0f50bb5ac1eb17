"""``python -m app platform``: the detected platform and which kernel packages import."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform as _pyplatform
from typing import Any

import torch

from app._threads import apply_thread_count
from app.commands._output import format_mapping, format_table, print_json, print_text

HELP = "show the detected platform, device capability, torch and kernel packages"

#: Optional kernel packages: (import name, distribution name).
KERNEL_PACKAGES: list[tuple[str, str]] = [
    ("flashinfer", "flashinfer-python"),
    ("tokenspeed_mla", "tokenspeed-mla"),
    ("flash_attn", "flash-attn"),
    ("flash_attn.cute", "flash-attn-4"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options beyond ``--json``."""


def probe_kernel_packages() -> list[dict[str, Any]]:
    """Try to import each optional kernel package; report version or the import error."""
    result = []
    for module_name, dist in KERNEL_PACKAGES:
        entry: dict[str, Any] = {"module": module_name, "distribution": dist}
        try:
            entry["version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            entry["version"] = None
        try:
            importlib.import_module(module_name)
        except Exception as exc:  # any failure to import means "not usable here"
            entry["imports"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        else:
            entry["imports"] = True
            entry["error"] = None
        result.append(entry)
    return result


def collect() -> dict[str, Any]:
    """Everything ``platform`` prints, as a dict."""
    from app.containers import get_container

    info = get_container().platform().describe()
    info["torch_version"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["python_version"] = _pyplatform.python_version()
    threads = apply_thread_count()
    info["threads"] = threads.as_dict()
    info["cpu_native_kernel"] = cpu_native_kernel()
    info["cpu_bf16_kernel"] = cpu_bf16_kernel()
    info["cpu_decode_kernel"] = cpu_decode_kernel()
    info.update(cpu_amx_paths())
    info["kernel_packages"] = probe_kernel_packages()
    return info


def cpu_native_kernel() -> str:
    """TORCH_SDPA's native CPU kernel: ``available (<library>)`` or ``unavailable: <why>``,
    then ``; note: <what>`` for each loader note (builds it on first use, ~1 s)."""
    from app.backends.cpu.prefill_kernel import native_kernel_status

    status = native_kernel_status()
    text = (f"available ({status.library})" if status.available
            else f"unavailable: {'; '.join(status.reasons)}")
    # A refused cache directory (not ours, or writable by others) is said even when a
    # fallback directory worked.
    return text + "".join(f"; note: {note}" for note in status.notes)


def cpu_bf16_kernel() -> str:
    """The native kernel's bf16-products build (bf16 inputs on AVX512-BF16 CPUs):
    ``available (<library>)`` or ``unavailable: <why> (bf16 inputs use float32 math)``."""
    from app.backends.cpu.prefill_kernel_bf16 import native_bf16_kernel_status

    status = native_bf16_kernel_status()
    if status.available:
        return f"available ({status.library})"
    return f"unavailable: {'; '.join(status.reasons)} (bf16 inputs use float32 math)"


def cpu_decode_kernel() -> str:
    """CPU_MLA's native decode kernel: ``available (<library>), shares <on which threads>``
    (torch's OpenMP team, or the package's pool and why) or ``unavailable: <why>``."""
    from app.backends.decode.cpu_mla import decode_kernel_status

    status, shares = decode_kernel_status()
    if not status.available:
        return f"unavailable: {'; '.join(status.reasons)}"
    return f"available ({status.path}), shares {shares}" + "".join(
        f"; note: {note}" for note in status.notes)


def cpu_amx_paths() -> dict[str, str]:
    """AMX and the bf16 paths: ``cpu_amx`` (may this process use AMX tiles, or why not),
    ``cpu_decode_amx_kernel`` (CPU_MLA's AMX build: loaded, or why not), and which unit
    bf16 decode (``cpu_decode_bf16_path``) and prefill (``cpu_prefill_bf16_path``) run on,
    and why. Only a CPU with AMX builds or measures anything for these."""
    from app.backends.cpu.amx import amx_status
    from app.backends.cpu.decode_kernel_amx import amx_decode_status
    from app.backends.cpu.kernel_paths import decode_kernel_path
    from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend

    tiles = amx_status()
    kernel = amx_decode_status()
    return {
        "cpu_amx": f"{'available' if tiles.available else 'unavailable'}: {tiles.reason}",
        "cpu_decode_amx_kernel": (f"available ({kernel.reason}), shares {kernel.shares}"
                                  if kernel.available else f"unavailable: {kernel.reason}"),
        "cpu_decode_bf16_path": decode_kernel_path(torch.bfloat16),
        "cpu_prefill_bf16_path": TorchSDPAPrefillBackend.kernel_path(torch.bfloat16)}


def run(args: argparse.Namespace) -> int:
    """Print the platform report."""
    info = collect()
    if args.json:
        print_json(info)
        return 0
    packages = info.pop("kernel_packages")
    features = info.get("cpu_features")
    if isinstance(features, dict):  # one readable line instead of a dict's repr
        from app.platforms.cpu_features import FEATURE_NAMES

        info["cpu_features"] = " ".join(
            f"{name}={'yes' if features[name] else 'no'}" for name in FEATURE_NAMES
        ) + f" (from {features['source']})"
    threads = info["threads"]
    info["threads"] = f"{threads['count']} ({threads['source']})"
    print_text(format_mapping(info))
    print_text()
    print_text(format_table(
        ["package", "version", "imports", "error"],
        [[p["module"], p["version"] or "-", "yes" if p["imports"] else "no", p["error"] or ""]
         for p in packages]))
    return 0
