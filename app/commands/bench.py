"""``python -m app bench NAME``: run a benchmark and print its JSON result."""

from __future__ import annotations

import argparse
import importlib

from app._cpu import apply_thread_count
from app._files import write_regular_file
from app.commands._args import output_file
from app.commands._output import json_text, print_json, print_text

HELP = ("run a benchmark (selection, prefill, decode, kv, run, model, sparse, vllm-*) and "
        "report JSON")

#: Benchmark name -> module with ``add_arguments(parser)``, ``run(args) -> dict`` and
#: ``render(result) -> str``.
BENCHMARKS: dict[str, str] = {
    "selection": "app.bench.selection",
    "prefill": "app.bench.prefill",
    "decode": "app.bench.decode",
    "kv": "app.bench.kv",
    "run": "app.bench.run",
    "model": "app.bench.model",
    "sparse": "app.bench.sparse.bench",
    "vllm-prefill": "app.bench.vllm.prefill",
    "vllm-engine": "app.bench.vllm.engine",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-parser per installed benchmark, each with ``--output FILE``."""
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        bench = sub.add_parser(name, help=module.HELP, description=module.HELP)
        bench.add_argument("--output", type=output_file, default=None,
                           help="also write the JSON result to this file")
        # Accept --json after the benchmark name too (`bench kv --json`).
        bench.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                           help="print machine-readable JSON")
        module.add_arguments(bench)
        bench.set_defaults(_bench=module)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark on the threads :func:`app._cpu.apply_thread_count` sizes
    (said first: ``threads`` in the JSON); JSON with ``--json``, a readable summary
    otherwise."""
    threads = apply_thread_count()
    result = {"threads": threads.as_dict(), **args._bench.run(args)}
    if args.output is not None:
        write_regular_file(args.output, (json_text(result, indent=2) + "\n").encode(),
                           "--output")
    if args.json:
        print_json(result)
    else:
        print_text(f"threads: {threads.count} ({threads.source})")
        print_text(args._bench.render(result))
    return 0 if result.get("ok", True) else 1
