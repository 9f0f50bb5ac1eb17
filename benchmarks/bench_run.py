#!/usr/bin/env python
"""The whole MLA prefill path at 4k-token contexts: tokens/s and time outside attention kernels.

A thin wrapper over ``python -m app bench run`` (JSON on stdout); every option is passed on,
e.g. ``python benchmarks/bench_run.py --output run.json`` or ``... --new-tokens 4096``.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--json", "run", *sys.argv[1:]]))
