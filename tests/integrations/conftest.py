"""vLLM picks its platform at first import: make it the CPU one unless the caller chose.

``fresh_vllm``: vLLM as a new process sees it (plugins not loaded, ``MLAPrefillBackendEnum.CPU``
and ``AttentionBackendEnum.CPU_MLA`` not overridden, no cached selection, no kept plugin line),
restored afterwards. vLLM is imported only when a test
asks for it (these tests skip where it is missing).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture
def fresh_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import vllm.plugins
    from vllm.v1.attention.backends.mla.prefill import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.mla.prefill.selector import (
        _auto_select_mla_prefill_backend,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from app.integrations import _vllm_plugin

    def forget() -> None:
        MLAPrefillBackendEnum.CPU.clear_override()
        AttentionBackendEnum.CPU_MLA.clear_override()
        AttentionBackendEnum.AMX_MLA.clear_override()
        _auto_select_mla_prefill_backend.cache_clear()
        _vllm_plugin._pending.clear()

    from vllm.platforms.cpu import CpuPlatform

    # The AMX routing wraps CpuPlatform.check_and_update_config: put vLLM's own back after.
    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        CpuPlatform.__dict__["check_and_update_config"])
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    forget()
    yield
    forget()
