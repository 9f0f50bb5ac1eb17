"""MLA prefill: the backend contract (``base``), the public kernel base third parties build on
(``kernel_base``) and one module per kernel backend (``torch_sdpa``, ``flash_attn``,
``flashinfer``, ``trtllm_ragged``, ``tokenspeed_mla``).

The backend modules are imported by the container's providers on first use, never here.
"""
