#!/usr/bin/env python
"""vLLM 0.33's own CPU MLA prefill backend against ours, through vLLM's interface (JSON).

A thin wrapper over ``python -m app bench vllm-prefill``; every option is passed on, e.g.
``python benchmarks/bench_vllm_prefill.py --vllm-python /path/to/vllm-venv/bin/python``.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--json", "vllm-prefill", *sys.argv[1:]]))
