"""``app._toml.load_toml``: what a TOML file a user names may hold (the hostile paths are in
tests/test_files.py and tests/cli/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app._toml import load_toml


def test_a_byte_order_mark_is_not_content(tmp_path: Path) -> None:
    # Some Windows editors start UTF-8 files with one; tomllib called it an "Invalid statement".
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[model]\nnum_heads = 4\n")
    assert load_toml(path, "config file") == {"model": {"num_heads": 4}}


def test_a_byte_order_mark_elsewhere_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "bom.toml"
    path.write_bytes(b"[model]\n\xef\xbb\xbfnum_heads = 4\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_toml(path, "config file")
