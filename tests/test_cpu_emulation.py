"""``APP_CPU_EMULATE_AVX512`` (``app._cpu.emulation``): when it takes effect, what the CPU's
features then read, why it does not take effect elsewhere, the trust check of the SIMDe folder
a user names, and the flags an emulated build gets."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import _cpu
from app._cpu import emulation
from app._cpu.emulation import (
    EMULATE_ENV,
    EMULATED_FLAGS,
    HOST_FLAGS,
    SIMDE_INCLUDE_ENV,
    Avx512Emulation,
    emulated_build_flags,
)
from app._files import trusted_tree_problem
from app.cli import main

AVX2 = "fpu sse sse2 avx fma f16c avx2"
HEADER = Path("/nowhere/app_avx512_emulation.h")
ACTIVE = Avx512Emulation(True, True, "faked", ("-I", "/opt/simde"), "0.7.4")
SYSTEM_SIMDE = Path("/usr/include/simde")


@pytest.fixture
def switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The switch and the folder unset, the features re-read before and after."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.delenv(SIMDE_INCLUDE_ENV, raising=False)
    _cpu._reset_for_tests()
    yield monkeypatch
    monkeypatch.undo()
    _cpu._reset_for_tests()


def _decide(folder: str = "", flags: frozenset[str] = HOST_FLAGS, compiler: str | None = "cc",
            machine: str = "x86_64", raw: str = "1") -> Avx512Emulation:
    """The decision for a machine described whole (no CPU, compiler or folder of this one is
    read, but for the folder's files and a compiler probe where they get that far)."""
    return emulation._decide(raw, folder, flags, compiler, machine)


# -- when it takes effect --------------------------------------------------------------------

def test_off_unless_switched_on(switch: pytest.MonkeyPatch) -> None:
    for value in (None, "", "0", " off ", "No"):
        if value is None:
            switch.delenv(EMULATE_ENV, raising=False)
        else:
            switch.setenv(EMULATE_ENV, value)
        state = _cpu.avx512_emulation()
        assert not state.requested and not state.active, value
        assert _cpu.cpu_flags() == _cpu.real_cpu_flags()


def test_a_bad_value_changes_nothing_and_says_why(switch: pytest.MonkeyPatch) -> None:
    switch.setenv(EMULATE_ENV, "maybe")
    state = _cpu.avx512_emulation()
    assert state.requested and not state.active
    assert state.line() == (f"{EMULATE_ENV} is set but not in effect: {EMULATE_ENV}='maybe' is "
                            f"not one of 1/true/on/yes or 0/false/off/no")
    assert _cpu.cpu_flags() == _cpu.real_cpu_flags()


@pytest.mark.parametrize(("kw", "why"), [
    ({"machine": "aarch64"}, "needs an x86-64 CPU, this is aarch64"),
    ({"flags": HOST_FLAGS | {"avx512f"}},
     "this CPU has AVX-512 (avx512f) itself: the real kernels run"),
    ({"flags": frozenset({"avx2", "fma"})},
     "the emulated build needs avx2, f16c, fma; this CPU lacks f16c"),
    ({"flags": frozenset()}, "the emulated build needs avx2, f16c, fma; this CPU lacks avx2, "
                             "f16c, fma"),
    ({"compiler": None}, "needs a C compiler (set CC, or install cc/gcc/clang)"),
])
def test_where_it_cannot_take_effect_it_says_why(kw: dict[str, object], why: str) -> None:
    state = _decide(**kw)  # type: ignore[arg-type]
    assert state.requested and not state.active and not state.include
    assert state.reason == f"{EMULATE_ENV} is set but not in effect: {why}"


def test_a_compiler_that_finds_no_simde(tmp_path: Path) -> None:
    fake = tmp_path / "cc"      # a compiler that fails every probe, as one without SIMDe does
    fake.write_text("#!/bin/sh\necho 'fatal error: simde/x86/avx512.h: No such file' >&2\n"
                    "exit 1\n")
    fake.chmod(0o700)
    state = _decide(compiler=str(fake))
    assert not state.active
    assert f"{fake} does not find SIMDe's headers (apt-get install libsimde-dev" in state.reason
    assert "No such file" in state.reason


def _simde_copy(tmp_path: Path) -> Path:
    if not SYSTEM_SIMDE.is_dir():
        pytest.skip(f"needs SIMDe's headers in {SYSTEM_SIMDE} to copy (libsimde-dev)")
    folder = tmp_path / "include"
    folder.mkdir(mode=0o755)
    shutil.copytree(SYSTEM_SIMDE, folder / "simde", symlinks=True)
    return folder


def test_the_simde_folder_a_user_names_is_used_when_trusted(tmp_path: Path) -> None:
    compiler = emulation.find_compiler()
    if compiler is None:
        pytest.skip("needs a C compiler")
    folder = _simde_copy(tmp_path)
    state = _decide(str(folder), compiler=compiler)
    assert state.active, state.reason
    assert state.include == ("-I", str(folder.resolve()))
    assert state.simde_version.count(".") == 2 and "?" not in state.simde_version
    assert state.line().startswith(f"EMULATED by SIMDe {state.simde_version} "
                                   f"({SIMDE_INCLUDE_ENV}={folder.resolve()}): ")


@pytest.mark.parametrize("harm", ["group-writable file", "world-writable folder", "symlink",
                                  "no simde", "writable parent"])
def test_an_untrusted_simde_folder_is_refused(tmp_path: Path, harm: str) -> None:
    """What the folder holds is compiled into code this process loads: a file another user may
    rewrite, a link to anywhere, or a folder without SIMDe is refused before any compile."""
    parent = tmp_path / "p"
    parent.mkdir(mode=0o755)
    folder = parent / "include"
    (folder / "simde" / "x86").mkdir(parents=True)
    header = folder / "simde" / "x86" / "avx512.h"
    header.write_text("/* stand-in */\n")
    for path in (folder, folder / "simde", folder / "simde" / "x86"):
        path.chmod(0o755)
    header.chmod(0o644)
    expected = {"group-writable file": f"{header} is writable by group or others (mode 664)",
                "world-writable folder": f"{folder / 'simde'} is writable by group or others "
                                         f"(mode 777)",
                "symlink": f"{folder / 'simde' / 'x86' / 'sse.h'} is a symbolic link, not a "
                           f"file or a directory",
                "no simde": f"{SIMDE_INCLUDE_ENV}={folder} holds no simde/ folder",
                "writable parent": f"{folder}: its parent {parent} is writable by group or "
                                   f"others (mode 777)"}[harm]
    if harm == "group-writable file":
        header.chmod(0o664)
    elif harm == "world-writable folder":
        (folder / "simde").chmod(0o777)
    elif harm == "symlink":
        (folder / "simde" / "x86" / "sse.h").symlink_to("/etc/hostname")
    elif harm == "no simde":
        shutil.rmtree(folder / "simde")
    else:
        parent.chmod(0o777)
    state = _decide(str(folder), compiler=None)  # refused before the compiler is asked
    assert not state.active
    assert expected in state.reason, state.reason
    if harm != "no simde":
        assert f"{SIMDE_INCLUDE_ENV}={folder} is not trusted: " in state.reason


def test_the_tree_check_refuses_too_many_entries(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"h{i}.h").write_text("")
        (tmp_path / f"h{i}.h").chmod(0o644)
    tmp_path.chmod(0o755)
    assert trusted_tree_problem(tmp_path, limit=5) is None
    assert trusted_tree_problem(tmp_path, limit=4) == (f"{tmp_path} holds more than 4 entries: "
                                                       f"too many to check")
    assert trusted_tree_problem(tmp_path / "h0.h") == f"{tmp_path / 'h0.h'} is not a directory"
    assert trusted_tree_problem(tmp_path / "absent") == (f"{tmp_path / 'absent'}: No such file "
                                                         f"or directory")


# -- what the CPU then reads as ----------------------------------------------------------------

def test_in_effect_the_features_read_the_emulated_extensions_and_say_so(
        switch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CPU faked whole: an AVX2 ``/proc/cpuinfo`` for the features, the same flags for the
    real reader, and the decision for them made in effect."""
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Fake EPYC\nflags\t\t: {AVX2}\n")
    switch.setattr(_cpu, "CPUINFO_PATH", path)
    switch.setattr(_cpu, "real_cpu_flags", lambda: frozenset(AVX2.split()))
    switch.setattr(_cpu, "decide", lambda flags: ACTIVE)
    _cpu._reset_for_tests()
    assert _cpu.cpu_flags() == frozenset(AVX2.split()) | EMULATED_FLAGS
    assert {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi"} <= _cpu.cpu_flags()
    assert not {"amx_tile", "amx_bf16", "avx512_fp16"} & _cpu.cpu_flags()
    features = _cpu.detect_cpu_features()
    assert features.present() == ["avx512f", "avx512_bf16"]
    assert features.source == (f"{path}, AVX-512 EMULATED by SIMDe 0.7.4 "
                               f"({SIMDE_INCLUDE_ENV}=/opt/simde)")


def test_platform_says_whether_it_is_emulated(switch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platform", "--json"]) == 0
    assert "cpu_avx512_emulation" not in json.loads(capsys.readouterr().out)
    switch.setenv(EMULATE_ENV, "1")
    switch.setenv(SIMDE_INCLUDE_ENV, "/nonexistent/simde-include")
    assert main(["platform", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)["cpu_avx512_emulation"]
    assert line.startswith(f"{EMULATE_ENV} is set but not in effect: ")


# -- the flags of an emulated build --------------------------------------------------------------

def test_an_avx512_build_is_rebuilt_for_avx2_with_its_other_flags_kept() -> None:
    flags, note = emulated_build_flags(
        ("-O3", "-mavx512f", "-mavx512bw", "-mfma", "-mf16c", "-DX=1", "-fopenmp"), ACTIVE,
        HEADER)
    assert flags == ("-O3", "-DX=1", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-Wno-psabi",
                     "-DAPP_SIMDE_VERSION=0.7.4", "-I", "/opt/simde", "-include", str(HEADER))
    assert note == (f"AVX-512 EMULATED ({EMULATE_ENV}=1, SIMDe 0.7.4 ({SIMDE_INCLUDE_ENV}="
                    f"/opt/simde)): for testing only, several times slower")


def test_the_forced_header_is_never_looked_up_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    flags, _ = emulated_build_flags(("-mavx512f",), ACTIVE, Path("app_avx512_emulation.h"))
    assert flags[-2:] == ("-include", str(tmp_path / "app_avx512_emulation.h"))
    assert os.path.isabs(flags[-1])


@pytest.mark.parametrize(("flags", "state", "note"), [
    (("-O3", "-mfma"), ACTIVE, None),                       # no AVX-512: nothing to emulate
    (("-O2", "-mavx512f", "-mamx-tile", "-mamx-bf16"), ACTIVE,
     f"not emulated: {EMULATE_ENV} does not cover AMX (-mamx-*) builds"),
    (("-O3", "-mavx512f"), Avx512Emulation(False, False, "off"), None),
    (("-O3", "-mavx512f"), Avx512Emulation(True, False, "set but not in effect: why"),
     "set but not in effect: why"),
])
def test_what_is_not_emulated_keeps_its_flags(flags: tuple[str, ...], state: Avx512Emulation,
                                              note: str | None) -> None:
    assert emulated_build_flags(flags, state, HEADER) == (flags, note)
