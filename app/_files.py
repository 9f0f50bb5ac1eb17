"""Reading and writing the files a user names (config and deployment files, ``--output``, a
checkpoint's JSON files), and parsing TOML (``load_toml``: tomllib on 3.11+, tomli before) and
JSON (``load_json``) from them.

A path a user gives may name anything: a FIFO (opening one for reading waits for a writer,
forever), a character device (``/dev/zero`` never ends, ``/dev/stdin`` waits), a directory, a
socket or a file of many gigabytes. So a file is read only when it is a regular file of at most
``limit`` bytes: checked with ``os.stat`` before it is opened (a FIFO is never opened), opened
with ``O_NONBLOCK`` (a FIFO swapped in after the check cannot block either), checked again on
the open descriptor, and read to at most ``limit + 1`` bytes (a file that grows, or a ``/proc``
file whose size reads 0, cannot run past the limit). A file is written only when it is a
regular file or does not exist yet. Every refusal is a ``ValueError`` (``TypeError`` for a
path that is not one) naming what the file is for, the path and what was found.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_JSON_INT_DIGITS",
    "HugeJsonInt",
    "check_writable_file",
    "file_kind",
    "load_json",
    "load_toml",
    "private_file_problem",
    "read_regular_file",
    "trusted_tree_problem",
    "write_regular_file",
]

#: The largest config or deployment file read (far above any real one; a typo such as a
#: log file or a disk image is refused before it fills memory).
MAX_CONFIG_BYTES = 16 << 20
#: Integers of more digits than this are read as a ``HugeJsonInt`` by ``load_json`` (no size or
#: count in a model config has 30 digits; Python refuses to convert 4300 or more at all).
MAX_JSON_INT_DIGITS = 30
_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_CLOEXEC", 0))
_WRITE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NONBLOCK", 0)
                | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def file_kind(mode: int) -> str:
    """What an ``st_mode`` names, in words: ``"a regular file"``, ``"a FIFO (named pipe)"`` ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _as_path(path: object, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: expected a path (str or os.PathLike), got {path!r} "
                        f"({type(path).__name__})")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected a str path, got {text!r}")
    if "\0" in text:
        raise ValueError(f"{what} {text!r}: a path cannot hold a NUL character")
    return Path(text)


def _os_error(source: str, exc: OSError) -> ValueError:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return ValueError(f"{source} does not exist")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ValueError(f"{source} cannot be read: permission denied")
    return ValueError(f"{source} cannot be read: {exc.strerror or exc}")


def _check_regular(source: str, mode: int, expected: str) -> None:
    if stat.S_ISDIR(mode):
        raise ValueError(f"{source} is a directory; expected {expected}")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{source} is {file_kind(mode)}, not a regular file; expected "
                         f"{expected}")


def _check_size(source: str, size: int, limit: int) -> None:
    if size > limit:
        raise ValueError(f"{source} is larger than {limit} bytes ({limit >> 20} MiB), the most "
                         f"a file of its kind may hold; is it the right file?")


def read_regular_file(path: object, what: str, *, expected: str = "a TOML file",
                      limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), never blocking.

    ``what`` names the file's role (``"config file"``); ``expected`` what it should be.
    ``ValueError`` when it does not exist, cannot be read, is a directory, FIFO, device or
    socket (a symbolic link is followed), or holds more than ``limit`` bytes."""
    source = f"{what} {str(path)!r}"
    file = _as_path(path, what)
    try:
        _check_regular(source, os.stat(file).st_mode, expected)
        fd = os.open(file, _READ_FLAGS)
    except OSError as exc:
        raise _os_error(source, exc) from None
    try:
        status = os.fstat(fd)  # the file opened may not be the one checked (a swap)
        _check_regular(source, status.st_mode, expected)
        _check_size(source, status.st_size, limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise _os_error(source, exc) from None
    finally:
        os.close(fd)
    _check_size(source, size, limit)
    return b"".join(chunks)


def check_writable_file(path: object, what: str) -> Path:
    """``path`` as a ``Path`` if a result can be written there: a regular file, or a new file
    in an existing, writable folder; ``ValueError`` saying what is wrong otherwise."""
    file = _as_path(path, what)
    source = f"{what} {str(path)!r}"
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError(f"{source} cannot be written: {exc.strerror or exc}") from None
    if mode is not None:
        _check_regular(source, mode, "a file path")
        if not os.access(file, os.W_OK):
            raise ValueError(f"{source} is not writable")
        return file
    folder = file.parent if str(file.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{source}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{source} is not writable")
    return file


def write_regular_file(path: object, data: bytes, what: str) -> None:
    """Write ``data`` to ``path``, a regular file or a new one; never opens a FIFO or device
    for writing (a FIFO with no reader would block, ``/dev/zero`` would swallow the result)."""
    file = check_writable_file(path, what)
    source = f"{what} {str(path)!r}"
    try:
        fd = os.open(file, _WRITE_FLAGS, 0o666)
    except OSError as exc:
        raise ValueError(f"{source} cannot be written: {exc.strerror or exc}") from None
    try:
        _check_regular(source, os.fstat(fd).st_mode, "a file path")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise ValueError(f"{source} cannot be written: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def load_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed file. ``ValueError`` naming ``what`` (e.g. ``"config file"``) and the path when
    it does not exist, is not a regular file (a directory, FIFO, device or socket), is larger
    than 16 MiB or cannot be read, is not UTF-8 (with the line and column of the first bad
    byte), is nested too deeply to parse or is not valid TOML; ``TypeError`` for a path that
    is not a str or ``os.PathLike``."""
    source = f"{what} {str(path)!r}"
    raw = read_regular_file(path, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(f"{source} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at line "
                         f"{line}, column {column} ({exc.reason}); TOML files must be UTF-8"
                         ) from None
    # A UTF-8 byte-order mark (some Windows editors write one) is not content.
    text = text.removeprefix("\ufeff")
    try:
        data: dict[str, Any] = tomllib.loads(text)  # tomli (checked as 3.10) is untyped
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source} is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays/tables
        raise ValueError(f"{source} nests arrays or inline tables too deeply to parse (a few "
                         f"hundred levels); no configuration needs more than a few") from None
    return data


