"""``python -m app``: the command-line front door.

Each subcommand lives in its own module under ``app.commands`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Every subcommand takes ``--json``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

#: Subcommand name -> module implementing it.
COMMANDS: dict[str, str] = {
    "platform": "app.commands.platform",
    "backends": "app.commands.backends",
    "kv-plan": "app.commands.kv_plan",
    "run": "app.commands.run",
    "bench": "app.commands.bench",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand whose module is installed."""
    parser = argparse.ArgumentParser(
        prog="python -m app",
        description="MLA prefill backends, KV-cache spec bindings and platform hooks.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        cmd.add_argument("--json", action="store_true", help="print machine-readable JSON")
        module.add_arguments(cmd)
        cmd.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args._module.run(args)
    except (ValueError, TypeError, ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `python -m app backends | head`
        sys.stderr.close()
        return 0
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
