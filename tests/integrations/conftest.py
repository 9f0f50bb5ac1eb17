"""vLLM picks its platform at first import: make it the CPU one unless the caller chose.

``fresh_vllm``: vLLM as a new process sees it (plugins not loaded, ``MLAPrefillBackendEnum.CPU``
not overridden, no cached selection), restored afterwards. vLLM is imported only when a test
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

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    MLAPrefillBackendEnum.CPU.clear_override()
    _auto_select_mla_prefill_backend.cache_clear()
    yield
    MLAPrefillBackendEnum.CPU.clear_override()
    _auto_select_mla_prefill_backend.cache_clear()
