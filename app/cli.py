"""``python -m app``: the command-line front door.

Each subcommand lives in its own module under ``app.commands`` and exposes ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Every subcommand takes ``--json``.

Every error reaches the user as one line on stderr, never a traceback: a bad flag or a bad
input (``ValueError``, ``TypeError``, ``ImportError``, ``OSError``) prints ``error: ...`` and
exits 2; anything else (a failure of the library or of torch itself, e.g. out of memory) prints
``error: unexpected <Type>: ...`` and exits 1 (``-vv`` logs the traceback too).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import textwrap
from collections.abc import Sequence
from typing import NoReturn

logger = logging.getLogger(__name__)

#: Subcommand name -> module implementing it.
COMMANDS: dict[str, str] = {
    "platform": "app.commands.platform",
    "backends": "app.commands.backends",
    "kv-plan": "app.commands.kv_plan",
    "run": "app.commands.run",
    "checkpoint": "app.commands.checkpoint",
    "generate": "app.commands.generate",
    "bench": "app.commands.bench",
}

#: Exit status of a usage error: a bad flag, a bad file, a bad value.
USAGE_ERROR = 2
#: Errors that mean "the input is wrong" (exit 2); anything else is unexpected (exit 1).
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, ImportError, OSError)


class UsageError(Exception):
    """A command line argparse refused; the message is argparse's."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise ``UsageError`` (printed as one line by ``main``)
    instead of printing the usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise ``UsageError`` naming the command and pointing to its ``--help``."""
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


#: What the project is, the first line of ``--help``.
DESCRIPTION = ("MLA attention for DeepSeek models on CPUs and GPUs: prefill and decode backends "
               "(selected per platform), the paged latent KV cache, and an engine that serves "
               "requests end to end (continuous batching, chunked prefill, decode) on "
               "DeepSeek-V2/V3, V3.2 and GLM-5 checkpoints, checked against float64.")


def _epilog(prog: str) -> str:
    steps = [(f"{prog} run", "the main job, no download"),
             (f"{prog} checkpoint --family v32 DIR", "a tiny checkpoint"),
             (f"{prog} generate --model DIR --prompt-ids 1,2,3", "tokens from it"),
             (f"{prog} COMMAND --help", "a command's options")]
    width = max(len(command) for command, _ in steps)
    return "start here:\n" + "\n".join(f"  {command:<{width}}  {what}" for command, what in steps)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand whose module is installed."""
    from app.commands._help import program_name, uniform_metavars

    prog = program_name()
    parser = OneLineArgumentParser(prog=prog, description=textwrap.fill(DESCRIPTION, 79),
                                   epilog=_epilog(prog),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug and tracebacks)")
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
    uniform_metavars(parser)
    return parser


def one_line(exc: BaseException) -> str:
    """The exception's message with every run of whitespace (newlines too) made one space."""
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (0 ok, 1 failed, 2 usage error)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args._module.run(args)
    except BrokenPipeError:  # e.g. `python -m app backends | head`
        sys.stderr.close()
        return 0
    except USER_ERRORS as exc:
        logger.debug("usage error", exc_info=True)
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as exc:  # the front door: one line, never a traceback (-vv logs it)
        logger.debug("unexpected error", exc_info=True)
        print(f"error: unexpected {type(exc).__name__}: {one_line(exc)} (run with -vv for the "
              f"traceback)", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
