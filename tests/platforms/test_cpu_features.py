"""CPU feature detection from /proc/cpuinfo (fake files here), not torch's capability string."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app import _cpu as cpu_features_module
from app._cpu.emulation import EMULATE_ENV
from app.cli import main
from app.model import default_compute_dtype
from app.platforms import CpuPlatform, detect_cpu_features, read_cpu_features
from app.platforms.cpu_features import parse_cpuinfo

# Flags lines of real CPUs (abridged to the interesting part, order kept).
EPYC_FLAGS = ("fpu vme sse sse2 avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl "
              "avx_vnni avx512_bf16 avx512vbmi avx512_vnni avx512_vpopcntdq")
SAPPHIRE_RAPIDS_FLAGS = ("fpu sse sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl "
                         "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8")
SKYLAKE_FLAGS = "fpu sse sse2 avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl"
HASWELL_FLAGS = "fpu sse sse2 avx fma avx2 f16c"


def cpuinfo(model: str, flags: str, processors: int = 2) -> str:
    return "\n".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\nmodel name\t: {model}\n"
                     f"flags\t\t: {flags}\n" for i in range(processors))


@pytest.fixture
def fake_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A /proc/cpuinfo of our own that the process-wide detection reads (cache reset)."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_features_module, "CPUINFO_PATH", path)
    monkeypatch.delenv(EMULATE_ENV, raising=False)  # the file's features, none emulated
    cpu_features_module._reset_for_tests()
    yield path
    cpu_features_module._reset_for_tests()


@pytest.mark.parametrize(("flags", "expected"), [
    (EPYC_FLAGS, ["avx512f", "avx512_bf16"]),
    (SAPPHIRE_RAPIDS_FLAGS, ["avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"]),
    (SKYLAKE_FLAGS, ["avx512f"]),
    (HASWELL_FLAGS, []),
])
def test_parse_cpuinfo_reads_the_flags(flags: str, expected: list[str]) -> None:
    features = parse_cpuinfo(cpuinfo("Some CPU", flags), "fake")
    assert features.present() == expected
    assert features.model_name == "Some CPU"
    assert features.source == "fake"
    assert features.fast_bfloat16 == ("avx512_bf16" in expected or "amx_bf16" in expected)
    assert features.fast_float16 == ("avx512_fp16" in expected)


def test_a_flag_must_match_whole_words() -> None:
    # "avx512_bf16" must not be read out of a longer or shorter flag.
    features = parse_cpuinfo(cpuinfo("X", "avx512f avx512_bf16x xavx512_fp16 amx_bf"))
    assert features.present() == ["avx512f"]


def test_no_flags_line_is_a_value_error() -> None:
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm\n"
    with pytest.raises(ValueError, match="expected a 'flags' line"):
        parse_cpuinfo(arm, "arm-cpuinfo")


def test_missing_or_flagless_file_falls_back_to_torch(tmp_path: Path) -> None:
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    for path in (tmp_path / "absent", arm):
        features = read_cpu_features(path)
        assert features.source == "none" or features.source.startswith("torch capability")
        assert not features.avx512_fp16  # torch's string cannot tell: never claimed


def test_has_fast_bfloat16_follows_the_cpu_not_torchs_string(
        fake_cpuinfo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch says "AVX512" on an EPYC with AVX512-BF16; the old detection read that as no bf16.
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    fake_cpuinfo.write_text(cpuinfo("AMD EPYC", EPYC_FLAGS))
    assert CpuPlatform().has_fast_bfloat16() is True
    assert detect_cpu_features().avx512_bf16
    assert detect_cpu_features().model_name == "AMD EPYC"
    assert default_compute_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert default_compute_dtype(torch.float16, "cpu") == torch.float32  # no AVX512-FP16

    cpu_features_module._reset_for_tests()
    fake_cpuinfo.write_text(cpuinfo("Intel Skylake", SKYLAKE_FLAGS))
    assert CpuPlatform().has_fast_bfloat16() is False
    assert default_compute_dtype(torch.bfloat16, "cpu") == torch.float32

    cpu_features_module._reset_for_tests()
    fake_cpuinfo.write_text(cpuinfo("Intel Xeon", SAPPHIRE_RAPIDS_FLAGS))
    assert CpuPlatform().has_fast_bfloat16() is True
    assert default_compute_dtype(torch.float16, "cpu") == torch.float16


def test_platform_command_lists_the_features(
        fake_cpuinfo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_cpuinfo.write_text(cpuinfo("Intel Xeon Fake", SAPPHIRE_RAPIDS_FLAGS))
    assert main(["platform", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    if data["platform"] != "cpu":  # pragma: no cover - a GPU machine
        pytest.skip("the detected platform is not the CPU")
    assert data["cpu_model"] == "Intel Xeon Fake"
    assert data["fast_bfloat16"] is True
    assert data["cpu_features"] == {"avx512f": True, "avx512_bf16": True, "amx_bf16": True,
                                    "avx512_fp16": True, "model_name": "Intel Xeon Fake",
                                    "source": str(fake_cpuinfo)}
    assert main(["platform"]) == 0
    out = capsys.readouterr().out
    assert "avx512f=yes avx512_bf16=yes amx_bf16=yes avx512_fp16=yes" in out
    assert "Intel Xeon Fake" in out


def test_platform_command_says_whether_bf16_products_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    from app.backends.cpu.prefill_kernel_bf16 import native_bf16_kernel_status

    assert main(["platform", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    status = native_bf16_kernel_status()
    assert data["cpu_bf16_kernel"].startswith("available" if status.available
                                              else "unavailable: ")
    if not status.available:
        assert "; ".join(status.reasons) in data["cpu_bf16_kernel"]


def test_this_machine_reads_consistently() -> None:
    features = detect_cpu_features()
    assert features == read_cpu_features()
    assert CpuPlatform().has_fast_bfloat16() == features.fast_bfloat16
