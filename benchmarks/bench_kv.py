"""Thin wrapper: ``python benchmarks/bench_kv.py [--json] [--vllm-python PATH] ...``.

Same as ``python -m app bench kv``; see ``app.bench.kv`` for the workload.
"""

import sys

from app.bench.kv import main

if __name__ == "__main__":
    sys.exit(main())
