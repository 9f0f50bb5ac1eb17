"""Reading a device capability a user wrote (``--capability``, ``platform = "cuda:X.Y"``)."""

from __future__ import annotations

import pytest

from app.platforms import DeviceCapability, parse_device_capability


@pytest.mark.parametrize("text, expected", [("9.0", (9, 0)), ("10.0", (10, 0)),
                                            ("12.1", (12, 1)), ("8.9", (8, 9))])
def test_parse(text: str, expected: tuple[int, int]) -> None:
    assert parse_device_capability(text) == DeviceCapability(*expected)


@pytest.mark.parametrize("text", [
    "99.9", "16.0", "0.0", "1_0.0", "\u0969.\u0966", "\uff19.\uff10", "1" * 23 + ".0", "-1.0",
    "9", "9.", ".9", "9.10", " 9.0", "9.0 ", "+9.0", "9.0.0", "", "nine"])
def test_refuse(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected MAJOR\.MINOR with ASCII digits, major 1-15 "
                                         r"and minor 0-9 .*, got "):
        parse_device_capability(text)


def test_not_a_string() -> None:
    with pytest.raises(TypeError, match="expected a device capability string"):
        parse_device_capability(9.0)
