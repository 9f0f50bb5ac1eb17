"""Reading TOML files with typed errors (tomllib on 3.11+, tomli before)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def load_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed file; ``ValueError`` naming ``what`` (e.g. ``"config file"``) and the path
    when it does not exist or is not valid TOML."""
    source = f"{what} {str(path)!r}"
    try:
        with Path(path).open("rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)  # tomli (checked as 3.10) is untyped
    except FileNotFoundError:
        raise ValueError(f"{source} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source} is not valid TOML: {exc}") from None
    return data
