#!/usr/bin/env python
"""Cost of a cached and of an uncached MLA prefill backend selection (JSON on stdout).

A thin wrapper over ``python -m app bench selection``; every option is passed on, e.g.
``python benchmarks/bench_selection.py --output selection.json --backends builtin``.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--json", "selection", *sys.argv[1:]]))
