"""Adding a built-in backend is one new module and one table line: proven on a copy of the
package with a fake backend of each kind added exactly that way."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.backends.table import DECODE_BACKENDS, PREFILL_BACKENDS

APP = Path(__file__).parent.parent.parent / "app"

FAKE_MODULE = '''
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend


class FakePrefill(TorchSDPABackend):
    @staticmethod
    def get_name() -> str:
        return "FAKE_PREFILL"


class FakeDecode(TorchSDPADecodeBackend):
    @staticmethod
    def get_name() -> str:
        return "FAKE_DECODE"
'''

CHECK = '''
from app.backends import (MLADecodeBackendEnum, MLAPrefillBackendEnum, get_mla_decode_backend,
                          get_mla_prefill_backend)
from app.backends.fake_backend import FakeDecode, FakePrefill
from app.backends.table import DECODE_BACKENDS, PREFILL_BACKENDS
from app.config import EngineConfig
from app.containers import create_container
from app.platforms import CpuPlatform

class Fakes(CpuPlatform):
    def mla_prefill_backend_priorities(self, selector_config):
        return PREFILL_BACKENDS.names("FAKE_PREFILL", "TORCH_SDPA")
    def mla_decode_backend_priorities(self, selector_config):
        return DECODE_BACKENDS.names("FAKE_DECODE", "TORCH_SDPA")

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
    PREFILL_BACKENDS.names("NOT_IN_TABLE")
except ValueError:
    pass
else:
    raise SystemExit("a priority name outside the table was accepted")
print("ok")
'''


def _add_line(table: str, constant: str, line: str) -> str:
    start = table.index(f"{constant} = BackendTable(")
    end = table.index("])", start)
    return table[:end] + line + table[end:]


def test_one_module_and_one_table_line_add_a_backend(tmp_path: Path) -> None:
    copy = tmp_path / "app"
    shutil.copytree(APP, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (copy / "backends" / "fake_backend.py").write_text(FAKE_MODULE)
    table_path = copy / "backends" / "table.py"
    table = table_path.read_text()
    module = "app.backends.fake_backend"
    table = _add_line(table, "PREFILL_BACKENDS",
                      f'    BackendEntry("FAKE_PREFILL", "{module}.FakePrefill"),\n')
    table = _add_line(table, "DECODE_BACKENDS",
                      f'    BackendEntry("FAKE_DECODE", "{module}.FakeDecode"),\n')
    table_path.write_text(table)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK)], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "APP_PLUGINS": "",
                               "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("table", [PREFILL_BACKENDS, DECODE_BACKENDS])
def test_table_names_are_unique_and_paths_dotted(table: object) -> None:
    names = [entry.name for entry in table]  # type: ignore[attr-defined]
    assert len(names) == len(set(names)) and "CUSTOM" not in names
    assert all("." in entry.class_path for entry in table)  # type: ignore[attr-defined]
