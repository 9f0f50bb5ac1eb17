"""The native CPU kernels: their C sources (``csrc/``), the one loader that builds, caches,
checks and loads them (``loader``), the process-wide thread pool they run on (``pool``) and the
prefill kernel bindings (``prefill_kernel``, ``prefill_kernel_bf16``)."""
