"""The child process of a native library's first self-test on a machine
(:mod:`app.backends.cpu.child_verdict`): ``python -m app.backends.cpu.child_self_test
MODULE:NAME LIBRARY``.

Imports the :class:`~app.backends.cpu.loader.NativeLibrarySpec` at ``MODULE:NAME``, checks it
is what the parent meant (a spec with that ``child_test``), asks its requirements (an AMX
library requests the tile state there, as each process must), then loads ``LIBRARY`` and runs
the spec's checks in this process. The last line on stdout is the verdict, ``{"problem":
null}`` or ``{"problem": "...", "about_library": bool}`` (``about_library`` false: the child
could not test the library, so no verdict is kept). A crash kills this process; the parent
reads the signal.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

__all__ = ["main"]


def _verdict(problem: str | None, about_library: bool = True) -> int:
    sys.stdout.write(json.dumps({"problem": problem, "about_library": about_library}) + "\n")
    sys.stdout.flush()   # the verdict line is this process's answer (its protocol), not a log
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 with a verdict line, 2 for a bad command line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or ":" not in args[0]:
        sys.stderr.write("usage: python -m app.backends.cpu.child_self_test MODULE:NAME "
                         "LIBRARY\n")
        return 2
    from app.backends.cpu.loader import NativeLibrarySpec, check_library_file

    module_name, _, name = args[0].partition(":")
    try:
        spec = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        return _verdict(f"cannot import the spec {args[0]}: {exc}", about_library=False)
    if not isinstance(spec, NativeLibrarySpec) or spec.child_test != args[0]:
        return _verdict(f"{args[0]} is not a native library spec with child_test "
                        f"{args[0]!r}", about_library=False)
    try:
        reasons = list(spec.requirements()) if spec.requirements is not None else []
    except ValueError as exc:
        return _verdict(f"its requirements raised: {exc}", about_library=False)
    if reasons:
        return _verdict("cannot run in the child process: " + "; ".join(reasons),
                        about_library=False)
    return _verdict(check_library_file(spec, Path(args[1])))


if __name__ == "__main__":
    raise SystemExit(main())
