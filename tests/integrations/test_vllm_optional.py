"""The vLLM integration where vLLM may be missing: ``import app`` never imports vLLM, the
installed entry point is inert without it, and the ``vllm`` extra pulls no CUDA stack."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app._files import load_toml
from app._imports import import_object
from app.integrations import VLLM_ENTRY_POINT, register_vllm_plugin

#: starts fresh interpreters: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent.parent


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, check=False, cwd=ROOT)


def test_importing_app_never_imports_vllm() -> None:
    proc = _python("""
        import sys
        import app, app.backends, app.integrations, app.mla, app.model
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_without_vllm_the_plugin_logs_why_and_the_class_module_says_what_to_install() -> None:
    proc = _python("""
        import logging, sys
        sys.modules["vllm"] = None          # as if vLLM were not installed
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        from app.integrations import register_vllm_plugin
        print("returned", register_vllm_plugin())
        try:
            import app.integrations.vllm
        except ImportError as exc:
            print("ImportError", exc)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "returned None" in proc.stdout
    assert "vllm.plugins.app app: not registering" in proc.stderr
    assert "vLLM is not installed" in proc.stderr
    assert "ImportError app.integrations.vllm needs vLLM's MLA prefill" in proc.stdout
    assert "Use inside vLLM" in proc.stdout


def test_pyproject_registers_the_plugin_and_the_extra_pulls_no_cuda() -> None:
    project = load_toml(ROOT / "pyproject.toml", "pyproject")["project"]
    entry_points = project["entry-points"]["vllm.general_plugins"]
    assert import_object(entry_points[VLLM_ENTRY_POINT]) is register_vllm_plugin
    # vllm's own requirements pin a CUDA torch: the extra must not name it (or anything).
    assert project["optional-dependencies"]["vllm"] == []


def test_a_vllm_that_fails_to_import_in_any_way_is_a_problem_never_a_raise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: documented as never raising, it raised when ``import vllm`` failed with
    something other than ImportError (a broken build: an OSError loading its C library)."""
    from app.integrations import _vllm_interface, vllm_interface_problems

    real = importlib.import_module

    def broken(name: str, package: str | None = None) -> object:
        if name == "vllm":
            raise OSError("libcuda.so.1: cannot open shared object file")
        return real(name, package)

    monkeypatch.setattr(_vllm_interface.importlib, "import_module", broken)
    assert vllm_interface_problems() == [
        "vLLM cannot be imported (OSError: libcuda.so.1: cannot open shared object file)"]


def test_binding_a_container_names_the_kinds_it_knows() -> None:
    from app.containers import create_container
    from app.integrations import bind_vllm_container

    with pytest.raises(ValueError, match=r"kind must be one of \['prefill', 'decode'\] or None "
                                         r"\(both\), got 'bogus'"):
        bind_vllm_container(create_container(), kind="bogus")  # type: ignore[arg-type]
