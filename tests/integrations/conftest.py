"""vLLM picks its platform at first import: make it the CPU one unless the caller chose."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
