"""``python -m app backends`` and ``python -m app bench selection``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dependency_injector import providers

from app.backends import MLAPrefillBackendEnum, register_mla_prefill_backend
from app.cli import main
from app.containers import Application
from app.platforms import CpuPlatform
from app.testing import SelectionOnlyBackend
from tests.backends.cpu._fake_cpu import SAPPHIRE_RAPIDS, FakeCpu, fake_cpu  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


class CliBackend(SelectionOnlyBackend):
    @staticmethod
    def get_name() -> str:
        return "CLI"



@pytest.fixture
def cpu_with_stub(app_container: Application) -> Application:
    app_container.platform.override(providers.Object(CpuPlatform()))
    register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, CliBackend)
    return app_container


def test_json_explains_every_member(cpu_with_stub: Application,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(MLAPrefillBackendEnum.__members__) <= set(info["backends"])
    assert info["chosen"] == "TORCH_SDPA"
    assert info["chosen_class"] == f"{__name__}.CliBackend"
    assert info["priorities"] == ["TORCH_SDPA"]
    assert info["backends"]["TORCH_SDPA"] == {
        "name": "TORCH_SDPA", "class_path": f"{__name__}.CliBackend", "overridden": True,
        "priority": 0, "valid": True, "reasons": []}
    assert info["error"] is None


def test_table(cpu_with_stub: Application, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "valid" in out and "reasons" in out
    for name in ["TORCH_SDPA", "FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TOKENSPEED_MLA",
                 "CUSTOM"]:
        assert name in out
    assert f"chosen: TORCH_SDPA ({__name__}.CliBackend)" in out
    assert "(overridden)" in out and "(unregistered)" in out


def test_explicit_backend_and_dtype(cpu_with_stub: Application,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json", "--backend", "torch_sdpa", "--dtype", "fp32"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["requested"] == "TORCH_SDPA" and info["dtype"] == "float32"
    assert info["chosen"] is None
    assert info["error"] == ("Selected MLA prefill backend TORCH_SDPA is not valid for this "
                             "configuration. Reason: ['dtype torch.float32 not supported']")
    assert main(["backends", "--backend", "TORCH_SDPA", "--dtype", "float16"]) == 0
    assert "requested          TORCH_SDPA" in capsys.readouterr().out


def test_unregistered_explicit_backend_exits_1(cpu_with_stub: Application,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--backend", "CUSTOM"]) == 1
    out = capsys.readouterr().out
    assert "chosen: none" in out and "must be registered before use" in out


def test_capability_and_dimensions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--json", "--capability", "10.0", "--mla-dimensions",
                 "192,64,256"]) in (0, 1)
    info = json.loads(capsys.readouterr().out)
    assert info["device_capability"] == "10.0"
    assert info["priorities"][0] == "TRTLLM_RAGGED"
    assert info["mla_dimensions"] == {"qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                                      "v_head_dim": 256}
    assert main(["backends", "--json", "--capability", "cpu"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["priorities"] == ["TORCH_SDPA"]


@pytest.mark.parametrize(("cache", "path"), [
    ("auto", "AMX-BF16 tiles (self-test passed"),
    ("fp8_ds_mla", "AVX512-BF16 dot products (vdpbf16ps, float32 sums) on bf16 tiles "
                   "dequantised from the fp8_ds_mla rows; AMX not used"),
    ("fp8", "AVX512-BF16 dot products (vdpbf16ps, float32 sums) on bf16 tiles dequantised "
            "from the fp8_e4m3 rows"),
])
def test_the_kernel_path_follows_the_cache_dtype(app_container: Application,
                                                 fake_cpu: FakeCpu,  # noqa: F811
                                                 capsys: pytest.CaptureFixture[str],
                                                 cache: str, path: str) -> None:
    """On a (faked) AMX CPU, bf16 rows run on the tiles but FP8 rows on the AVX512-BF16 dot
    products: the line must say so, as the backend decides it (kernel_paths.decode_unit)."""
    fake_cpu.flags(SAPPHIRE_RAPIDS)
    fake_cpu.decode_kernels()
    app_container.platform.override(providers.Object(CpuPlatform()))
    assert main(["backends", "--kind", "decode", "--dtype", "bfloat16",
                 "--kv-cache-dtype", cache]) == 0
    out = capsys.readouterr().out
    assert "chosen: CPU_MLA" in out
    assert f"kernel path: {path}" in out


@pytest.mark.parametrize("argv, fragment", [
    (["--backend", "NOPE"], "Unknown MLA prefill backend: 'NOPE'"),
    (["--dtype", "int3"], "unknown dtype name"),
    (["--capability", "ten"], "--capability"),
    (["--mla-dimensions", "1,2"], "--mla-dimensions"),
])
def test_bad_arguments_are_one_line_errors(argv: list[str], fragment: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err


@pytest.mark.slow
def test_module_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "app", "backends", "--json"],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode in (0, 1), proc.stderr
    info = json.loads(proc.stdout)
    assert "TORCH_SDPA" in info["backends"]


def test_selection_benchmark_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "selection.json"
    code = main(["bench", "--json", "selection", "--number", "2000", "--repeat", "1",
                 "--output", str(output)])
    result = json.loads(capsys.readouterr().out)
    assert json.loads(output.read_text()) == result
    assert result["validated_classes"] == 5 and result["chosen"] == "TORCH_SDPA"
    assert result["targets_us"] == {"cached": 0.5, "uncached": 200.0}  # issue 22
    for key in ("cached", "uncached"):
        assert result[key]["median_us"] > 0
        assert isinstance(result["pass"][key], bool)
    assert code == (0 if result["ok"] else 1)
