"""The package's metadata: what a fresh ``pip install -e .`` brings (issue 12, item 11)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from app._files import load_toml
from tests._support import KERNEL_PACKAGES

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


#: The distributions of the optional GPU kernel packages (``tests._support.KERNEL_PACKAGES``).
KERNEL_DISTRIBUTIONS = {"flashinfer": "flashinfer-python", "tokenspeed_mla": "tokenspeed-mla",
                        "flash_attn": "flash-attn"}


def _optional_kernel_requirements() -> list[Requirement]:
    extras = load_toml(ROOT / "pyproject.toml", "pyproject")["project"]["optional-dependencies"]
    found = [Requirement(r) for group in extras.values() for r in group]
    return [r for r in found if canonicalize_name(r.name) in
            {canonicalize_name(d) for d in KERNEL_DISTRIBUTIONS.values()}]


def test_kernel_packages_cover_the_import_names() -> None:
    assert set(KERNEL_DISTRIBUTIONS) == set(KERNEL_PACKAGES)


def test_every_optional_kernel_package_has_an_upper_bound() -> None:
    """Issue 43: ``flashinfer-python>=0.7`` resolved to 0.7.4, whose private modules had moved,
    and the suite failed on a fresh venv. Each kernel package is pinned to the range a run has
    passed on: an upper bound, moved only with a passing run."""
    reqs = _optional_kernel_requirements()
    assert {canonicalize_name(r.name) for r in reqs} >= {"flashinfer-python", "tokenspeed-mla"}
    for req in reqs:
        uppers = [s for s in req.specifier if s.operator in ("<", "<=", "~=", "==")]
        assert uppers, f"{req}: an optional kernel package needs an upper bound"


def test_installed_kernel_packages_are_inside_the_pinned_range() -> None:
    """Where a kernel package is installed, the suite runs against it: it must be a release
    inside the pinned range, or the suite's verdict says nothing about the range."""
    checked = 0
    for req in _optional_kernel_requirements():
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert req.specifier.contains(version, prereleases=True), (req, version)
        checked += 1
    if not checked:
        pytest.skip("no optional kernel package installed")
