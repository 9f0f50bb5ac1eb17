"""``app._files``: a path a user names is read only when it is a regular file of bounded size,
without ever opening a FIFO for reading; results are written only to regular files."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import _files
from app._files import (
    check_writable_file,
    file_kind,
    read_regular_file,
    write_regular_file,
)


class FifoWatch:
    """A FIFO and a thread that notices a reader opening it (an open for writing succeeds
    only then) and releases that reader, so a regression fails the test instead of hanging
    it. Shared with the CLI tests."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        self.opened_for_reading = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    return
                time.sleep(0.01)
                continue
            self.opened_for_reading = True
            os.write(fd, b"x = 1\n")
            os.close(fd)  # the reader sees the end of the file
            return

    def stop(self) -> bool:
        """Stop watching; whether anyone opened the FIFO for reading meanwhile."""
        time.sleep(0.05)  # a reader that opened just now is seen
        self._stop.set()
        self._thread.join(5)
        return self.opened_for_reading


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[FifoWatch]:
    watch = FifoWatch(tmp_path / "fifo.toml")
    yield watch
    watch.stop()


def test_a_fifo_is_refused_and_never_opened(fifo: FifoWatch) -> None:
    with pytest.raises(ValueError, match=r"config file '.*fifo.toml' is a FIFO \(named pipe\), "
                                         r"not a regular file; expected a TOML file"):
        read_regular_file(fifo.path, "config file")
    assert not fifo.stop()


def test_a_fifo_swapped_in_after_the_check_does_not_block(
        fifo: FifoWatch, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    regular = os.stat(tmp_path)  # any stat result, with a regular file's mode
    fake = os.stat_result((stat.S_IFREG | 0o644, *tuple(regular)[1:]))
    monkeypatch.setattr(_files.os, "stat", lambda path: fake)
    with pytest.raises(ValueError, match="is a FIFO"):
        read_regular_file(fifo.path, "config file")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_devices_and_links_to_them_are_refused(tmp_path: Path, device: str) -> None:
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    link = tmp_path / "config.toml"
    link.symlink_to(device)
    for path in (device, link):
        with pytest.raises(ValueError, match="is a character device, not a regular file"):
            read_regular_file(path, "config file")


def test_a_file_over_the_limit_is_refused_without_reading_it(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(_files.MAX_CONFIG_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(ValueError, match="is larger than 16777216 bytes"):
        read_regular_file(big, "config file")
    small = tmp_path / "small.toml"
    small.write_bytes(b"a" * 11)
    with pytest.raises(ValueError, match="is larger than 10 bytes"):
        read_regular_file(small, "config file", limit=10)
    assert read_regular_file(small, "config file", limit=11) == b"a" * 11


def test_a_file_whose_size_reads_zero_is_still_bounded() -> None:
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc here")
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(ValueError, match="is larger than 16 bytes"):
        read_regular_file("/proc/self/status", "config file", limit=16)


@pytest.mark.parametrize("path, error, message", [
    (3, TypeError, "expected a path (str or os.PathLike), got 3 (int)"),
    (b"x.toml", TypeError, "expected a path (str or os.PathLike), got b'x.toml'"),
    ("a\0b", ValueError, "a path cannot hold a NUL character"),
    ("/no/such/dir/x.toml", ValueError, "does not exist"),
    ("/etc/passwd/x.toml", ValueError, "does not exist"),
])
def test_bad_paths(path: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        read_regular_file(path, "config file")
    assert message in str(info.value)


def test_a_socket_is_refused(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "s.toml"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(ValueError, match="is a socket, not a regular file"):
            read_regular_file(path, "config file")


def test_writing_never_opens_a_fifo_or_device(fifo: FifoWatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a FIFO"):
        write_regular_file(fifo.path, b"{}", "--output")
    with pytest.raises(ValueError, match="is a character device"):
        write_regular_file("/dev/zero", b"{}", "--output")
    with pytest.raises(ValueError, match="is a directory; expected a file path"):
        check_writable_file(tmp_path, "--output")
    with pytest.raises(ValueError, match=r"folder .* does not exist"):
        check_writable_file(tmp_path / "no" / "x.json", "--output")
    target = tmp_path / "out.json"
    write_regular_file(target, b"first, longer", "--output")
    write_regular_file(target, b"second", "--output")
    assert target.read_bytes() == b"second"


def test_file_kind_names_every_kind() -> None:
    assert file_kind(stat.S_IFREG) == "a regular file"
    assert file_kind(stat.S_IFIFO) == "a FIFO (named pipe)"
    assert file_kind(stat.S_IFBLK) == "a block device"
