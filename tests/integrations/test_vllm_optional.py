"""The vLLM integration where vLLM may be missing: ``import app`` never imports vLLM, the
installed entry point is inert without it, and the ``vllm`` extra pulls no CUDA stack."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from app._files import load_toml
from app._imports import import_object
from app.integrations import VLLM_ENTRY_POINT, register_vllm_plugin

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
