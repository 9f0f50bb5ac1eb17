"""How many threads this process should compute on: the CPUs it may really use.

torch sizes its intra-op OpenMP team from the CPUs the process's affinity mask allows (libgomp
counts them at start). It does not read a container's CPU quota, so a container given 1.5 CPUs
on a 16-core host starts 16 threads, and the kernel throttles them all once the quota is spent:
a parallel region waits on threads that are not running. The package's native kernels deal
their shares onto ``torch.get_num_threads()`` threads (torch's OpenMP team or the package's
pool), so sizing torch's team sizes theirs too.

:func:`thread_count` says how many threads to use and why, the first rule that applies:

1. ``OMP_NUM_THREADS`` (else ``MKL_NUM_THREADS``) set by the user: torch already read it at
   its start; it wins.
2. otherwise the fewest of: the CPUs in the affinity mask (``os.sched_getaffinity``) and the
   cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the
   tightest along the process's cgroup and its parents), rounded down, never below 1.

:func:`apply_thread_count` sets torch to that count unless the caller already chose one
(``torch.set_num_threads`` to anything but torch's own default). Every path is injectable for
tests.

Importing this module (``app/__init__`` does it first) also sets ``OMP_WAIT_POLICY=PASSIVE``
for the OpenMP runtime torch is about to load, unless the user set a policy or torch is
already loaded (:func:`prefer_passive_wait`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

import attrs

__all__ = ["CGROUP_ROOT", "MKL_ENV", "OMP_ENV", "PROC_SELF_CGROUP", "WAIT_POLICY_ENV",
           "ThreadCount", "affinity_cpus",
           "apply_thread_count", "cgroup_cpu_limit", "parse_cfs_quota", "parse_cpu_max",
           "prefer_passive_wait", "thread_count", "wait_policy"]

#: Where the cgroup file systems are mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Which cgroup(s) this process is in.
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: The user's thread count, read by the OpenMP runtime when torch loads it.
OMP_ENV = "OMP_NUM_THREADS"
#: torch reads this one too when ``OMP_NUM_THREADS`` is unset (its MKL builds' setting).
MKL_ENV = "MKL_NUM_THREADS"


@attrs.frozen
class ThreadCount:
    """A thread count and where it came from (``source``: e.g. ``"OMP_NUM_THREADS=1"``,
    ``"cgroup cpu.max 1.5 CPUs"``, ``"affinity 2 CPUs"``)."""

    count: int
    source: str

    def as_dict(self) -> dict[str, object]:
        """``{"count", "source", "wait_policy"}`` for a JSON report (the last:
        :func:`wait_policy`)."""
        return {"count": self.count, "source": self.source, "wait_policy": wait_policy()}

    def line(self) -> str:
        """``"2 (affinity 2 CPUs); OpenMP wait policy: ..."``: what a command prints."""
        return f"{self.count} ({self.source}); OpenMP wait policy: {wait_policy()}"


def parse_cpu_max(text: str) -> float | None:
    """The CPUs a cgroup v2 ``cpu.max`` (``"<quota> <period>"``, microseconds) grants:
    ``"200000 100000"`` is 2.0, ``"max 100000"`` None (no limit). ``ValueError`` for text of
    another form."""
    fields = text.split()
    if len(fields) not in (1, 2):
        raise ValueError(f"cpu.max should hold '<quota|max> <period>', got {text.strip()!r}")
    if fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1] if len(fields) == 2 else "100000", "cpu.max")


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """The CPUs cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` grant (a quota of
    ``-1`` is no limit). ``ValueError`` for text that is not an integer."""
    if quota.strip() == "-1":
        return None
    return _ratio(quota, period, "cpu.cfs_quota_us")


def _ratio(quota: str, period: str, name: str) -> float:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        raise ValueError(f"{name}: quota and period should be integers, got {quota.strip()!r} "
                         f"and {period.strip()!r}") from None
    if q <= 0 or p <= 0:
        raise ValueError(f"{name}: quota and period should be > 0, got {q} and {p}")
    return q / p


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 ``cpu`` controller's path (``/proc/self/
    cgroup``: ``0::/path`` and ``N:cpu,cpuacct:/path``), None where there is none."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(root: Path, path: str | None) -> list[Path]:
    """``root/path`` and each directory above it up to ``root`` itself (a container sees its
    own cgroup as ``/``; a limit may sit on any ancestor)."""
    parts = [p for p in (path or "/").split("/") if p and p != ".."]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # absent (no such controller here) or unreadable: no limit known
        return None


def cgroup_cpu_limit(root: Path | None = None, proc_cgroup: Path | None = None
                     ) -> tuple[float, str] | None:
    """The tightest CPU quota on this process's cgroup or its parents, and which file set it
    (``(1.5, "cgroup cpu.max 1.5 CPUs")``), or None when no quota applies. Reads cgroup v2
    (``cpu.max``) and v1 (``cpu/cpu.cfs_quota_us``, ``cpu,cpuacct/...``). ``ValueError`` for a
    quota file that cannot be read as one. ``root`` and ``proc_cgroup`` default to
    :data:`CGROUP_ROOT` and :data:`PROC_SELF_CGROUP`."""
    root = CGROUP_ROOT if root is None else root
    v2, v1 = _cgroup_paths(PROC_SELF_CGROUP if proc_cgroup is None else proc_cgroup)
    found: list[tuple[float, str]] = []
    for directory in _ancestors(root, v2):
        text = _read(directory / "cpu.max")
        cpus = None if text is None else parse_cpu_max(text)
        if cpus is not None:
            found.append((cpus, f"cgroup cpu.max {cpus:g} CPUs"))
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for directory in _ancestors(root / mount, v1):
            quota, period = (_read(directory / f"cpu.cfs_{n}_us") for n in ("quota", "period"))
            cpus = None if quota is None or period is None else parse_cfs_quota(quota, period)
            if cpus is not None:
                found.append((cpus, f"cgroup cpu.cfs_quota_us {cpus:g} CPUs"))
    return min(found, key=lambda item: item[0]) if found else None


def affinity_cpus(getaffinity: Callable[[int], set[int]] | None = None) -> int | None:
    """How many CPUs this process may run on (its affinity mask), None where the platform
    cannot say (not Linux)."""
    get = getaffinity if getaffinity is not None else getattr(os, "sched_getaffinity", None)
    if get is None:
        return None
    try:
        return len(get(0)) or None
    except OSError:
        return None


def _user_value(name: str, text: str) -> int:
    """The outermost level of an ``OMP_NUM_THREADS`` value (``"4"``, ``"4,2"``)."""
    first = text.split(",")[0].strip()
    try:
        value = int(first)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer (or a comma list of them), got "
                         f"{text!r}")
    return value


def thread_count(environ: Mapping[str, str] | None = None,
                 getaffinity: Callable[[int], set[int]] | None = None,
                 cgroup_root: Path | None = None,
                 proc_cgroup: Path | None = None) -> ThreadCount:
    """How many threads to compute on, and why (see the module): ``OMP_NUM_THREADS`` when set,
    (else ``MKL_NUM_THREADS``), else the fewest of the affinity mask's CPUs and the cgroup
    quota (rounded down, >= 1). ``ValueError`` for such a setting that is not a positive
    integer."""
    env = os.environ if environ is None else environ
    for name in (OMP_ENV, MKL_ENV):
        user = env.get(name, "").strip()
        if user:
            return ThreadCount(_user_value(name, user), f"{name}={user}")
    cpus = affinity_cpus(getaffinity)
    limit = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    affinity = None if cpus is None else f"affinity {cpus} CPU{'s' if cpus > 1 else ''}"
    if limit is not None and (cpus is None or limit[0] < cpus):
        count = max(1, math.floor(limit[0]))
        return ThreadCount(count, limit[1] + ("" if affinity is None else f" ({affinity})"))
    if cpus is not None:
        return ThreadCount(cpus, str(affinity))
    return ThreadCount(os.cpu_count() or 1, "os.cpu_count()")


#: The OpenMP wait policy: ``PASSIVE`` makes a thread that waits for work sleep at once.
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
#: libgomp's own spin setting, and the Intel runtime's: a user who set one chose the policy.
_SPIN_ENVS = (WAIT_POLICY_ENV, "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_wait_policy = "not set up (app._threads.prefer_passive_wait was not called)"


def prefer_passive_wait(environ: MutableMapping[str, str] | None = None,
                        modules: Mapping[str, object] | None = None) -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for the OpenMP runtime torch is about to load (it reads
    the environment once, when loaded), unless the user chose a policy (``OMP_WAIT_POLICY``,
    ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) or torch is already loaded (then nothing changes:
    too late). What the policy is, in words; :func:`wait_policy` says it again later.

    Why: by default libgomp's threads spin for work between parallel regions. When another
    process holds a core, the spinning thread and the descheduled one cost each region a
    scheduler slice: the main job ran 3-10x slower on a busy 2-core machine, and as fast as
    one thread with a passive policy (docs/threads.md has the measurements)."""
    env = os.environ if environ is None else environ
    loaded = sys.modules if modules is None else modules
    global _wait_policy
    chosen = [f"{name}={env[name]}" for name in _SPIN_ENVS if env.get(name, "").strip()]
    if chosen:
        _wait_policy = f"{', '.join(chosen)} (the user's setting)"
    elif "torch" in loaded:
        _wait_policy = ("the OpenMP runtime's default (torch was imported before app; set "
                        f"{WAIT_POLICY_ENV}=PASSIVE before importing torch)")
    else:
        env[WAIT_POLICY_ENV] = "PASSIVE"
        _wait_policy = (f"{WAIT_POLICY_ENV}=PASSIVE (set by app before torch loaded OpenMP; "
                        f"{WAIT_POLICY_ENV}=ACTIVE keeps threads spinning)")
    return _wait_policy


def wait_policy() -> str:
    """What :func:`prefer_passive_wait` found or set, in words."""
    return _wait_policy


_applied: int | None = None  # the count apply_thread_count last set


def apply_thread_count(environ: Mapping[str, str] | None = None,
                       getaffinity: Callable[[int], set[int]] | None = None,
                       cgroup_root: Path | None = None,
                       proc_cgroup: Path | None = None) -> ThreadCount:
    """Size torch's intra-op threads (and so the native kernels' shares) by
    :func:`thread_count` (same arguments), unless the count was chosen already: by the
    environment (torch read it at its start), or by a ``torch.set_num_threads`` call (torch's
    count is neither its own default, the affinity mask's CPUs, nor the one this function
    set). The count in effect now, and why."""
    import torch

    global _applied
    current = torch.get_num_threads()
    wanted = thread_count(environ, getaffinity, cgroup_root, proc_cgroup)
    if wanted.source.startswith((OMP_ENV, MKL_ENV)):
        return ThreadCount(current, wanted.source)
    if current not in (affinity_cpus(getaffinity), _applied, wanted.count):
        return ThreadCount(current, f"torch.set_num_threads({current}) by the caller")
    if current != wanted.count:
        torch.set_num_threads(wanted.count)
    _applied = wanted.count
    return wanted


# On import: ``app/__init__`` imports this module before anything that imports torch.
prefer_passive_wait()
