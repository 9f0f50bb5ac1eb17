"""A deployment is validated entirely before any side effect (issue 12, item 6): a bad
``[backends]`` name (one registering would refuse included) fails in ``parse()``, and a
build-time failure names the file and leaves the process-wide backend enum as it was, even
half-way through the registrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app import deployment
from app.backends import MLAPrefillBackendEnum
from app.backends.catalog import PREFILL_BACKENDS
from app.backends.registry import register_backend

SDPA = "app.backends.prefill.torch_sdpa.TorchSDPABackend"
DECODE_SDPA = "app.backends.decode.torch_sdpa.TorchSDPADecodeBackend"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deployment.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("bad", ["_X", "__CLASS__", "_PRIVATE", "lower", "Mixed_Case"])
def test_bad_backend_names_fail_at_parse_time(tmp_path: Path, bad: str) -> None:
    before = list(MLAPrefillBackendEnum.__members__)
    path = _write(tmp_path, f'[backends]\nATOMIC_EARLIER = "{SDPA}"\n{bad} = "{SDPA}"\n')
    with pytest.raises(ValueError, match=rf"deployment file '.*deployment.toml': "
                                         rf"backends\.{bad} = .*upper-case identifier"):
        deployment.parse(path)
    assert list(MLAPrefillBackendEnum.__members__) == before
    # ... and a later, valid config does not accept the earlier name.
    with pytest.raises(ValueError, match="unknown backend"):
        deployment.parse_dict({"deployment": {"prefill_backend": "ATOMIC_EARLIER"}})


def test_a_build_failure_names_the_file_and_adds_no_backend_name(tmp_path: Path) -> None:
    before = list(MLAPrefillBackendEnum.__members__)
    path = _write(tmp_path, f'[backends]\nATOMIC_NEW = "{SDPA}"\n[[kv_cache_specs]]\n'
                            'spec = "app.kvcache.FullAttentionSpec"\n'
                            'manager = "app.kvcache.SlidingWindowManager"\n')
    parsed = deployment.parse(path)  # valid on its own: the conflict is with a built-in binding
    with pytest.raises(ValueError, match=rf"^deployment file '{path}': Conflicting registration "
                                         r"for KV cache spec FullAttentionSpec"):
        parsed.build()
    assert list(MLAPrefillBackendEnum.__members__) == before


def test_a_manager_that_is_not_a_manager_fails_at_parse_time(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[kv_cache_specs]]\nspec = "app.kvcache.FullAttentionSpec"\n'
                            'manager = "app.kvcache.FullAttentionSpec"\n')
    with pytest.raises(TypeError, match=r"deployment file '.*': kv_cache_specs\[0\]\.manager = "
                                        r"'app.kvcache.FullAttentionSpec': not a "
                                        r"SingleTypeKVCacheManager subclass"):
        deployment.parse(path)


def test_uniform_base_must_be_a_base_at_parse_time(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[kv_cache_specs]]\nspec = "app.kvcache.FullAttentionSpec"\n'
                            'manager = "app.kvcache.FullAttentionManager"\n'
                            'uniform_base = "app.kvcache.SlidingWindowSpec"\n')
    with pytest.raises(ValueError, match=r"kv_cache_specs\[0\]\.uniform_base = .*: "
                                         r"FullAttentionSpec does not inherit from it"):
        deployment.parse(path)


@pytest.mark.parametrize("platform", ["cuda:-1.0", "cuda:99.9", "cuda:1_0.0", "cuda:9",
                                      "cuda:\u0969.0"])
def test_a_bad_emulated_cuda_platform_says_what_is_wrong(tmp_path: Path, platform: str) -> None:
    path = _write(tmp_path, f'[deployment]\nplatform = "{platform}"\n')
    with pytest.raises(ValueError) as info:
        deployment.parse(path)
    message = str(info.value)
    assert "expected MAJOR.MINOR with ASCII digits" in message
    assert "import" not in message


def test_a_platform_whose_constructor_raises(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "planted_platform_mod.py").write_text(
        "from app.platforms import CpuPlatform\n\n\nclass P(CpuPlatform):\n"
        "    def __init__(self) -> None:\n        raise OSError('no device')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, '[deployment]\nplatform = "planted_platform_mod.P"\n')
    with pytest.raises(ValueError, match=r"deployment\.platform = 'planted_platform_mod.P': "
                                         r"constructing P\(\) raised OSError: no device"):
        deployment.parse(path)


def test_a_name_registering_would_refuse_fails_at_parse_time(tmp_path: Path) -> None:
    before = list(MLAPrefillBackendEnum.__members__)
    # CPU_MLA is a decode member: reserved for prefill (a member is an attribute of its enum).
    path = _write(tmp_path, f'[backends]\nBRAND_NEW_A = "{SDPA}"\nCPU_MLA = "{SDPA}"\n')
    with pytest.raises(ValueError, match=r"deployment file '.*': backends\.CPU_MLA = .*: "
                                         r"Invalid MLA prefill backend name: 'CPU_MLA' is "
                                         r"reserved"):
        deployment.parse(path)
    assert list(MLAPrefillBackendEnum.__members__) == before
    assert "BRAND_NEW_A" not in PREFILL_BACKENDS


def test_a_build_refused_half_way_leaves_no_backend_name(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    before = list(MLAPrefillBackendEnum.__members__)
    path = _write(tmp_path, f'[backends]\nHALF_WAY_A = "{SDPA}"\nHALF_WAY_B = "{SDPA}"\n'
                            f'[decode_backends]\nHALF_WAY_C = "{DECODE_SDPA}"\n')
    parsed = deployment.parse(path)
    calls: list[str] = []

    def failing_on_the_third(kind: Any, backends: Any, name: str, target: Any,
                             **kwargs: Any) -> None:
        calls.append(name)
        if len(calls) == 3:
            raise ValueError("refused late")
        register_backend(kind, backends, name, target, **kwargs)

    monkeypatch.setattr(deployment, "register_backend", failing_on_the_third)
    with pytest.raises(ValueError, match=rf"^deployment file '{path}': refused late"):
        parsed.build()
    assert calls == ["HALF_WAY_A", "HALF_WAY_B", "HALF_WAY_C"]
    assert list(MLAPrefillBackendEnum.__members__) == before
    assert "HALF_WAY_A" not in PREFILL_BACKENDS and "HALF_WAY_B" not in PREFILL_BACKENDS


@pytest.mark.parametrize(("data", "message"), [
    (None, r"deployment: expected a table \(a dict of sections\), got None \(NoneType\)"),
    ([1], r"deployment: expected a table \(a dict of sections\), got \[1\] \(list\)"),
    ({1: {}}, r"deployment: key 1: expected a string key, got int"),
    ({"backends": {1: "x.y"}}, r"deployment: backends key 1: a backend name must be a string "
                               r"\(an upper-case identifier, e.g\. MY_KERNEL\), got int"),
    ({"deployment": {None: 1}}, r"deployment: key deployment\.None: expected a string key"),
])
def test_parse_dict_refuses_what_is_not_a_table_of_string_keys(data: Any, message: str) -> None:
    with pytest.raises(TypeError, match=rf"^{message}"):
        deployment.parse_dict(data)
