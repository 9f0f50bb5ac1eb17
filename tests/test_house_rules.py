"""Rules that keep the library honest: no assert for validation, no print, a complete __all__."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).parent.parent / "app"
PUBLIC_PACKAGES = ["app", "app.backends", "app.kvcache", "app.platforms", "app.testing",
                   "app.mla", "app.deployment", "app.plugins", "app.config", "app.containers",
                   "app.integrations"]


def _sources() -> list[Path]:
    return sorted(APP.rglob("*.py"))


def test_no_assert_statements_in_the_library() -> None:
    offenders = [f"{path.relative_to(APP.parent)}:{node.lineno}"
                 for path in _sources()
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Assert)]
    assert offenders == [], "validation must raise typed errors, not assert"


def test_no_print_outside_the_cli() -> None:
    offenders = []
    for path in _sources():
        rel = path.relative_to(APP)
        if rel.parts[0] == "commands" or rel.name in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == [], "the library logs through the 'app' logger"


def test_no_file_over_600_lines() -> None:
    long = {str(p.relative_to(APP)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


@pytest.mark.parametrize("name", PUBLIC_PACKAGES)
def test_all_is_complete_and_documented(name: str) -> None:
    """Every public class or function of ours that a public module holds is in ``__all__``;
    every ``__all__`` name exists; every exported class and function has a docstring."""
    module = importlib.import_module(name)
    exported = set(module.__all__)
    # A package re-exports its submodules' API; a plain module exports what it defines.
    is_package = hasattr(module, "__path__")
    api = {n for n, v in vars(module).items()
           if not n.startswith("_") and _is_api(v)
           and ((getattr(v, "__module__", None) or "").startswith("app") if is_package
                else getattr(v, "__module__", None) == name)}
    assert sorted(api - exported) == [], f"{name}.__all__ is missing names"
    assert sorted(n for n in exported if not hasattr(module, n)) == []
    undocumented = sorted(n for n in exported
                          if _is_api(getattr(module, n)) and not inspect.getdoc(getattr(module, n)))
    assert undocumented == []


def _is_api(value: object) -> bool:
    return inspect.isclass(value) or inspect.isfunction(value)


def test_validation_survives_python_O() -> None:
    code = """
import sys
from app.config import ModelConfig, CacheConfig
from app.containers import use_container
checks = [
    lambda: ModelConfig(num_heads=-1),
    lambda: CacheConfig(block_size=3),
    lambda: ModelConfig(dtype="int4"),
    lambda: use_container("x").__enter__(),
]
for check in checks:
    try:
        check()
    except (ValueError, TypeError):
        continue
    sys.exit("validation vanished under -O")
assert False, "asserts are off"  # must not fire under -O
print("ok")
"""
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
