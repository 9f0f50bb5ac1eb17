"""The package's metadata: what a fresh ``pip install -e .`` brings (issue 12, item 11)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app._files import load_toml

ROOT = Path(__file__).resolve().parent.parent


def test_numpy_is_a_dependency() -> None:
    # Without numpy torch prints "Failed to initialize NumPy: No module named 'numpy'" on the
    # README's main command in a fresh virtualenv (torch does not depend on numpy itself).
    deps = load_toml(ROOT / "pyproject.toml", "pyproject")["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].split(";")[0].strip() == "numpy" for d in deps), deps


@pytest.mark.slow
def test_the_first_command_prints_no_warning() -> None:
    proc = subprocess.run([sys.executable, "-m", "app", "platform"], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