class HugeJsonInt:
    """An integer literal of more than ``MAX_JSON_INT_DIGITS`` digits in a JSON file, kept as
    text (``load_json``): every reader of an int refuses it as not an int, naming its key."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<an integer of {len(self.text.lstrip('-'))} digits>"


def _parse_int(text: str) -> int | HugeJsonInt:
    return HugeJsonInt(text) if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS else int(text)


def load_json(path: str | Path, what: str, *, limit: int = MAX_CONFIG_BYTES) -> Any:
    """The parsed JSON file (any JSON value; ``NaN`` and ``Infinity`` read as floats, for the
    caller to refuse by key). ``ValueError`` naming ``what`` (e.g. ``"config.json"``) and the
    path when it does not exist, is not a regular file, holds more than ``limit`` bytes, is not
    UTF-8, nests too deeply to parse or is not valid JSON; an integer of more than
    ``MAX_JSON_INT_DIGITS`` digits reads as a ``HugeJsonInt``."""
    source = f"{what} {str(path)!r}"
    raw = read_regular_file(path, what, expected="a JSON file", limit=limit)
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset "
                         f"{exc.start} ({exc.reason})") from None
    try:
        return json.loads(text, parse_int=_parse_int)
    except RecursionError:  # json recurses once per level of nested arrays / objects
        raise ValueError(f"{source} nests arrays or objects too deeply to parse (hundreds of "
                         f"levels); no configuration needs more than a few") from None
    except ValueError as exc:  # json.JSONDecodeError is one
        raise ValueError(f"{source} is not valid JSON: {exc}") from None


def private_file_problem(st: os.stat_result) -> str | None:
    """Why a file with this ``lstat`` may not be trusted as this user's own (a link, not a
    regular file, another owner, writable by group or others), or None: what the native
    loader asks of a cached library and of a kept verdict before either is read."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _shared_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a file or directory with this ``stat`` is not this user's or root's alone."""
    if st.st_uid not in (0, uid):
        return f"is owned by uid {st.st_uid}, neither this user (uid {uid}) nor root"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted_tree_problem(folder: str | Path, *, limit: int = 20_000) -> str | None:
    """Why the files under ``folder`` may not be compiled into code this process loads (a
    folder of headers a native build includes), or None: ``folder`` is a directory owned by
    this user or root and not writable by group or others; each directory above it is owned
    by this user or root and not writable by group or others unless sticky (as ``/tmp``); and
    everything below it is a directory or a regular file (no symbolic link) owned by this user
    or root and not writable by group or others. A tree of more than ``limit`` entries is
    refused (too many to check)."""
    uid = os.geteuid()
    real = Path(os.path.realpath(folder))
    try:
        st = os.stat(real)
        parents = [(parent, os.stat(parent)) for parent in real.parents]
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{real} is not a directory"
    problem = _shared_problem(st, uid)
    if problem is not None:
        return f"{real} {problem}"
    for parent, pst in parents:
        problem = _shared_problem(pst, uid)
        if problem is not None and not (pst.st_uid in (0, uid) and pst.st_mode & stat.S_ISVTX):
            return f"{real}: its parent {parent} {problem}"
    todo, seen = [real], 0
    while todo:
        directory = todo.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            return f"{directory}: {exc.strerror}"
        for entry in entries:
            seen += 1
            if seen > limit:
                return f"{real} holds more than {limit} entries: too many to check"
            est = entry.stat(follow_symlinks=False)
            if not (stat.S_ISDIR(est.st_mode) or stat.S_ISREG(est.st_mode)):
                return f"{entry.path} is {file_kind(est.st_mode)}, not a file or a directory"
            problem = _shared_problem(est, uid)
            if problem is not None:
                return f"{entry.path} {problem}"
            if stat.S_ISDIR(est.st_mode):
                todo.append(Path(entry.path))
    return None
