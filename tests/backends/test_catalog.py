"""Adding a built-in backend is one new module and one catalog line: proven on a copy of the
package with a fake backend of each kind added exactly that way (the classes declare no name:
they take it from their catalog line)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.backends.catalog import DECODE_BACKENDS, PREFILL_BACKENDS, BackendCatalog

APP = Path(__file__).parent.parent.parent / "app"

FAKE_MODULE = '''
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend


class FakePrefill(TorchSDPABackend):
    pass


class FakeDecode(TorchSDPADecodeBackend):
    pass
'''

CHECK = '''
from app.backends import (MLADecodeBackendEnum, MLAPrefillBackendEnum, get_mla_decode_backend,
                          get_mla_prefill_backend)
from app.backends.fake_backend import FakeDecode, FakePrefill
from app.backends.catalog import DECODE_BACKENDS, PREFILL_BACKENDS
from app.config import EngineConfig
from app.containers import create_container
from app.platforms import CpuPlatform

class Fakes(CpuPlatform):
    def mla_prefill_backend_priorities(self, selector_config):
        return PREFILL_BACKENDS.check("FAKE_PREFILL", "TORCH_SDPA")
    def mla_decode_backend_priorities(self, selector_config):
        return DECODE_BACKENDS.check("FAKE_DECODE", "TORCH_SDPA")

assert FakePrefill.get_name() == "FAKE_PREFILL" and FakeDecode.get_name() == "FAKE_DECODE"

assert MLAPrefillBackendEnum.FAKE_PREFILL.value == "app.backends.fake_backend.FakePrefill"
assert MLADecodeBackendEnum["FAKE_DECODE"].get_class() is FakeDecode
c = create_container(platform=Fakes())
assert c.mla_prefill_backends.FAKE_PREFILL() is FakePrefill
assert c.mla_prefill_backend_class() is FakePrefill
assert c.mla_decode_backend_class() is FakeDecode
forced = EngineConfig.from_dict({"attention": {"mla_prefill_backend": "FAKE_PREFILL",
                                               "mla_decode_backend": "FAKE_DECODE"}})
assert get_mla_prefill_backend(forced, container=create_container(forced)) is FakePrefill
assert get_mla_decode_backend(forced, container=create_container(forced)) is FakeDecode
try:
    PREFILL_BACKENDS.check("NOT_IN_CATALOG")
except ValueError:
    pass
else:
    raise SystemExit("a priority name outside the table was accepted")
print("ok")
'''


def _add_line(catalog: str, constant: str, line: str) -> str:
    start = catalog.index(f"{constant} = BackendCatalog(")
    end = catalog.index("})", start)
    return catalog[:end] + line + catalog[end:]


@pytest.mark.slow
def test_one_module_and_one_catalog_line_add_a_backend(tmp_path: Path) -> None:
    copy = tmp_path / "app"
    shutil.copytree(APP, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (copy / "backends" / "fake_backend.py").write_text(FAKE_MODULE)
    catalog_path = copy / "catalog.py"  # app/catalog.py (app.backends.catalog re-exports it)
    catalog = catalog_path.read_text()
    module = "app.backends.fake_backend"
    catalog = _add_line(catalog, "PREFILL_BACKENDS",
                        f'    "FAKE_PREFILL": "{module}.FakePrefill",\n')
    catalog = _add_line(catalog, "DECODE_BACKENDS",
                        f'    "FAKE_DECODE": "{module}.FakeDecode",\n')
    catalog_path.write_text(catalog)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "APP_PLUGINS": "",
                               "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("catalog", [PREFILL_BACKENDS, DECODE_BACKENDS])
def test_catalog_names_are_unique_and_paths_dotted(catalog: BackendCatalog) -> None:
    names = list(catalog.builtins)
    assert len(names) == len(set(names)) and "CUSTOM" not in names
    assert all("." in path for path in catalog.builtins.values())
    assert list(catalog)[:len(names) + 1] == [*names, "CUSTOM"]


@pytest.mark.parametrize("catalog", [PREFILL_BACKENDS, DECODE_BACKENDS])
def test_each_builtin_takes_its_name_from_its_catalog_line(catalog: BackendCatalog) -> None:
    """The name is written once: in the catalog, never again in the class."""
    from app._imports import import_object

    for name, path in catalog.builtins.items():
        cls = import_object(path)
        assert cls.get_name() == name == cls.name
        assert "get_name" not in vars(cls) and "name" in vars(cls)
