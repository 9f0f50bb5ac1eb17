"""MLA decode: the backend contract (``base``, absorbed MLA over the paged latent cache) and one
module per kernel backend (``cpu_mla``, ``torch_sdpa``, ``flashinfer_mla``, ``tokenspeed_mla``).

The backend modules are imported by the container's providers on first use, never here.
"""
