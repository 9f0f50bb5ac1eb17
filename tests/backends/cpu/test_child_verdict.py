"""A library's first self-test on a machine in a child process (``child_test`` specs), and the
verdict kept beside it: a crash (SIGILL, as an instruction the CPU lacks raises) or a failed
self-test refuses the library in this process, which never runs it, and is kept, so the
next start refuses it at once without a rebuild; a pass is kept too, and the child is not
started again; a verdict of another CPU, an untrusted file or a child that could not test
the library keeps nothing."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.backends.cpu import child_self_test, child_verdict, loader
from app.backends.cpu.child_verdict import Verdict, read_verdict, verdict_path
from app.backends.cpu.loader import load_native_library, reset_native_libraries
from tests._support import native_compiler_or_skip
from tests.backends.cpu import _child_specs as specs

#: builds native kernels and self-tests them in child processes: outside the quick
#: subset (-m "not slow").
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    native_compiler_or_skip()
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    names = [s.name for s in (specs.SPEC_PASS, specs.SPEC_WRONG, specs.SPEC_CRASH,
                              specs.SPEC_UNIMPORTABLE)]
    for name in names:
        reset_native_libraries(name)
    yield
    for name in names:
        reset_native_libraries(name)


def _no_child(*args: Any) -> Verdict:
    raise AssertionError("a kept verdict must not start the child again")


def _library_files(tmp_path: Path, name: str) -> list[Path]:
    return sorted((tmp_path / "cache" / "cpu-kernels").glob(f"{name}-*.so"))


def test_a_passing_library_is_used_and_its_verdict_kept(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    status = load_native_library(specs.SPEC_PASS)
    assert status.available, status.reasons
    assert status.path is not None and read_verdict(status.path) == Verdict(True)
    saved = json.loads(verdict_path(status.path).read_text())
    assert saved["library"] == status.path.name and saved["machine"] == \
        child_verdict.machine_key()
    assert verdict_path(status.path).stat().st_mode & 0o777 == 0o600
    reset_native_libraries(specs.SPEC_PASS.name)
    monkeypatch.setattr(child_verdict, "run_child", _no_child)
    assert load_native_library(specs.SPEC_PASS).available


def test_a_crash_in_the_child_refuses_the_library_and_is_kept(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    status = load_native_library(specs.SPEC_CRASH)   # would kill pytest if it ran here
    assert not status.available
    assert "crashed its child process with SIGILL" in status.reasons[0]
    [library] = _library_files(tmp_path, specs.SPEC_CRASH.name) or [None]
    assert library is None   # a build that failed its checks is never put in place
    kept = sorted((tmp_path / "cache" / "cpu-kernels").glob("*.verdict.json"))
    assert len(kept) == 1 and not json.loads(kept[0].read_text())["passed"]

    reset_native_libraries(specs.SPEC_CRASH.name)
    monkeypatch.setattr(child_verdict, "run_child", _no_child)
    monkeypatch.setattr(loader, "_build_and_open", _no_child)   # not rebuilt either
    again = load_native_library(specs.SPEC_CRASH)
    assert not again.available
    assert "failed its self-test on this machine" in again.reasons[0]
    assert "delete it to test again" in again.reasons[0] and "SIGILL" in again.reasons[0]


def test_a_wrong_answer_in_the_child_is_a_kept_failure(tmp_path: Path) -> None:
    status = load_native_library(specs.SPEC_WRONG)
    assert not status.available
    assert "in a child process: self-test against float64 failed" in status.reasons[0]
    reset_native_libraries(specs.SPEC_WRONG.name)
    assert "failed its self-test on this machine" in \
        load_native_library(specs.SPEC_WRONG).reasons[0]


def test_a_child_that_cannot_test_keeps_no_verdict(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(child_verdict, "run_child", lambda ref, path: Verdict(
        False, "the self-test in a child process took longer than 300 s", cacheable=False))
    status = load_native_library(specs.SPEC_UNIMPORTABLE)
    assert not status.available and "took longer" in status.reasons[0]
    assert list((tmp_path / "cache" / "cpu-kernels").glob("*.verdict.json")) == []


def test_the_child_says_when_it_cannot_test(capsys: pytest.CaptureFixture[str]) -> None:
    """The child's own answers, run here (no process needed for these)."""
    assert child_self_test.main(["tests.backends.cpu._child_specs:NO_SUCH_SPEC", "x.so"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "cannot import the spec" in answer["problem"] and answer["about_library"] is False
    assert child_self_test.main(["tests.backends.cpu._child_specs:SOURCE", "x.so"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "is not a native library spec" in answer["problem"]
    assert answer["about_library"] is False
    assert child_self_test.main(["no-colon", "x.so"]) == 2


@pytest.mark.parametrize(("returncode", "stdout", "passed", "cacheable", "says"), [
    (-4, "", False, True, "SIGILL"), (-11, "", False, True, "SIGSEGV"),
    (-9, "", False, False, "SIGKILL"), (1, "Traceback ...", False, False, "exit 1"),
    (0, "noise\n{\"problem\": null}", True, True, None),
    (0, '{"problem": "max error 3", "about_library": true}', False, True, "max error 3"),
    (0, '{"problem": "no import", "about_library": false}', False, False, "no import")])
def test_run_child_reads_exit_codes_signals_and_the_verdict_line(
        monkeypatch: pytest.MonkeyPatch, returncode: int, stdout: str, passed: bool,
        cacheable: bool, says: str | None) -> None:
    def fake_run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert argv[1:4] == ["-m", child_verdict.CHILD_MODULE, "pkg.mod:SPEC"]
        assert kwargs["env"][child_verdict.IN_CHILD_ENV] == "1"
        return subprocess.CompletedProcess(argv, returncode, stdout, "")

    monkeypatch.setattr(child_verdict.subprocess, "run", fake_run)
    verdict = child_verdict.run_child("pkg.mod:SPEC", Path("lib.so"))
    assert (verdict.passed, verdict.cacheable) == (passed, cacheable)
    assert (verdict.problem is None) if says is None else (says in str(verdict.problem))


def test_a_child_out_of_time_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr(child_verdict.subprocess, "run", slow)
    verdict = child_verdict.run_child("pkg.mod:SPEC", Path("lib.so"), timeout=5)
    assert not verdict.passed and not verdict.cacheable and "longer than 5 s" in str(
        verdict.problem)


def test_another_cpus_or_an_untrusted_verdict_is_not_read(tmp_path: Path) -> None:
    status = load_native_library(specs.SPEC_PASS)
    assert status.path is not None
    path = verdict_path(status.path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "machine": "another-cpu"}))
    assert read_verdict(status.path) is None
    path.write_text(json.dumps(data))
    assert read_verdict(status.path) == Verdict(True)
    path.chmod(0o666)
    assert read_verdict(status.path) is None
    path.chmod(0o600)
    path.write_text(json.dumps({**data, "library": "other.so"}))
    assert read_verdict(status.path) is None


def test_a_verdict_that_says_nothing_about_the_library_is_not_written(tmp_path: Path
                                                                       ) -> None:
    child_verdict.write_verdict(tmp_path / "lib.so", Verdict(False, "x", cacheable=False))
    assert not verdict_path(tmp_path / "lib.so").exists()
