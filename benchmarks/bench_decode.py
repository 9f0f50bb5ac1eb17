#!/usr/bin/env python
"""MLA decode backends over a paged latent cache: ms, GB/s, GFLOP/s, roofline fraction (JSON).

A thin wrapper over ``python -m app bench decode``; every option is passed on, e.g.
``python benchmarks/bench_decode.py --output decode.json`` or ``... --quick``.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--json", "decode", *sys.argv[1:]]))
