"""A library's first self-test on a machine in a child process (``child_test`` specs), and the
verdict kept beside it: a crash (SIGILL, as an instruction the CPU lacks raises) or a failed
self-test refuses the library in this process, which never runs it, and is kept, so the
next start refuses it at once without a rebuild; a pass is kept too, and the child is not
started again; a verdict of another CPU, an untrusted file or a child that could not test
the library keeps nothing."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.backends.cpu import child_self_test, child_verdict, loader
from app.backends.cpu.child_verdict import Verdict, read_verdict, verdict_path
from app.backends.cpu.loader import load_native_library, reset_native_libraries
from tests.backends.cpu import _child_specs as specs

#: builds native kernels and self-tests them in child processes: outside the quick
#: subset (-m "not slow").
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The test library is plain C (no AVX-512); its crash is x86's ud2 (SIGILL).
    if loader.find_compiler() is None or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs an x86-64 CPU and a C compiler")
    monkeypatch.setenv("APP_CACHE_DIR", str(tmp_path / "cache"))
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
        assert argv[1:3] == ["-I", "-c"] and argv[-2:] == ["pkg.mod:SPEC", "lib.so"]
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


# -- the child runs this package's code, never what lies in the current directory (issue 44) --

@pytest.mark.parametrize("planted_on", ["cwd", "PYTHONPATH"])
def test_the_child_runs_this_package_never_an_app_in_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted_on: str) -> None:
    """A package named ``app`` where the engine happens to be started (or on $PYTHONPATH, which
    the child ignores too: it imports what this process imports) is never imported by the
    child: the verdict is the real self-test's."""
    library = load_native_library(specs.SPEC_PASS).path
    assert library is not None
    planted, marker = tmp_path / "planted", tmp_path / "planted-code-ran"
    package = planted / "app" / "backends" / "cpu"
    package.mkdir(parents=True)
    for directory in (planted / "app", planted / "app" / "backends", package):
        (directory / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "child_self_test.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nprint('{{\"problem\": \"planted\"}}')\n")
    if planted_on == "cwd":
        monkeypatch.chdir(planted)
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("PYTHONPATH", str(planted))
    verdict = child_verdict.run_child(str(specs.SPEC_PASS.child_test), library)
    assert not marker.exists(), "the child imported the planted app"
    assert verdict == Verdict(True)


# -- a kept verdict that cannot be used is ignored, said, and replaced (issue 44) -------------

def _valid(library: Path) -> dict[str, Any]:
    return {"library": library.name, "machine": child_verdict.machine_key(), "passed": False,
            "problem": "kept"}


def _write(text: str | bytes) -> Any:
    def plant(path: Path, library: Path) -> None:
        path.write_bytes(text.encode() if isinstance(text, str) else text)
    return plant


def _fields(**fields: object) -> Any:
    def plant(path: Path, library: Path) -> None:
        path.write_text(json.dumps({**_valid(library), **fields}))
    return plant


def _fifo(path: Path, library: Path) -> None:
    os.mkfifo(path, 0o600)


def _symlink(path: Path, library: Path) -> None:
    elsewhere = path.with_name("elsewhere.json")
    elsewhere.write_text(json.dumps(_valid(library)))
    path.symlink_to(elsewhere)


def _sparse_huge(path: Path, library: Path) -> None:
    path.write_text(json.dumps(_valid(library)))
    os.truncate(path, 1 << 33)  # 8 GiB of holes: never read


def _group_writable(path: Path, library: Path) -> None:
    path.write_text(json.dumps(_valid(library)))
    path.chmod(0o620)


def _another_owner(path: Path, library: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path.write_text(json.dumps(_valid(library)))
    os.chown(path, 65534, 65534)


HOSTILE_VERDICTS = {
    "deep list": (_write("[" * 30000 + "]" * 30000), "nested too deeply"),
    "deep object": (_write('{"a":' * 10000 + "1" + "}" * 10000), "nested too deeply"),
    "deep under a valid key": (_fields(problem=[[[[]]]], passed=False), "'problem' is"),
    "huge": (_fields(problem="x" * 70000), "more than the 65536"),
    "sparse 8 GiB": (_sparse_huge, "more than the 65536"),
    "not JSON": (_write('{"passed": false,'), "not JSON"),
    "not UTF-8": (_write(b'{"passed": false, "problem": "\xff\xfe"}'), "not UTF-8"),
    "empty": (_write(""), "not JSON"),
    "a list": (_write("[false]"), "JSON list, not an object"),
    "passed as a string": (_fields(passed="false"), "'passed' is 'false'"),
    "passed as a number": (_fields(passed=0), "'passed' is 0"),
    "problem as a number": (_fields(problem=5), "'problem' is 5"),
    "library as null": (_fields(library=None), "'library' is None"),
    "machine missing": (_write('{"library": "x", "passed": false}'), "'machine' is None"),
    "another library": (_fields(library="other.so"), "another library, 'other.so'"),
    "a FIFO": (_fifo, "not a regular file"),
    "a symbolic link": (_symlink, "symbolic link"),
    "group-writable": (_group_writable, "writable by group or others"),
    "another owner": (_another_owner, "owned by uid 65534"),
}


@pytest.mark.parametrize("case", list(HOSTILE_VERDICTS))
def test_a_verdict_that_cannot_be_used_is_ignored_said_and_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Whatever lies in ``<library>.verdict.json`` (here a failed verdict the loader must not
    obey, made unreadable or untrusted), the library is tested again, used, and the file
    replaced by a fresh verdict; the note says what was ignored and why."""
    plant, says = HOSTILE_VERDICTS[case]
    children: list[Path] = []

    def run_child(ref: str, path: Path) -> Verdict:
        children.append(path)
        return Verdict(True)

    monkeypatch.setattr(child_verdict, "run_child", run_child)
    library = load_native_library(specs.SPEC_PASS).path
    assert library is not None and children
    reset_native_libraries(specs.SPEC_PASS.name)
    children.clear()
    path = verdict_path(library)
    path.unlink()
    plant(path, library)
    status = load_native_library(specs.SPEC_PASS)
    assert status.available, status.reasons
    assert len(children) == 1  # tested again
    [note] = [n for n in status.notes if "ignored the kept verdict" in n]
    assert str(path) in note and says in note and "the self-test runs again" in note
    assert len(note) < 500
    assert not path.is_symlink() and read_verdict(library) == Verdict(True)  # replaced


def test_a_deeply_nested_verdict_is_tested_again_in_a_real_child(tmp_path: Path) -> None:
    """The issue's file, end to end: it once raised RecursionError and the library was refused
    at every start."""
    library = load_native_library(specs.SPEC_PASS).path
    assert library is not None
    reset_native_libraries(specs.SPEC_PASS.name)
    verdict_path(library).write_text("[" * 30000 + "]" * 30000)
    status = load_native_library(specs.SPEC_PASS)
    assert status.available, status.reasons
    assert any("nested too deeply" in note for note in status.notes)
    assert read_verdict(library) == Verdict(True)
    reset_native_libraries(specs.SPEC_PASS.name)
    assert load_native_library(specs.SPEC_PASS).notes == ()  # the next start: nothing to say
