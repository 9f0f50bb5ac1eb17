"""The C harnesses under ``benchmarks/native/`` still build against the kernel's sources and
run: ``decode_pair.c`` (paired timing of kernel builds, docs/cpu-decode-kernel.md) on a small
case with a bit-compare of two builds, and its argument check; ``prefetch_cost.c`` (what a
memory-missing prefetch costs the core) on a small buffer; ``fp8_tile_cost.c`` (the FP8
tile conversions, alone and in the step) on a small case, with a bit-compare of the two
conversions' outputs. Timings are not checked here: they are diagnostics, read by a person.
Skipped where the kernel cannot run (no x86-64 AVX-512, no C compiler); built with SIMDe's
AVX-512 emulation under ``APP_CPU_EMULATE_AVX512`` (``tests._support.own_build_flags``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from app.backends.cpu import decode_kernel as cpu_mla_decode
from app.backends.cpu import loader as loader
from tests._support import native_compiler_or_skip, own_build_flags

#: builds and runs the native C harnesses: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

NATIVE = Path(__file__).resolve().parents[2] / "benchmarks" / "native"


def _build(cmd: list[str]) -> None:
    # an emulated kernel build (APP_CPU_EMULATE_AVX512) takes minutes on a small machine
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"did not compile: {' '.join(cmd)}\n{done.stderr[-2000:]}")


def test_decode_pair_times_two_builds_and_finds_them_identical(tmp_path: Path) -> None:
    compiler = native_compiler_or_skip()
    include = ["-I", str(loader.NATIVE_DIR)]
    exe = tmp_path / "decode_pair"
    _build([compiler, "-O2", *include, str(NATIVE / "decode_pair.c"), "-o", str(exe),
            "-ldl", "-lpthread", "-lm"])
    sources = [str(loader.NATIVE_DIR / s) for s in cpu_mla_decode.SPEC.sources]
    libs = [tmp_path / "a.so", tmp_path / "b.so"]
    _build([compiler, "-fPIC", "-shared", "-fvisibility=hidden",
            *own_build_flags(cpu_mla_decode.SPEC.flags), *include, *sources, "-o",
            str(libs[0]), "-lm"])
    shutil.copyfile(libs[0], libs[1])  # two files, loaded as two libraries: one compile
    env = {**os.environ, "CMP": "1", "THREADS": "1"}
    # 3 requests of 130 keys (two chunks and a partial block), 2 query rows: the edges.
    run = subprocess.run([str(exe), "3", "130", "16", "2", "16", "fp32", "2", *map(str, libs)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "bit-identical: yes" in run.stdout, run.stdout
    assert sum(line.startswith(str(tmp_path)) and " best " in line
               for line in run.stdout.splitlines()) == 2, run.stdout
    bad = subprocess.run([str(exe), "1", "2", "16", "4", "16", "fp32", "1", str(libs[0])],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "context >= qlen" in bad.stderr, bad.stderr


def test_prefetch_cost_runs_every_hint(tmp_path: Path) -> None:
    compiler = native_compiler_or_skip()
    if not cpu_mla_decode._cpu_has_bf16_dot():
        pytest.skip("prefetch_cost runs vdpbf16ps: needs AVX512-BF16")
    exe = tmp_path / "prefetch_cost"
    # its loop's target attribute names AVX512-BF16 itself: never emulated
    flags = own_build_flags(["-O2", "-mavx512f", "-mavx512bw", "-mavx512bf16"], emulable=False)
    _build([compiler, *flags, str(NATIVE / "prefetch_cost.c"), "-o", str(exe)])
    run = subprocess.run([str(exe), "16"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("buffer 16 MiB; no prefetch:"), run.stdout
    assert [line.split()[0] for line in lines[1:]] == ["T0", "T0", "T1", "T1", "NTA", "NTA",
                                                       "load", "load"], run.stdout


def test_fp8_tile_cost_times_both_conversions_and_finds_their_outputs_identical(
        tmp_path: Path) -> None:
    compiler = native_compiler_or_skip()
    if not cpu_mla_decode._cpu_has_bf16_dot():
        pytest.skip("fp8_tile_cost runs the dot path: needs AVX512-BF16")
    exe = tmp_path / "fp8_tile_cost"
    # it asks the CPU for AVX512-BF16 with its own __builtin_cpu_supports: never emulated
    flags = own_build_flags(cpu_mla_decode.SPEC.flags, emulable=False)
    _build([compiler, "-O2", *flags, "-I", str(loader.NATIVE_DIR),
            str(NATIVE / "fp8_tile_cost.c"), "-o", str(exe), "-lm"])
    env = {**os.environ, "FLUSH_MB": "0"}
    for layout in ("ds", "e4m3"):
        # 3 requests of 130 keys (two chunks and a partial block), 2 query rows
        run = subprocess.run([str(exe), "step", layout, "3", "130", "16", "2", "1"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "outputs bit-identical: yes" in run.stdout, run.stdout
        tile = subprocess.run([str(exe), "tile", layout, "other", "10"], capture_output=True,
                              text=True, timeout=120)
        assert tile.returncode == 0 and tile.stdout.startswith("tile "), tile.stdout
    bad = subprocess.run([str(exe), "step", "ds", "1", "2", "16", "4", "1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr, bad.stderr
