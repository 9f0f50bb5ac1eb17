#!/usr/bin/env python
"""MLA prefill backends on ragged batches: ms, GFLOP/s, ratio to the fp32 matmul rate (JSON).

A thin wrapper over ``python -m app bench prefill``; every option is passed on, e.g.
``python benchmarks/bench_prefill.py --output prefill.json`` or ``... --quick``.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--json", "prefill", *sys.argv[1:]]))
