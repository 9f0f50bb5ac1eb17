"""The native-library loader: private cache directories, no planted library ever loaded,
corrupt cache files rebuilt, the ABI version and argument-struct layout checked at load.

Most tests build a tiny library (``tiny.c`` written per test) so they take well under a second
each; the last ones use the real prefill kernel."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from app import _cpu as app_cpu
from app._cpu.emulation import EMULATE_ENV, Avx512Emulation
from app.backends.cpu import loader as loader
from app.backends.cpu import prefill_kernel as native
from app.commands.platform import cpu_native_kernel

pytestmark = pytest.mark.skipif(loader.find_compiler() is None, reason="needs a C compiler")

TINY = r"""
#include <stdio.h>
#include "app_native.h"
#define TINY_ARGS(X) X(const float*, x) X(float*, out) X(int64_t, n) X(float, scale)
APP_NATIVE_STRUCT(tiny_args, TINY_ARGS)
APP_NATIVE_LIBRARY(TINY_ABI)
APP_NATIVE_STRUCT_LAYOUT(tiny_args, TINY_ARGS)
APP_NATIVE_EXPORT int32_t tiny_scale(const tiny_args* a) {
  for (int64_t i = 0; i < a->n; ++i) a->out[i] = a->x[i] * a->scale;
  return 0;
}
#ifdef PLANT  /* what an attacker's library does: run code the moment it is loaded */
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(PLANT, "w");
  if (f) fclose(f);
}
#endif
"""


class TinyArgs(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("scale", ctypes.c_float)]


class SwappedArgs(ctypes.Structure):  # same size, two fields in the wrong order
    _fields_ = [("out", ctypes.c_void_p), ("x", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("scale", ctypes.c_float)]


def tiny_works(library: loader.NativeLibrary) -> str | None:
    fn = library.function("tiny_scale", ctypes.c_int32, ctypes.POINTER(TinyArgs))
    x, out = (ctypes.c_float * 3)(1.0, 2.0, 3.0), (ctypes.c_float * 3)()
    args = TinyArgs(ctypes.addressof(x), ctypes.addressof(out), 3, 2.0)
    if fn(ctypes.byref(args)) != 0 or list(out) != [2.0, 4.0, 6.0]:
        return f"tiny_scale gave {list(out)}"
    return None


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache root (``$APP_CACHE_DIR``), private temp dir and tiny source."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setenv(loader.CACHE_DIR_ENV, str(home / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    (tmp_path / "tiny.c").write_text(TINY)
    loader.reset_native_libraries()
    yield tmp_path
    loader.reset_native_libraries()


def spec(root: Path, abi: int = 3, declared_abi: int = 3, **kw: object) -> loader.NativeLibrarySpec:
    fields: dict[str, object] = {"structs": (("tiny_args", TinyArgs),), "self_test": tiny_works}
    fields.update(kw)
    return loader.NativeLibrarySpec(name=f"tiny{abi}", sources=(str(root / "tiny.c"),),
                                    abi_version=declared_abi,
                                    flags=("-O1", f"-DTINY_ABI={abi}"), **fields)  # type: ignore[arg-type]


def cache_dir(root: Path) -> Path:
    return root / "home" / "cache" / "cpu-kernels"


def fallback_dir(root: Path) -> Path:
    return root / "tmp" / f"app-{os.geteuid()}"


def plant(root: Path, target: Path, marker: Path, mode: int = 0o755) -> None:
    """An attacker's library, at the exact name the loader will look for."""
    compiler = loader.find_compiler()
    assert compiler is not None
    import subprocess

    subprocess.run([compiler, "-shared", "-fPIC", "-I", str(loader.NATIVE_DIR), "-DTINY_ABI=3",
                    f'-DPLANT="{marker}"', "-o", str(target), str(root / "tiny.c")],
                   check=True, capture_output=True)
    target.chmod(mode)


def expected_path(directory: Path, s: loader.NativeLibrarySpec) -> Path:
    compiler = loader.find_compiler()
    assert compiler is not None
    return directory / loader._library_file_name(s, compiler)


