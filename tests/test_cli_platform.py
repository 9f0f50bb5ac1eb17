"""``python -m app platform``: text and JSON output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.backends.cpu.prefill_kernel import native_kernel_status
from app.cli import main
from app.commands.platform import cpu_amx_paths
from tests.backends.cpu._fake_cpu import (  # noqa: F401 - the fixture
    AVX2_ONLY,
    SAPPHIRE_RAPIDS,
    FakeCpu,
    fake_cpu,
)


def test_platform_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("platform", "device_type", "device_capability", "torch_version",
                "kernel_packages"):
        assert key in data
    assert data["torch_version"] == torch.__version__
    status = native_kernel_status()
    notes = "".join(f"; note: {note}" for note in dict.fromkeys(status.notes))
    assert data["cpu_native_kernel"] == (
        f"available ({status.library})" if status.available
        else f"unavailable: {'; '.join(status.reasons)}") + notes
    modules = {p["module"]: p for p in data["kernel_packages"]}
    assert set(modules) >= {"flashinfer", "tokenspeed_mla", "flash_attn", "flash_attn.cute"}
    for entry in modules.values():
        assert isinstance(entry["imports"], bool)
        assert (entry["error"] is None) == entry["imports"]


def test_platform_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform"]) == 0
    out = capsys.readouterr().out
    assert "platform" in out and "torch_version" in out and "imports" in out
    threads = [line for line in out.splitlines() if line.startswith("threads ")]
    assert len(threads) == 1 and f" {torch.get_num_threads()} (" in threads[0], out


@pytest.mark.parametrize("environ", [{"OMP_NUM_THREADS": "1"}, {}])
def test_platform_says_where_the_thread_count_came_from(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        environ: dict[str, str]) -> None:
    """The machine faked whole: as many CPUs in the affinity mask as torch runs threads,
    no cgroup files."""
    from app import _cpu as _threads

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    n = torch.get_num_threads()
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(n)))
    monkeypatch.setattr(_threads, "CGROUP_ROOT", tmp_path / "no-cgroup")
    monkeypatch.setattr(_threads, "PROC_SELF_CGROUP", tmp_path / "no-proc-self-cgroup")
    monkeypatch.setattr(_threads, "_applied", None)
    assert main(["platform", "--json"]) == 0
    threads = json.loads(capsys.readouterr().out)["threads"]
    assert threads["source"] == ("OMP_NUM_THREADS=1" if environ
                                 else f"affinity {n} CPU{'s' if n > 1 else ''}")
    assert threads["count"] == n  # OMP_NUM_THREADS set now: torch read it at its start
    assert threads["wait_policy"] == _threads.wait_policy()


@pytest.mark.slow
def test_module_entry_point_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "app", "platform", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["platform"] in ("cpu", "cuda")


def test_unknown_subcommand_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "--help" in err
    assert err.count("\n") == 1, err  # one line, no usage block


def test_the_loaders_notes_reach_every_kernel_line(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only or refused cache directory, an ignored verdict file: what the loader noted
    for a kernel's builds is said on that kernel's line, whether or not it loaded (issue 44).
    The loader answers from the statuses below: nothing is built, loaded or run."""
    from app.backends.cpu import (
        decode_kernel,
        decode_kernel_amx,
        loader,
        prefill_kernel,
        prefill_kernel_bf16,
    )
    from app.backends.cpu.amx import AmxStatus

    lines = {"cpu_native_kernel": (prefill_kernel.SPEC,),
             "cpu_bf16_kernel": (prefill_kernel_bf16.SPEC_BF16,),
             "cpu_decode_kernel": (decode_kernel.SPEC_OPENMP, decode_kernel.SPEC),
             "cpu_decode_amx_kernel": (decode_kernel_amx.SPEC_AMX_OPENMP,
                                       decode_kernel_amx.SPEC_AMX)}
    # Tiles granted, so that the AMX line asks the loader too (for statuses only).
    monkeypatch.setattr(decode_kernel_amx, "amx_status", lambda: AmxStatus(True, "granted"))
    try:
        for key, specs in lines.items():
            for spec in specs:
                note = f"{key}: cache directory /ro cannot take a build (Read-only file system)"
                loader._results[spec.name] = (spec, loader.NativeLibraryStatus(
                    False, (f"{spec.name} refused",), None, (note,)))
        assert main(["platform"]) == 0
        text = capsys.readouterr().out
        assert main(["platform", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    finally:
        for specs in lines.values():
            for spec in specs:
                loader.reset_native_libraries(spec.name)
    for key in lines:
        note = f"; note: {key}: cache directory /ro cannot take a build (Read-only file system)"
        assert data[key].endswith(note), data[key]
        [line] = [line for line in text.splitlines() if line.startswith(key + " ")]
        assert line.endswith(note)


@pytest.mark.slow
def test_platform_says_where_bf16_runs_with_amx_off(fake_cpu: FakeCpu,  # noqa: F811
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A (faked) AMX machine with APP_CPU_AMX=0: decode on the dot products, prefill on the
    native kernel, each with the rule that decided, and what the switch does not cover."""
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.decode_kernels()
    fake_cpu.prefill_kernels()
    monkeypatch.setenv("APP_CPU_AMX", "0")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    paths = cpu_amx_paths()
    assert paths["cpu_amx"] == (
        "unavailable: turned off by APP_CPU_AMX=0 (this package's kernels and TORCH_SDPA's "
        "bf16 prefill; torch's own bf16 matmuls are oneDNN's: set "
        "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 before starting Python to keep them off AMX)")
    assert paths["cpu_decode_amx_kernel"] == "unavailable: turned off by APP_CPU_AMX=0"
    assert paths["cpu_decode_bf16_path"].startswith("AVX512-BF16 dot products")
    assert paths["cpu_prefill_bf16_path"] == (
        "native kernel, bf16 products (vdpbf16ps): native (APP_CPU_AMX=0: aten's bf16 kernel "
        "would run on oneDNN's AMX tiles; not measured)")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 caps them" in cpu_amx_paths()["cpu_amx"]
    monkeypatch.setenv("APP_CPU_AMX", "1")
    paths = cpu_amx_paths()
    assert paths["cpu_amx"] == ("available: amx_tile and amx_bf16 present; Linux granted the "
                                "tile state")
    assert paths["cpu_decode_bf16_path"].startswith("AMX-BF16 tiles")


def test_platform_on_an_avx2_cpu_names_no_avx512(fake_cpu: FakeCpu) -> None:  # noqa: F811
    fake_cpu.flags(AVX2_ONLY)
    fake_cpu.decode_kernels(avx512=False)
    fake_cpu.prefill_kernels(native=False)
    line = cpu_amx_paths()["cpu_prefill_bf16_path"]
    assert line == ("aten's CPU flash kernel in float32 (AVX2 FMAs; bf16 converted: this CPU "
                    "has no AVX512-BF16 or AMX): aten (the only path here: native: "
                    "mla_prefill_cpu unavailable (faked))")
