"""One name per kind of value in every command's ``--help``: ``--repeat N`` and ``--heads N``
everywhere, never ``--repeat REPEAT`` in one command and ``--query-len N`` in the next.

``uniform_metavars`` walks a parser and every sub-parser under it and names each option that
takes a value and has no metavar of its own by what the value is (``METAVARS``): its argparse
``type`` first, then, for a plain string, its destination. An option with many choices (the
dtype aliases) shows one word and lists the choices in its help.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.commands._args import bench_device, buffer_gib, output_file, positive_float

#: Every metavar the command line shows for a value of each kind.
METAVARS = {"int": "N", "float": "X", "seconds": "SECONDS", "gib": "GIB", "file": "FILE",
            "path": "PATH", "dir": "DIR", "device": "DEVICE", "name": "NAME",
            "names": "NAMES", "size": "SIZE", "dtype": "DTYPE", "dtypes": "DTYPES"}

#: Plain-string options by destination.
_BY_DEST = {"vllm_python": "path", "deployment": "file", "config": "file", "memory": "size",
            "cache_memory": "size", "backend": "name", "decode_backend": "name",
            "backends": "names", "baseline": "name", "dtype": "dtype", "dtypes": "dtypes"}

#: More choices than this show as one word (their list goes into the help).
_MAX_LISTED_CHOICES = 4


def _kind(action: argparse.Action) -> str | None:
    kind = action.type
    if kind is int or getattr(kind, "__name__", "") == "int":   # int_in(...) parsers
        return "int"
    if kind in (float, positive_float):
        return {"timeout": "seconds", "gib": "gib"}.get(action.dest.rsplit("_")[-1], "float")
    by_type = {buffer_gib: "gib", output_file: "file", bench_device: "device"}
    if kind in by_type:
        return by_type[kind]
    if kind is Path:
        return _BY_DEST.get(action.dest, "path")
    return _BY_DEST.get(action.dest)


def _name(action: argparse.Action) -> None:
    # nargs None: one value (flags, --help and -v take none)
    if not action.option_strings or action.nargs is not None or action.metavar is not None:
        return
    if action.choices is not None:
        choices = [str(c) for c in action.choices]
        if len(choices) > _MAX_LISTED_CHOICES:
            action.metavar = METAVARS["dtype"] if action.dest == "dtype" else action.dest.upper()
            action.help = f"{action.help or ''} (one of: {', '.join(choices)})".lstrip()
        return
    kind = _kind(action)
    if kind is not None:
        action.metavar = METAVARS[kind]


def uniform_metavars(parser: argparse.ArgumentParser) -> None:
    """Name every value-taking option of ``parser`` and of its sub-parsers (see the module
    docstring); an option's own ``metavar`` is kept."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                uniform_metavars(sub)
        else:
            _name(action)


def program_name(argv0: str | None = None) -> str:
    """How the user started the CLI, for ``--help`` and errors: ``app`` (the installed script)
    or ``python -m app`` (``argv0`` is ``app/__main__.py``; also when ``main`` is called from
    Python, as tests do). ``argv0`` defaults to ``sys.argv[0]``."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    return "app" if name in ("app", "app.exe") else "python -m app"