def test_builds_into_directories_it_creates_private(env: Path) -> None:
    status = loader.load_native_library(spec(env))
    assert status.available, status.reasons
    assert status.library is not None and tiny_works(status.library) is None
    directory = cache_dir(env)
    assert status.path is not None and status.path.parent == directory
    for d in (directory, directory.parent):  # created by the loader: 0700
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(status.path.stat().st_mode) & 0o022 == 0
    assert [p.name for p in directory.iterdir()] == [status.path.name]  # no build leftovers
    assert status.notes == ()
    assert status.library.dtype_code(__import__("torch").bfloat16) == 1


@pytest.mark.parametrize("where", ["cache", "fallback", "both"])
def test_a_library_planted_in_a_world_writable_directory_is_never_loaded(
        env: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The issue's case: the cache directory cannot be created (a service account whose home
    is not writable) and another user has made the /tmp fallback world-writable and put a
    library under the expected name there."""
    s = spec(env)
    marker = env / "planted-code-ran"
    planted = []
    for name, directory in (("cache", cache_dir(env)), ("fallback", fallback_dir(env))):
        if where in (name, "both"):
            directory.mkdir(parents=True)
            directory.chmod(0o777)  # as another local user would leave it
            plant(env, expected_path(directory, s), marker)
            planted.append(directory)
    if where == "fallback":  # the cache directory cannot be created
        (env / "not-a-dir").write_text("")
        monkeypatch.setenv(loader.CACHE_DIR_ENV, str(env / "not-a-dir" / "cache"))
    status = loader.load_native_library(s)
    assert not marker.exists(), "the planted library's constructor ran"
    for directory in planted:
        assert any(f"refused cache directory {directory}" in text and "writable by group or "
                   "others" in text for text in (*status.notes, *status.reasons))
    if where == "cache":
        assert status.available and status.path is not None
        assert status.path.parent == fallback_dir(env)
        assert stat.S_IMODE(fallback_dir(env).stat().st_mode) == 0o700
    else:
        assert not status.available and status.reasons[0].startswith("no usable cache dir")
        if where == "fallback":
            assert "cannot create" in status.reasons[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another "
                    "user owns")
def test_a_directory_owned_by_another_user_is_refused(env: Path) -> None:
    s = spec(env)
    marker = env / "planted-code-ran"
    directory = cache_dir(env)
    directory.mkdir(parents=True, mode=0o755)
    plant(env, expected_path(directory, s), marker)
    os.chown(directory, 65534, 65534)
    status = loader.load_native_library(s)
    assert not marker.exists()
    assert status.available and status.path is not None
    assert status.path.parent == fallback_dir(env)
    assert "is owned by uid 65534, not by this user" in status.notes[0]


def test_a_parent_others_can_write_without_the_sticky_bit_is_refused(env: Path) -> None:
    open_parent = env / "home" / "cache"
    open_parent.mkdir(parents=True)
    open_parent.chmod(0o777)  # anyone could rename cpu-kernels away and put theirs there
    status = loader.load_native_library(spec(env))
    assert status.available and status.path is not None
    assert status.path.parent == fallback_dir(env)
    assert "writable by group or others and not sticky" in status.notes[0]


def test_reasons_reach_the_platform_command(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if native._requirements():
        pytest.skip(f"the prefill kernel cannot run here: {native._requirements()}")
    cache_dir(env).mkdir(parents=True)
    cache_dir(env).chmod(0o777)
    native._reset_for_tests()
    try:
        text = cpu_native_kernel()
    finally:
        native._reset_for_tests()
    assert text.startswith(f"available ({fallback_dir(env)}")
    assert f"note: refused cache directory {cache_dir(env)}" in text


@pytest.mark.parametrize("mode", [0o666, 0o775])
def test_a_cached_file_others_can_write_is_not_loaded_but_replaced(env: Path,
                                                                   mode: int) -> None:
    s = spec(env)
    marker = env / "planted-code-ran"
    cache_dir(env).mkdir(parents=True, mode=0o700)
    target = expected_path(cache_dir(env), s)
    plant(env, target, marker, mode)
    status = loader.load_native_library(s)
    assert not marker.exists()
    assert status.available and status.path == target
    assert stat.S_IMODE(target.stat().st_mode) & 0o022 == 0
    assert "writable by group or others" in status.notes[0] and "rebuilt" in status.notes[0]


def test_a_symlink_in_the_cache_is_not_followed(env: Path) -> None:
    s = spec(env)
    marker = env / "planted-code-ran"
    elsewhere = env / "elsewhere.so"
    plant(env, elsewhere, marker)
    cache_dir(env).mkdir(parents=True, mode=0o700)
    target = expected_path(cache_dir(env), s)
    target.symlink_to(elsewhere)
    status = loader.load_native_library(s)
    assert not marker.exists()
    assert status.available and not target.is_symlink()
    assert "symbolic link" in status.notes[0]


def test_a_corrupt_cached_file_is_rebuilt(env: Path) -> None:
    s = spec(env)
    cache_dir(env).mkdir(parents=True, mode=0o700)
    target = expected_path(cache_dir(env), s)
    target.write_bytes(b"\x00" * 64)  # a truncated write, a full disk, a bad copy
    target.chmod(0o700)
    status = loader.load_native_library(s)
    assert status.available, status.reasons
    assert status.library is not None and tiny_works(status.library) is None
    assert "invalid ELF header" in status.notes[0] or "too short" in status.notes[0]
    assert "rebuilt" in status.notes[0]


def test_a_cached_library_with_another_abi_is_rebuilt(env: Path) -> None:
    s = spec(env)
    cache_dir(env).mkdir(parents=True, mode=0o700)
    target = expected_path(cache_dir(env), s)
    # A stale build of the same name but another ABI (say, a hash collision or a hand copy).
    import subprocess

    compiler = loader.find_compiler()
    assert compiler is not None
    subprocess.run([compiler, "-shared", "-fPIC", "-I", str(loader.NATIVE_DIR), "-DTINY_ABI=1",
                    "-o", str(target), str(env / "tiny.c")], check=True, capture_output=True)
    target.chmod(0o700)
    status = loader.load_native_library(s)
    assert status.available, status.reasons
    assert "ABI version 1, expected 3" in status.notes[0]


def test_a_library_with_the_wrong_abi_version_is_refused(env: Path) -> None:
    status = loader.load_native_library(spec(env, abi=4, declared_abi=3))
    assert not status.available and status.library is None
    assert "ABI version 4, expected 3" in status.reasons[0]
    assert list(cache_dir(env).iterdir()) == []  # not left for the next process


def test_a_struct_whose_fields_disagree_is_refused(env: Path) -> None:
    status = loader.load_native_library(spec(env, structs=(("tiny_args", SwappedArgs),)))
    assert not status.available
    assert "field out at offset 8 in C, 0 in Python" in status.reasons[0]


def test_a_struct_the_library_does_not_describe_is_refused(env: Path) -> None:
    status = loader.load_native_library(spec(env, structs=(("other_args", TinyArgs),)))
    assert not status.available and "exports no layout" in status.reasons[0]


def test_a_failing_or_raising_self_test_is_a_reason(env: Path) -> None:
    failed = loader.load_native_library(spec(env, self_test=lambda lib: "wrong answer"))
    assert not failed.available and "wrong answer" in failed.reasons[0]
    loader.reset_native_libraries()

    def raises(lib: loader.NativeLibrary) -> str | None:
        raise ZeroDivisionError("boom")

    raised = loader.load_native_library(spec(env, self_test=raises))
    assert not raised.available and "ZeroDivisionError: boom" in raised.reasons[0]


def test_loaded_once_per_process_and_names_are_unique(env: Path) -> None:
    first = loader.load_native_library(spec(env))
    assert loader.load_native_library(spec(env)) is first
    with pytest.raises(ValueError, match="two different specs use this name"):
        loader.load_native_library(spec(env, self_test=None))


def test_requirements_are_reasons_and_a_bad_setting_raises(env: Path) -> None:
    status = loader.load_native_library(spec(env, requirements=lambda: ["needs a unicorn"]))
    assert not status.available and status.reasons == ("needs a unicorn",)
    loader.reset_native_libraries()

    def bad() -> list[str]:
        raise ValueError("bad setting")

    with pytest.raises(ValueError, match="bad setting"):
        loader.load_native_library(spec(env, requirements=bad))
    assert "tiny3" not in loader._results  # nothing cached


def test_required_cpu_flags_follow_the_isa_flags() -> None:
    assert loader.required_cpu_flags(
        ("-O3", "-mavx512f", "-mavx512bf16", "-mamx-tile", "-mf16c", "-DX=1", "-march=native",
         "-mno-red-zone", "-mtune=generic")) == {"avx512f", "avx512_bf16", "amx_tile", "f16c"}


def test_a_library_built_for_an_isa_the_cpu_lacks_is_never_built_or_loaded(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a spec's requirements say (a test that fakes the CPU's flags for the platform
    fooled them once, and the next real call died with SIGILL), the loader reads the CPU's
    flags itself and refuses code built for instructions the CPU lacks."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)  # the CPU faked whole: nothing emulated
    monkeypatch.setattr(loader, "real_cpu_flags",
                        lambda: frozenset({"sse2", "avx", "avx2", "fma"}))
    monkeypatch.setattr(loader, "_build_and_open", lambda *a: pytest.fail("built"))
    tiny = attrs.evolve(spec(env, requirements=lambda: []),
                        flags=("-O1", "-DTINY_ABI=3", "-mavx512f", "-mfma"))
    status = loader.load_native_library(tiny)
    assert not status.available and status.library is None
    assert status.reasons == ("built for avx512f, which this CPU lacks (its /proc/cpuinfo "
                              "flags do not list it)",)
    assert not cache_dir(env).exists()


def test_under_the_emulation_a_real_avx512_build_is_still_refused(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``APP_CPU_EMULATE_AVX512`` in effect (faked whole: an AVX2 CPU, the decision made for
    it): the kernels' flag reader reports AVX-512, but the loader's instruction check reads the
    CPU itself, so a build with real AVX-512 instructions (an AMX one: never emulated) is
    refused, never built or loaded, and says why."""
    avx2 = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
    state = Avx512Emulation(True, True, "faked", (), "0.7.4")
    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setattr(loader, "real_cpu_flags", lambda: avx2)
    monkeypatch.setattr(loader, "avx512_emulation", lambda: state)
    monkeypatch.setattr(app_cpu, "real_cpu_flags", lambda: avx2)
    monkeypatch.setattr(app_cpu, "decide", lambda flags: state)
    monkeypatch.setattr(loader, "_build_and_open", lambda *a: pytest.fail("built"))
    assert {"avx512f", "avx512bw", "avx512_bf16"} <= loader.cpu_flags()
    real = attrs.evolve(spec(env, requirements=lambda: []),
                        flags=("-O1", "-DTINY_ABI=3", "-mavx512f", "-mfma"))
    assert loader._isa_problem(real) == ("built for avx512f, which this CPU lacks (its "
                                         "/proc/cpuinfo flags do not list it)")
    amx = attrs.evolve(real, flags=(*real.flags, "-mamx-tile"))
    status = loader.load_native_library(amx)
    assert not status.available and status.library is None
    assert status.reasons == ("built for amx_tile, avx512f, which this CPU lacks (its "
                              "/proc/cpuinfo flags do not list them)",)
    assert status.notes == (f"not emulated: {EMULATE_ENV} does not cover AMX (-mamx-*) "
                            f"builds",)
    assert not cache_dir(env).exists()


