"""Sizing the thread team from what the process may use (app._cpu): the user's setting,
the affinity mask, the cgroup v1/v2 CPU quota (fake files and a fake affinity here, never the
machine's), and the OpenMP wait policy set before torch loads its runtime."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from app import _cpu as _threads
from app._cpu import (
    ThreadCount,
    apply_thread_count,
    cgroup_cpu_limit,
    parse_cfs_quota,
    parse_cpu_max,
    prefer_passive_wait,
    thread_count,
)


def cpus(n: int) -> Callable[[int], set[int]]:
    """A fake ``os.sched_getaffinity`` allowing ``n`` CPUs."""
    return lambda pid: set(range(n))


def cgroup(tmp_path: Path, files: dict[str, str], membership: str = "0::/\n"
           ) -> tuple[Path, Path]:
    """A fake cgroup mount (``files`` relative to it) and ``/proc/self/cgroup``."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh one per call
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = root / "proc-self-cgroup"
    proc.write_text(membership)
    return root, proc


def sized(tmp_path: Path, affinity: int, files: dict[str, str],
          environ: dict[str, str] | None = None, membership: str = "0::/\n") -> ThreadCount:
    root, proc = cgroup(tmp_path, files, membership)
    return thread_count(environ or {}, cpus(affinity), root, proc)


@pytest.mark.parametrize(("text", "expected"), [
    ("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5),
    ("50000 100000", 0.5), ("max", None)])
def test_cpu_max_reads_as_cpus(text: str, expected: float | None) -> None:
    assert parse_cpu_max(text) == expected


@pytest.mark.parametrize("text", ["", "a b", "1 2 3", "0 100000", "100000 0", "-5 100000"])
def test_a_cpu_max_of_another_form_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"cpu\.max"):
        parse_cpu_max(text)


def test_cfs_quota_reads_as_cpus() -> None:
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("250000\n", "100000\n") == 2.5
    with pytest.raises(ValueError, match=r"cfs_quota_us.*'x'"):
        parse_cfs_quota("x", "100000")


def test_no_quota_and_no_user_setting_is_the_affinity(tmp_path: Path) -> None:
    assert sized(tmp_path, 2, {"cpu.max": "max 100000\n"}) == ThreadCount(2, "affinity 2 CPUs")


def test_a_fractional_quota_rounds_down_and_says_so(tmp_path: Path) -> None:
    got = sized(tmp_path, 4, {"cpu.max": "150000 100000\n"})
    assert got == ThreadCount(1, "cgroup cpu.max 1.5 CPUs (affinity 4 CPUs)")


def test_a_quota_under_one_cpu_still_runs_one_thread(tmp_path: Path) -> None:
    assert sized(tmp_path, 2, {"cpu.max": "20000 100000"}).count == 1


def test_never_more_than_the_affinity_allows(tmp_path: Path) -> None:
    got = sized(tmp_path, 2, {"cpu.max": "800000 100000"})
    assert got == ThreadCount(2, "affinity 2 CPUs")
    assert sized(tmp_path, 1, {}) == ThreadCount(1, "affinity 1 CPU")


