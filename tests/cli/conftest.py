"""Fixtures of the CLI tests: run ``python -m app`` in-process, plant hostile modules."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.cli import main

#: Modules that hostile class paths point at, written to a temporary folder on ``sys.path``.
HOSTILE_MODULES = {
    "hostile_raising_mod": 'raise RuntimeError("planted failure at import")\n',
    "hostile_syntax_mod": "def broken(:\n    pass\n",
    "hostile_platform_mod": (
        "from app.platforms import CpuPlatform\n\n\n"
        "class RaisingPlatform(CpuPlatform):\n"
        "    def __init__(self) -> None:\n"
        '        raise RuntimeError("planted failure in __init__")\n'),
}


@pytest.fixture
def hostile_modules(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on ``sys.path`` holding ``HOSTILE_MODULES``."""
    folder = tmp_path_factory.mktemp("hostile_modules")
    for name, source in HOSTILE_MODULES.items():
        (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    yield folder


CliRunner = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run_cli() -> CliRunner:
    """``run_cli(*argv) -> (exit code, stdout, stderr)`` of ``python -m app`` in-process."""

    def run(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
        return code, out.getvalue(), err.getvalue()

    return run


def assert_one_line_usage_error(code: int, err: str, *expected: str) -> None:
    """Exit 2, exactly one line ``error: ...`` on stderr holding each of ``expected``."""
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, (text, err)
