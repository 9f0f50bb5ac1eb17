"""Integrations with serving engines that embed this package.

- **vLLM** (0.33, CPU): the ``vllm.general_plugins`` entry point ``app_cpu_mla_prefill``
  (installed with the package, inert without vLLM) runs :func:`register_vllm_plugin`, which
  makes vLLM's ``MLAPrefillBackendEnum.CPU`` our TORCH_SDPA CPU prefill
  (:mod:`app.integrations.vllm`) when vLLM's interface is the one it was written against.

Nothing here imports vLLM at import time; only :mod:`app.integrations.vllm` does (vLLM imports
it by class path once the plugin has registered it).
"""

from app.integrations._vllm_plugin import (
    VLLM_BACKEND_CLASS_PATH,
    VLLM_ENTRY_POINT,
    VLLM_VERIFIED_VERSION,
    register_vllm_plugin,
    vllm_interface_problems,
)

__all__ = [
    "VLLM_BACKEND_CLASS_PATH",
    "VLLM_ENTRY_POINT",
    "VLLM_VERIFIED_VERSION",
    "register_vllm_plugin",
    "vllm_interface_problems",
]