def test_a_switch_that_cannot_take_effect_says_why_in_the_notes(
        env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    empty = tmp_path / "no-simde"
    empty.mkdir(mode=0o700)
    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setenv("APP_SIMDE_INCLUDE", str(empty))   # holds no simde/: never in effect
    tiny = attrs.evolve(spec(env), flags=("-O1", "-DTINY_ABI=3", "-mavx512f"))
    (note,) = loader.load_native_library(tiny).notes
    assert note.startswith(f"{EMULATE_ENV} is set but not in effect: "), note
    loader.reset_native_libraries()
    assert loader.load_native_library(spec(env)).notes == ()   # no AVX-512 flag: nothing said


def test_a_bad_emulation_switch_is_a_value_error_naming_it(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "maybe")
    tiny = attrs.evolve(spec(env), flags=("-O1", "-DTINY_ABI=3", "-mavx512f"))
    with pytest.raises(ValueError, match=f"{EMULATE_ENV}: expected one of .* got 'maybe'"):
        loader.load_native_library(tiny)
    assert loader.load_native_library(spec(env)).available   # a library without AVX-512


def test_under_the_emulation_an_avx512_library_is_built_emulated_as_its_own_file(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Really built (SIMDe found, a CPU without AVX-512): the library is compiled for AVX2 with
    the emulation header, loaded, checked and kept under another name than the real build's."""
    monkeypatch.setenv(EMULATE_ENV, "1")
    state = app_cpu.avx512_emulation()
    if not state.active:
        pytest.skip(state.reason)
    real = attrs.evolve(spec(env), flags=("-O1", "-DTINY_ABI=3", "-mavx512f", "-mavx512bw"))
    status = loader.load_native_library(real)
    assert status.available and status.library is not None and status.path is not None
    assert status.notes == (f"AVX-512 EMULATED ({EMULATE_ENV}=1, {state.simde}): for testing "
                            f"only, several times slower",)
    built = status.library.spec.flags
    assert not [f for f in built if f.startswith("-mavx512")]
    assert built[-2:] == ("-include", str(loader.NATIVE_DIR / "app_avx512_emulation.h"))
    compiler = loader.find_compiler()
    assert compiler is not None
    assert status.path.name != loader._library_file_name(real, compiler)


def test_read_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_TEST_SWITCH", " Off ")
    assert loader.read_switch("APP_TEST_SWITCH") is False
    monkeypatch.delenv("APP_TEST_SWITCH")
    assert loader.read_switch("APP_TEST_SWITCH") is True
    monkeypatch.setenv("APP_TEST_SWITCH", "2")
    with pytest.raises(ValueError, match="expected one of 1/true/on/yes"):
        loader.read_switch("APP_TEST_SWITCH")


def test_the_prefill_kernel_checks_its_struct_and_codes_from_the_library() -> None:
    kernel = native.load_native_kernel()
    if kernel is None:
        pytest.skip(f"native kernel unavailable: {native.native_kernel_status().reasons}")
    import torch

    assert set(kernel.dtype_codes) == {torch.float32, torch.bfloat16, torch.float16}
    assert len(set(kernel.dtype_codes.values())) == 3


@pytest.mark.slow
def test_processes_building_at_once_leave_one_library_and_no_temp_files(env: Path) -> None:
    """Builds go to private temp directories and are renamed into place: processes racing
    on an empty cache all load a whole library."""
    import subprocess
    import sys

    script = (
        "import ctypes, sys, tempfile\n"
        "from app.backends.cpu import loader as loader\n"
        "tempfile.tempdir = sys.argv[2]\n"
        "class A(ctypes.Structure):\n"
        "    _fields_ = [('x', ctypes.c_void_p), ('out', ctypes.c_void_p),"
        " ('n', ctypes.c_int64), ('scale', ctypes.c_float)]\n"
        "s = loader.NativeLibrarySpec(name='tiny3', sources=(sys.argv[1],), abi_version=3,"
        " flags=('-O1', '-DTINY_ABI=3'), structs=(('tiny_args', A),))\n"
        "st = loader.load_native_library(s)\n"
        "print(st.available, st.path, st.reasons)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(env / "tiny.c"),
                               str(env / "tmp")], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
             for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert all(o.startswith("True ") for o in outputs), outputs
    assert len({o.split()[1] for o in outputs}) == 1
    assert len(list(cache_dir(env).iterdir())) == 1  # one library, no build directories


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_loader_lock_is_held_can_load(env: Path) -> None:
    import faulthandler
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with loader._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 3
            try:
                faulthandler.dump_traceback_later(20, exit=True)  # a deadlock fails, not hangs
                code = 0 if loader.load_native_library(spec(env)).available else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0


# -- a failure the environment causes never costs a cached library (issue 21) ---------------

def _built(env: Path, s: loader.NativeLibrarySpec) -> tuple[Path, int]:
    status = loader.load_native_library(s)
    assert status.available and status.path is not None, status.reasons
    loader.reset_native_libraries()
    return status.path, status.path.stat().st_ino


def test_a_bad_switch_is_refused_by_name_before_anything(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []

    def self_test(library: loader.NativeLibrary) -> str | None:
        ran.append(1)
        return None if loader.read_switch("APP_TEST_DOT") else "dot off"

    s = spec(env, self_test=self_test, switches=("APP_TEST_DOT",))
    path, inode = _built(env, s)
    monkeypatch.setenv("APP_TEST_DOT", "maybe")
    ran.clear()
    with pytest.raises(ValueError, match="APP_TEST_DOT: expected one of 1/true/on/yes or "
                                         "0/false/off/no \\(or unset\\), got 'maybe'"):
        loader.load_native_library(s)
    assert ran == [] and "tiny3" not in loader._results  # no self-test, nothing cached
    assert path.stat().st_ino == inode  # the valid cached library is still there


def test_a_self_test_the_environment_fails_keeps_the_cached_library(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def self_test(library: loader.NativeLibrary) -> str | None:
        return "the CPU disagrees today" if os.environ.get("APP_TEST_FAIL") else None

    s = spec(env, self_test=self_test)
    path, inode = _built(env, s)
    monkeypatch.setenv("APP_TEST_FAIL", "1")
    failed = loader.load_native_library(s)
    assert not failed.available and "the CPU disagrees today" in failed.reasons[0]
    assert "and so does a fresh build; kept the cached file" in failed.notes[-1]
    assert path.stat().st_ino == inode
    assert sorted(p.name for p in cache_dir(env).iterdir()) == [path.name]  # no debris
    loader.reset_native_libraries()
    monkeypatch.delenv("APP_TEST_FAIL")
    again = loader.load_native_library(s)  # loaded as it was: not rebuilt, not deleted
    assert again.available and again.notes == () and path.stat().st_ino == inode


def test_the_decode_kernel_reads_its_switches_through_the_loader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from app.backends.decode import cpu_mla

    assert set(cpu_mla.SPEC.switches) == {native.SWITCH_ENV, cpu_mla.BF16_DOT_ENV}
    monkeypatch.setenv(cpu_mla.BF16_DOT_ENV, "maybe")
    with pytest.raises(ValueError, match="APP_CPU_DECODE_BF16_DOT: expected one of"):
        loader.load_native_library(cpu_mla.SPEC)


# -- a cache directory that cannot be written falls through to the next one (issue 44) --------

def read_only(monkeypatch: pytest.MonkeyPatch, directory: Path, err: int = errno.EROFS) -> None:
    """Make ``directory`` behave as a read-only mount (a baked container image) for this
    process: every call that would create, rename, change or remove something in it fails with
    ``err``. chmod cannot do this here: root writes anyway."""
    def inside(path: object) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(
            os.path.abspath(os.fspath(path))).is_relative_to(directory)

    def refuse(real: Any, arguments: int, writes: Callable[..., bool] = lambda *a: True
               ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if any(inside(a) for a in args[:arguments]) and writes(*args, **kwargs):
                raise OSError(err, os.strerror(err), str(args[0]))
            return real(*args, **kwargs)
        return call

    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
    for name, arguments in (("mkdir", 1), ("replace", 2), ("rename", 2), ("chmod", 1),
                            ("unlink", 1), ("rmdir", 1), ("truncate", 1)):
        monkeypatch.setattr(os, name, refuse(getattr(os, name), arguments))
    monkeypatch.setattr(os, "open", refuse(
        os.open, 1, lambda path, flags, *a, **k: bool(flags & writing)))


def test_a_read_only_cache_directory_serves_what_it_holds_and_builds_go_to_the_next(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only image that ships a built cache: what it holds is loaded from it as it is;
    a library it lacks is built in the per-user fallback directory, and a note says why."""
    shipped = spec(env)
    path, inode = _built(env, shipped)
    read_only(monkeypatch, cache_dir(env))  # it passes every directory check still
    status = loader.load_native_library(shipped)
    assert status.available and status.path == path and status.notes == ()
    assert path.stat().st_ino == inode and not fallback_dir(env).exists()

    status = loader.load_native_library(spec(env, abi=5, declared_abi=5))  # not shipped
    assert status.available, status.reasons
    assert status.path is not None and status.path.parent == fallback_dir(env)
    assert status.library is not None and tiny_works(status.library) is None
    assert status.notes == (f"cache directory {cache_dir(env)} cannot take a build (Read-only "
                            f"file system); tried the next one",)
    assert [p.name for p in cache_dir(env).iterdir()] == [path.name]


def test_an_unusable_library_in_a_read_only_directory_is_rebuilt_in_the_next(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = spec(env)
    cache_dir(env).mkdir(parents=True, mode=0o700)
    target = expected_path(cache_dir(env), s)
    target.write_bytes(b"\x00" * 64)
    target.chmod(0o700)
    read_only(monkeypatch, cache_dir(env))
    status = loader.load_native_library(s)
    assert status.available and status.path == expected_path(fallback_dir(env), s)
    [note] = status.notes
    assert f"cache directory {cache_dir(env)} cannot take a build (Read-only" in note
    assert f"its cached {target.name} is unusable" in note
    assert target.read_bytes() == b"\x00" * 64  # left as the image has it


@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_no_writable_cache_directory_says_why_for_each(
        env: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    for directory in (cache_dir(env), fallback_dir(env)):
        directory.mkdir(parents=True, mode=0o700)
        read_only(monkeypatch, directory, err)
    status = loader.load_native_library(spec(env))
    assert not status.available
    [reason] = status.reasons
    assert reason.startswith("no usable cache directory: ")
    for directory in (cache_dir(env), fallback_dir(env)):
        assert f"cache directory {directory} cannot take a build ({os.strerror(err)})" in reason


def test_a_full_disk_during_the_build_falls_through(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler, not Python, meets a full disk: its message says so."""
    real_run = subprocess.run

    def run(cmd: list[str], **kwargs: Any) -> Any:
        if "-o" in cmd and Path(cmd[cmd.index("-o") + 1]).is_relative_to(cache_dir(env)):
            return subprocess.CompletedProcess(cmd, 1, "", "ld: final link failed: No space "
                                               "left on device\ncollect2: error")
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    status = loader.load_native_library(spec(env))
    assert status.available and status.path is not None
    assert status.path.parent == fallback_dir(env)
    assert "No space left on device" in status.notes[0]
    assert f"cache directory {cache_dir(env)} cannot take a build" in status.notes[0]


def test_a_build_is_announced_to_listeners_and_a_cached_load_is_not(env: Path) -> None:
    """``run`` says "compiling the native kernels" through ``on_build``: called as a build
    starts, once per library built, never for a library loaded from the cache, and not after
    the block."""
    built: list[str] = []
    with loader.on_build(built.append):
        status = loader.load_native_library(spec(env))
        assert status.available, status.reasons
        assert built == ["tiny3"]
        loader.load_native_library(spec(env))  # this process's: no load at all
        loader.reset_native_libraries()
        assert loader.load_native_library(spec(env)).available  # from the cache file
        assert built == ["tiny3"]
    loader.reset_native_libraries()
    for library in cache_dir(env).iterdir():
        library.unlink()
    assert loader.load_native_library(spec(env)).available  # built again, nobody listening
    assert built == ["tiny3"]
