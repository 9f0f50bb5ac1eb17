"""Hostile paths on the command line and in the API (issue 21): a FIFO, ``/dev/zero``, a link
to a device, a directory and a file far too large, wherever a user names a file. Each is one
line on stderr and exit 2 (a typed error in the API), at once: a FIFO is never opened for
reading (it hung forever), ``/dev/zero`` is never read (it grew until the OOM killer came)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from app import deployment
from app.config import EngineConfig
from tests.cli.conftest import CliRunner, assert_one_line_usage_error
from tests.test_files import FifoWatch

READERS = [["kv-plan", "--config"], ["backends", "--deployment"], ["run", "--deployment"]]
API: list[tuple[str, Callable[[Path], object]]] = [
    ("deployment.load", deployment.load), ("deployment.parse", deployment.parse),
    ("EngineConfig.from_toml", EngineConfig.from_toml)]


def _hostile(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A hostile file of ``kind`` and what the error must say about it."""
    if kind == "dev-zero":
        return Path("/dev/zero"), "is a character device, not a regular file"
    if kind == "link-to-dev-zero":
        link = tmp_path / "link.toml"
        link.symlink_to("/dev/zero")
        return link, "is a character device, not a regular file"
    if kind == "huge":
        big = tmp_path / "huge.toml"
        with open(big, "wb") as f:
            f.truncate(20 << 30)  # 20 GiB, sparse
        return big, "is larger than 16777216 bytes"
    return tmp_path, "is a directory; expected a TOML file"


KINDS = ["dev-zero", "link-to-dev-zero", "huge", "directory"]


@pytest.mark.parametrize("argv", READERS, ids=[" ".join(a) for a in READERS])
def test_a_fifo_is_refused_without_opening_it(run_cli: CliRunner, tmp_path: Path,
                                              argv: list[str]) -> None:
    fifo = FifoWatch(tmp_path / "fifo.toml")
    code, out, err = run_cli(*argv, str(fifo.path))
    assert not fifo.stop(), "the FIFO was opened for reading"
    assert_one_line_usage_error(code, err, str(fifo.path), "is a FIFO (named pipe), not a "
                                "regular file; expected a TOML file")
    assert out == ""


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("argv", READERS, ids=[" ".join(a) for a in READERS])
def test_devices_and_huge_files_are_refused(run_cli: CliRunner, tmp_path: Path,
                                            argv: list[str], kind: str) -> None:
    path, expected = _hostile(tmp_path, kind)
    code, out, err = run_cli(*argv, str(path))
    assert_one_line_usage_error(code, err, str(path), expected)
    assert out == ""


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
@pytest.mark.parametrize("name, load", API, ids=[n for n, _ in API])
def test_the_api_refuses_them_too(tmp_path: Path, name: str,
                                  load: Callable[[Path], object]) -> None:
    fifo = FifoWatch(tmp_path / "fifo.toml")
    with pytest.raises(ValueError, match="is a FIFO"):
        load(fifo.path)
    assert not fifo.stop()
    for kind in KINDS:
        path, expected = _hostile(tmp_path, kind)
        with pytest.raises(ValueError) as info:
            load(path)
        assert expected in str(info.value) and str(path) in str(info.value)
    with pytest.raises(TypeError, match=r"expected a path \(str or os.PathLike\), got 0"):
        load(0)  # type: ignore[arg-type]  # os.stat(0) would stat stdin


@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "link"])
def test_output_must_be_a_regular_file(run_cli: CliRunner, tmp_path: Path,
                                       target: str) -> None:
    fifo = FifoWatch(tmp_path / "fifo.json")
    link = tmp_path / "link.json"
    link.symlink_to("/dev/null")
    path = {"fifo": fifo.path, "link": link}.get(target, Path(target))
    code, out, err = run_cli("bench", "selection", "--output", str(path))
    fifo.stop()
    assert_one_line_usage_error(code, err, "argument --output:", str(path),
                                "not a regular file; expected a file path")
    assert out == ""