def test_a_parent_cgroups_quota_limits_its_children(tmp_path: Path) -> None:
    files = {"cpu.max": "max 100000", "kube/cpu.max": "300000 100000",
             "kube/pod/cpu.max": "max 100000"}
    got = sized(tmp_path, 8, files, membership="0::/kube/pod\n")
    assert got == ThreadCount(3, "cgroup cpu.max 3 CPUs (affinity 8 CPUs)")


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    files = {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
             "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}
    got = sized(tmp_path, 16, files, membership="4:memory:/x\n2:cpu,cpuacct:/\n")
    assert got == ThreadCount(2, "cgroup cpu.cfs_quota_us 2 CPUs (affinity 16 CPUs)")
    unlimited = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert sized(tmp_path, 16, unlimited, membership="2:cpu:/\n") \
        == ThreadCount(16, "affinity 16 CPUs")


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-too") is None


def test_a_broken_quota_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cpu\.max should hold"):
        sized(tmp_path, 2, {"cpu.max": "lots\tof words here"})


@pytest.mark.parametrize(("environ", "expected"), [
    ({"OMP_NUM_THREADS": "3"}, ThreadCount(3, "OMP_NUM_THREADS=3")),
    ({"OMP_NUM_THREADS": " 4,2 "}, ThreadCount(4, "OMP_NUM_THREADS=4,2")),
    ({"MKL_NUM_THREADS": "1"}, ThreadCount(1, "MKL_NUM_THREADS=1")),
    ({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"}, ThreadCount(2, "OMP_NUM_THREADS=2")),
    ({"OMP_NUM_THREADS": ""}, ThreadCount(1, "cgroup cpu.max 1 CPUs (affinity 4 CPUs)"))])
def test_the_users_setting_wins_over_the_quota(tmp_path: Path, environ: dict[str, str],
                                               expected: ThreadCount) -> None:
    assert sized(tmp_path, 4, {"cpu.max": "100000 100000"}, environ) == expected


@pytest.mark.parametrize("value", ["abc", "0", "-2", ",3"])
def test_a_bad_omp_num_threads_is_an_error_naming_it(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS must be a positive integer.*"
                                         f"'{value}'"):
        sized(tmp_path, 2, {}, {"OMP_NUM_THREADS": value})


@pytest.fixture
def torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's thread count and the module's memory of what it set, restored afterwards."""
    old = torch.get_num_threads()
    monkeypatch.setattr(_threads, "_applied", None)
    yield
    torch.set_num_threads(old)


def test_apply_sizes_torch_from_the_quota(tmp_path: Path, torch_threads: None) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "100000 100000"})
    affinity = cpus(torch.get_num_threads())  # torch's own default: the affinity mask's CPUs
    got = apply_thread_count({}, affinity, root, proc)
    assert got.count == 1 and got.source.startswith("cgroup cpu.max 1 CPUs")
    assert torch.get_num_threads() == 1
    assert apply_thread_count({}, affinity, root, proc) == got  # again: the same, unchanged


def test_apply_leaves_a_count_the_caller_set(tmp_path: Path, torch_threads: None) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "100000 100000"})
    default = torch.get_num_threads()
    torch.set_num_threads(default + 3)
    got = apply_thread_count({}, cpus(default), root, proc)
    assert got == ThreadCount(default + 3, f"torch.set_num_threads({default + 3}) by the caller")
    assert torch.get_num_threads() == default + 3


def test_apply_leaves_the_users_environment_to_torch(tmp_path: Path,
                                                     torch_threads: None) -> None:
    root, proc = cgroup(tmp_path, {"cpu.max": "100000 100000"})
    current = torch.get_num_threads()
    got = apply_thread_count({"OMP_NUM_THREADS": "7"}, cpus(current), root, proc)
    assert got == ThreadCount(current, "OMP_NUM_THREADS=7")  # what torch runs, and why
    assert torch.get_num_threads() == current


def test_thread_count_reports_the_wait_policy_too() -> None:
    data = ThreadCount(2, "affinity 2 CPUs").as_dict()
    assert data["count"] == 2 and data["source"] == "affinity 2 CPUs"
    assert data["wait_policy"] == _threads.wait_policy()
    assert ThreadCount(2, "affinity 2 CPUs").line().startswith("2 (affinity 2 CPUs); OpenMP")


@pytest.mark.parametrize(("environ", "modules", "policy", "says"), [
    ({}, {}, "PASSIVE", "OMP_WAIT_POLICY=PASSIVE (set by app"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {}, "ACTIVE", "OMP_WAIT_POLICY=ACTIVE (the user's"),
    ({"GOMP_SPINCOUNT": "10000"}, {}, None, "GOMP_SPINCOUNT=10000 (the user's"),
    ({}, {"torch": object()}, None, "the OpenMP runtime's default (torch was")])
def test_the_passive_wait_policy_is_set_only_when_it_can_work(
        monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], modules: dict[str, object],
        policy: str | None, says: str) -> None:
    monkeypatch.setattr(_threads, "_wait_policy", "")
    assert prefer_passive_wait(environ, modules).startswith(says)
    assert environ.get("OMP_WAIT_POLICY") == policy
    assert _threads.wait_policy().startswith(says)


@pytest.mark.parametrize("policy", [None, "active"])
def test_importing_app_sets_the_policy_before_torch_loads(policy: str | None) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    code = ("import os, sys; import app; from app._cpu import wait_policy\n"
            "print(os.environ.get('OMP_WAIT_POLICY')); print(wait_policy())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    value, said = proc.stdout.splitlines()
    assert value == (policy or "PASSIVE")
    assert said.startswith("OMP_WAIT_POLICY=PASSIVE (set by app" if policy is None
                           else "OMP_WAIT_POLICY=active (the user's")
