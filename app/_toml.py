"""Reading TOML files with typed errors (tomllib on 3.11+, tomli before).

Only regular files of at most ``app._files.MAX_CONFIG_BYTES`` are read, without blocking: a
FIFO, ``/dev/zero`` or a huge file is refused before it is opened (``app._files``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from app._files import read_regular_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


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
