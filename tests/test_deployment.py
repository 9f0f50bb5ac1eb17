"""Deployment files: fresh, independent containers; one clear error; nothing half-applied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app import deployment
from app.backends import MLAPrefillBackendEnum, get_mla_prefill_backend
from app.containers import get_container, use_container
from app.kvcache import FullAttentionSpec, KVCacheSpecRegistry
from app.platforms import CpuPlatform, CudaPlatform, DeviceCapability
from app.testing import SelectionOnlyBackend

EXAMPLE = Path(__file__).parent.parent / "examples" / "deployment.toml"


class DeployedBackend(SelectionOnlyBackend):
    """A backend class deployments point at by dotted path."""

    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)

    @staticmethod
    def get_name() -> str:
        return "DEPLOYED"



class DeployedSpec(FullAttentionSpec):
    """A spec kind a deployment registers."""


class NotABackend:
    pass


HERE = "tests.test_deployment"


def write(tmp_path: Path, text: str, name: str = "d.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_file_loads() -> None:
    container = deployment.load(EXAMPLE)
    assert isinstance(container.platform(), CpuPlatform)
    assert container.config().model.num_heads == 16


def test_two_deployments_stay_independent(tmp_path: Path) -> None:
    a = deployment.load(write(tmp_path, f"""
[deployment]
platform = "cuda:10.0"
prefill_backend = "TORCH_SDPA"
[backends]
TORCH_SDPA = "{HERE}.DeployedBackend"
[model]
dtype = "float32"
""", "a.toml"))
    b = deployment.load(write(tmp_path, """
[deployment]
platform = "cuda:9.0"
[model]
num_heads = 8
""", "b.toml"))
    assert a.platform().get_device_capability() == DeviceCapability(10, 0)
    assert b.platform().get_device_capability() == DeviceCapability(9, 0)
    assert a.mla_prefill_backends.TORCH_SDPA() is DeployedBackend
    assert b.mla_prefill_backends.TORCH_SDPA() is not DeployedBackend
    assert a.config().model.dtype is torch.float32 and b.config().model.num_heads == 8
    with use_container(a):
        assert get_mla_prefill_backend(a.config()) is DeployedBackend
    # Nothing global changed.
    assert get_container().mla_prefill_backends.TORCH_SDPA.overridden == ()


def test_new_backend_name_and_kv_spec(tmp_path: Path) -> None:
    container = deployment.load(write(tmp_path, f"""
[deployment]
platform = "cpu"
prefill_backend = "DEPLOYED_NEW"
[backends]
DEPLOYED_NEW = "{HERE}.DeployedBackend"
[[kv_cache_specs]]
spec = "{HERE}.DeployedSpec"
manager = "app.kvcache.FullAttentionManager"
uniform_base = "app.kvcache.FullAttentionSpec"
"""))
    assert container.config().attention.mla_prefill_backend == MLAPrefillBackendEnum[
        "DEPLOYED_NEW"].name
    with use_container(container):
        spec = DeployedSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
        assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec


@pytest.mark.parametrize("text, exc, fragments", [
    ('[deployment]\nplatform = "tpu"\n', ValueError, ["deployment.platform", "'tpu'", "auto"]),
    ("[deployment]\nplatform = 3\n", TypeError, ["deployment.platform", "3"]),
    ('[deployment]\nprefill_backend = "NOPE"\n', ValueError,
     ["deployment.prefill_backend", "NOPE", "TORCH_SDPA"]),
    ('[deployment]\ncolour = "red"\n', ValueError, ["deployment.colour", "allowed"]),
    ('[mystery]\nx = 1\n', ValueError, ["mystery", "allowed"]),
    ('[backends]\nFLASHINFER = "no.such.module.Cls"\n', ImportError,
     ["backends.FLASHINFER", "no.such.module.Cls"]),
    (f'[backends]\nFLASHINFER = "{HERE}.NotABackend"\n', TypeError,
     ["backends.FLASHINFER", "MLAPrefillBackend"]),
    ('[backends]\nFLASHINFER = 7\n', TypeError, ["backends.FLASHINFER", "7"]),
    ('[backends]\n"bad name" = "x.Y"\n', ValueError, ["bad name", "identifier"]),
    ('[model]\nnum_heads = -1\n', ValueError, ["num_heads", "-1"]),
    ('[model]\nnum_heads = "many"\n', TypeError, ["num_heads", "many"]),
    ('[cache]\nblocksize = 16\n', ValueError, ["blocksize", "allowed"]),
    ('[[kv_cache_specs]]\nspec = "app.kvcache.FullAttentionSpec"\n', ValueError,
     ["kv_cache_specs[0]", "manager"]),
    (f'[[kv_cache_specs]]\nspec = "{HERE}.NotABackend"\nmanager = "x.Y"\n', (ImportError,
     TypeError), ["kv_cache_specs[0]"]),
    ('kv_cache_specs = 3\n', TypeError, ["kv_cache_specs"]),
    ('[deployment\n', ValueError, ["not valid TOML"]),
])
def test_bad_files_give_one_clear_error(tmp_path: Path, text: str,
                                        exc: type[Exception] | tuple[type[Exception], ...],
                                        fragments: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(exc) as info:
        deployment.load(path)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_nothing_is_half_applied(tmp_path: Path) -> None:
    names_before = [m.name for m in MLAPrefillBackendEnum]
    path = write(tmp_path, f"""
[deployment]
prefill_backend = "HALF_APPLIED"
[backends]
HALF_APPLIED = "{HERE}.DeployedBackend"
[model]
num_heads = 0
""")
    with pytest.raises(ValueError, match="num_heads"):
        deployment.load(path)
    assert [m.name for m in MLAPrefillBackendEnum] == names_before


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        deployment.load(tmp_path / "nope.toml")


def test_cuda_platform_without_gpu_is_a_clear_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        assert isinstance(deployment.load(write(tmp_path, '[deployment]\nplatform = "cuda"\n'))
                          .platform(), CudaPlatform)
        return
    with pytest.raises(ValueError, match="CUDA is not available"):
        deployment.load(write(tmp_path, '[deployment]\nplatform = "cuda"\n'))


def test_backends_cli_with_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from app.cli import main

    assert main(["backends", "--deployment", str(EXAMPLE), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["chosen"] == "TORCH_SDPA"


def test_backends_cli_with_bad_deployment(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    path = write(tmp_path, '[deployment]\nprefill_backend = "NOPE"\n')
    assert main(["backends", "--deployment", str(path)]) == 2
    assert "deployment.prefill_backend" in capsys.readouterr().err
