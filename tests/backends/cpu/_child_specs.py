"""Native library specs whose first self-test runs in a child process, for
``test_child_verdict.py`` (the child imports them by ``module:NAME``): one passes, one computes
a wrong answer, one crashes (SIGILL), one names a spec the child cannot import."""

from __future__ import annotations

import ctypes
from pathlib import Path

from app.backends.cpu.loader import NativeLibrary, NativeLibrarySpec

SOURCE = str(Path(__file__).with_name("native") / "child_test_lib.c")
_HERE = "tests.backends.cpu._child_specs"


def _passes(library: NativeLibrary) -> str | None:
    answer = library.function("child_test_answer", ctypes.c_int32)()
    return None if answer == 42 else f"answered {answer}"


def _wrong(library: NativeLibrary) -> str | None:
    return "self-test against float64 failed: max error 1e+03"


def _crashes(library: NativeLibrary) -> str | None:
    library.function("child_test_crash", ctypes.c_int32)()
    return None


def _spec(name: str, test: object, ref: str) -> NativeLibrarySpec:
    return NativeLibrarySpec(name=name, sources=(SOURCE,), abi_version=1, flags=("-O1",),
                             link_flags=(), self_test=test,  # type: ignore[arg-type]
                             child_test=f"{_HERE}:{ref}")


SPEC_PASS = _spec("child_test_pass", _passes, "SPEC_PASS")
SPEC_WRONG = _spec("child_test_wrong", _wrong, "SPEC_WRONG")
SPEC_CRASH = _spec("child_test_crash", _crashes, "SPEC_CRASH")
SPEC_UNIMPORTABLE = _spec("child_test_unimportable", _passes, "NO_SUCH_SPEC")
