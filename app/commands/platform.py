"""``python -m app platform``: the detected platform and which kernel packages import."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform as _pyplatform
from collections.abc import Sequence
from typing import Any

import torch

from app._cpu import apply_thread_count, avx512_emulation
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
    emulation = avx512_emulation()
    if emulation.requested:  # a testing switch: said on its own line whenever it is set
        info["cpu_avx512_emulation"] = emulation.line()
    info["cpu_native_kernel"] = cpu_native_kernel()
    info["cpu_bf16_kernel"] = cpu_bf16_kernel()
    info["cpu_decode_kernel"] = cpu_decode_kernel()
    info.update(cpu_amx_paths())
    info["kernel_packages"] = probe_kernel_packages()
    return info


def _with_notes(text: str, notes: Sequence[str]) -> str:
    """``text`` then ``; note: <what>`` for each loader note: a refused or read-only cache
    directory, an ignored verdict file are said whether or not the kernel loaded."""
    return text + "".join(f"; note: {note}" for note in dict.fromkeys(notes))


def cpu_native_kernel() -> str:
    """TORCH_SDPA's native CPU kernel: ``available (<library>)`` or ``unavailable: <why>``,
    then ``; note: <what>`` for each loader note (builds it on first use, ~1 s)."""
    from app.backends.cpu.prefill_kernel import native_kernel_status

    status = native_kernel_status()
    text = (f"available ({status.library})" if status.available
            else f"unavailable: {'; '.join(status.reasons)}")
    return _with_notes(text, status.notes)


def cpu_bf16_kernel() -> str:
    """The native kernel's bf16-products build (bf16 inputs on AVX512-BF16 CPUs):
    ``available (<library>)`` or ``unavailable: <why> (bf16 inputs use float32 math)``, then
    the loader's notes."""
    from app.backends.cpu.prefill_kernel_bf16 import native_bf16_kernel_status

    status = native_bf16_kernel_status()
    if status.available:
        return _with_notes(f"available ({status.library})", status.notes)
    return _with_notes(f"unavailable: {'; '.join(status.reasons)} (bf16 inputs use float32 "
                       f"math)", status.notes)


def cpu_decode_kernel() -> str:
    """CPU_MLA's native decode kernel: ``available (<library>), shares <on which threads>``
    (torch's OpenMP team, or the package's pool and why) or ``unavailable: <why>``, then the
    loader's notes."""
    from app.backends.decode.cpu_mla import decode_kernel_status

    status, shares = decode_kernel_status()
    if not status.available:
        return _with_notes(f"unavailable: {'; '.join(status.reasons)}", status.notes)
    return _with_notes(f"available ({status.path}), shares {shares}", status.notes)


def cpu_amx_paths() -> dict[str, str]:
    """AMX and the bf16 paths: ``cpu_amx`` (may this process use AMX tiles, or why not; with
    ``APP_CPU_AMX=0``, what the switch covers), ``cpu_decode_amx_kernel`` (CPU_MLA's AMX
    build: loaded, or why not), and which unit bf16 decode (``cpu_decode_bf16_path``) and
    prefill (``cpu_prefill_bf16_path``: the kernel, and the rule that chose it) run on, and
    why, under the switches as set; each native line ends with the loader's notes. Only a CPU
    with AMX builds or measures anything for these (a measurement is kept for the machine)."""
    from app.backends.cpu.amx import amx_status
    from app.backends.cpu.decode_kernel_amx import amx_decode_status
    from app.backends.cpu.kernel_paths import decode_kernel_path
    from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend

    tiles = amx_status()
    kernel = amx_decode_status()
    return {
        "cpu_amx": (f"{'available' if tiles.available else 'unavailable'}: {tiles.reason}"
                    + _onednn_note(tiles.reason)),
        "cpu_decode_amx_kernel": _with_notes(
            f"available ({kernel.reason}), shares {kernel.shares}" if kernel.available
            else f"unavailable: {kernel.reason}", kernel.notes),
        "cpu_decode_bf16_path": decode_kernel_path(torch.bfloat16),
        "cpu_prefill_bf16_path": TorchSDPAPrefillBackend.kernel_path(torch.bfloat16)}


def _onednn_note(reason: str) -> str:
    """With ``APP_CPU_AMX=0`` on an AMX CPU: what the switch does not cover (torch's own bf16
    matmuls, oneDNN's to decide) and whether ``ONEDNN_MAX_CPU_ISA`` caps them."""
    from app.backends.cpu.amx import AMX_ENV

    if reason != f"turned off by {AMX_ENV}=0":
        return ""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return (" (this package's kernels and TORCH_SDPA's bf16 prefill; torch's own bf16 matmuls "
            "are oneDNN's: " + (f"ONEDNN_MAX_CPU_ISA={cap} caps them, if set before "
                                "oneDNN's first use" if cap else
                                "set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 before starting "
                                "Python to keep them off AMX") + ")")


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
