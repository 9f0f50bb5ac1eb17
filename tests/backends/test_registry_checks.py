"""What the registry refuses (a backend whose declarations have the wrong type) and what it
takes back (a registration made in a ``rollback_on_error`` block that fails)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch

from app._container_state import rollback_on_error
from app.backends import (
    MLADecodeBackendEnum,
    MLAPrefillBackendEnum,
    explain_mla_prefill_selection,
    get_mla_prefill_backend,
    register_mla_decode_backend,
    register_mla_prefill_backend,
)
from app.backends.catalog import PREFILL_BACKENDS
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.containers import Application, create_container, use_container
from app.kvcache import FullAttentionManager, FullAttentionSpec, KVCacheSpecRegistry

# (attribute, bad value, what the message says is expected)
BAD_DECLARATIONS: list[tuple[str, Any, str]] = [
    ("name", 123, "a non-empty string or None"),
    ("supported_dtypes", None, "a tuple of torch.dtype"),
    ("supported_dtypes", "bfloat16", "a tuple of torch.dtype"),
    ("supported_dtypes", (torch.bfloat16, "float16"), "a tuple of torch.dtype"),
    ("compute_capabilities", "9.0", "a ComputeCapabilities"),
    ("requires_device_capability", "no", "a bool"),
    ("probe", 5, "a function of no arguments"),
    ("install_hint", 5, "a string"),
    ("kernel_package", 5, "a package's import name"),
]
PREFILL_ONLY: list[tuple[str, Any, str]] = [
    ("supported_mla_dimensions", ((128, 64, 128),), "a tuple of MLADimensions"),
    ("supports_out", "yes", "a bool"),
]
DECODE_ONLY: list[tuple[str, Any, str]] = [
    ("supported_block_sizes", 64, "a tuple of ints"),
    ("supported_head_dims", (512, 64), "a tuple of (kv_lora_rank, qk_rope_head_dim) int pairs"),
    ("max_query_len", "16", "an int"),
]


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10].upper()}"


@pytest.mark.parametrize(("attribute", "value", "expected"), BAD_DECLARATIONS + PREFILL_ONLY)
def test_a_prefill_backend_with_a_badly_typed_declaration_is_refused(
        app_container: Application, attribute: str, value: Any, expected: str) -> None:
    bad = type("Bad", (TorchSDPABackend,), {attribute: value})
    with pytest.raises(TypeError) as info:
        register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, bad)
    message = str(info.value)
    assert message.startswith("register_mla_prefill_backend: ")
    assert f"declares {attribute} = {value!r}: expected {expected}" in message
    assert f"got {type(value).__name__}" in message
    # Refused: selection still works for the whole container.
    assert not MLAPrefillBackendEnum.TORCH_SDPA.is_overridden()
    assert get_mla_prefill_backend() is TorchSDPABackend
    assert app_container.mla_prefill_backend_class() is TorchSDPABackend


@pytest.mark.parametrize(("attribute", "value", "expected"), BAD_DECLARATIONS + DECODE_ONLY)
def test_a_decode_backend_with_a_badly_typed_declaration_is_refused(
        app_container: Application, attribute: str, value: Any, expected: str) -> None:
    bad = type("BadDecode", (TorchSDPADecodeBackend,), {attribute: value})
    with pytest.raises(TypeError, match=rf"declares {attribute} = .*: expected "):
        register_mla_decode_backend(MLADecodeBackendEnum.TORCH_SDPA, bad)
    with pytest.raises(TypeError, match=rf"declares {attribute} = "):
        register_mla_decode_backend(_unique("BAD_DECODE"))(bad)  # the decorator form too
    assert not MLADecodeBackendEnum.TORCH_SDPA.is_overridden()


def test_a_bad_class_behind_a_path_is_a_reason_at_selection(app_container: Application) -> None:
    # A path is imported on first use; a class changed after it was registered is the same.
    class Drifting(TorchSDPABackend):
        pass

    register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, Drifting)
    Drifting.supported_dtypes = None  # type: ignore[assignment]
    explanation = explain_mla_prefill_selection()
    reasons = explanation["backends"]["TORCH_SDPA"]["reasons"]
    assert reasons[0].startswith("TypeError: MLA prefill backend TORCH_SDPA: ")
    assert "declares supported_dtypes = None" in reasons[0]
    with pytest.raises(ValueError, match="No valid MLA prefill backend"):
        get_mla_prefill_backend()


# --- taking a registration back ---------------------------------------------------------------


class Mine(TorchSDPABackend):
    pass


def test_registrations_in_a_failed_block_are_taken_back(app_container: Application) -> None:
    name = _unique("ROLLED_BACK")
    members = list(MLAPrefillBackendEnum.__members__)
    with pytest.raises(RuntimeError), rollback_on_error():
        register_mla_prefill_backend(name, Mine)
        register_mla_prefill_backend(MLAPrefillBackendEnum.TORCH_SDPA, Mine)
        KVCacheSpecRegistry.register(_spec_type(), FullAttentionManager)
        assert name in MLAPrefillBackendEnum.__members__
        raise RuntimeError("failed after registering")
    assert list(MLAPrefillBackendEnum.__members__) == members
    assert name not in PREFILL_BACKENDS and not hasattr(MLAPrefillBackendEnum, name)
    assert name not in app_container.mla_prefill_backends().providers
    assert not MLAPrefillBackendEnum.TORCH_SDPA.is_overridden()
    assert get_mla_prefill_backend() is TorchSDPABackend
    registered = KVCacheSpecRegistry.registered_specs()
    assert FullAttentionSpec in registered  # the built-ins, set up inside the block, stay
    assert all(spec.__name__ != "RolledBackSpec" for spec in registered)
    register_mla_prefill_backend(name, Mine)  # the name is free again
    assert MLAPrefillBackendEnum[name].get_class() is Mine


def test_a_name_another_container_holds_stays(app_container: Application) -> None:
    name = _unique("SHARED")
    other = create_container()

    def register_in_other() -> None:  # another thread: not part of the failing block
        with use_container(other):
            register_mla_prefill_backend(name, Mine)

    with pytest.raises(RuntimeError), rollback_on_error():
        register_mla_prefill_backend(name, Mine)
        thread = threading.Thread(target=register_in_other)
        thread.start()
        thread.join()
        raise RuntimeError("failed")
    assert name in MLAPrefillBackendEnum.__members__
    assert not MLAPrefillBackendEnum[name].is_registered()
    with use_container(other):
        assert MLAPrefillBackendEnum[name].get_class() is Mine


def _spec_type() -> type[FullAttentionSpec]:
    import attrs

    @attrs.frozen(kw_only=True)
    class RolledBackSpec(FullAttentionSpec):
        pass

    return RolledBackSpec
