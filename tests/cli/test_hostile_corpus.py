"""The hostile-input corpus: every file under ``hostile/`` is a TOML file a hostile or careless
user could write. Its first lines say how to run it (``# argv: ... {file} ...``) and what the
one-line error must say (``# expect: ...``, repeatable). Each must end in exit 2 with one line
on stderr naming the file: never a traceback, never a half-applied deployment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.backends import MLAPrefillBackendEnum
from tests.cli.conftest import CliRunner, assert_one_line_usage_error

CORPUS = sorted((Path(__file__).parent / "hostile").glob("*.toml"))


def _header(path: Path) -> tuple[list[str], list[str]]:
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    argv = [line.removeprefix("# argv:").split() for line in lines
            if line.startswith("# argv:")]
    expect = [line.removeprefix("# expect:").strip() for line in lines
              if line.startswith("# expect:")]
    assert len(argv) == 1 and expect, f"{path.name}: needs one '# argv:' and '# expect:' lines"
    return argv[0], expect


def test_the_corpus_is_there() -> None:
    assert len(CORPUS) >= 40


@pytest.mark.usefixtures("hostile_modules")
@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_hostile_file_gets_one_line(path: Path, run_cli: CliRunner) -> None:
    argv, expected = _header(path)
    before = set(MLAPrefillBackendEnum.__members__)
    code, out, err = run_cli(*(arg.replace("{file}", str(path)) for arg in argv))
    # The file is named, then the key, the value and what is allowed (the expect lines).
    assert_one_line_usage_error(code, err, str(path), *expected)
    assert out == ""
    # Nothing half-applied: no backend name of a refused deployment joined the enum.
    added = set(MLAPrefillBackendEnum.__members__) - before
    assert not added, f"{path.name} added {sorted(added)} to MLAPrefillBackendEnum"
    assert not any(re.fullmatch(r"HOSTILE_\w+", name) for name in MLAPrefillBackendEnum.__members__)
