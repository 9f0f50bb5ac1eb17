"""Facts about this machine (the host) that the platform, the CPU kernels and the engine read:
its CPU's vector features, read from the CPU itself (not torch's capability string); the
memory a new allocation can get now (read, never assumed); and how host values reach a device
without the host waiting for it (``copy_to_device``). Public as
:mod:`app.platforms.cpu_features`; it lives here, below every other module, so kernels and
the layer can read it without importing the platforms package.

On Linux the flags come from ``/proc/cpuinfo`` (the kernel's ``cpuid`` decoding, already masked
by what the OS enables: ``amx_bf16`` only appears when the kernel manages the AMX tile state).
Elsewhere :func:`read_cpu_features` falls back to torch's CPU capability string, which knows
AVX-512 and AMX but not AVX512-BF16 or AVX512-FP16 (those read False there; ``source`` says
which way the answer was found). Why not torch's string everywhere: it says ``AVX512`` on an
AMD EPYC with AVX512-BF16, so bf16 work was sent down float32 paths that ran ~4x slower.

The features that decide kernels here:

- ``avx512f``: the native CPU kernels' float32 path (``vfmadd231ps`` on 16 lanes);
- ``avx512_bf16``: ``vdpbf16ps``, a bf16 pair dot product accumulated in float32 (the bf16
  prefill kernel, the bf16 peak probe, bf16 projections);
- ``amx_bf16``: AMX tiles with bf16 dot products (bf16 matmuls in oneDNN / torch);
- ``avx512_fp16``: native fp16 arithmetic (fast fp16 matmuls).

Threads. How many threads this process should compute on: the CPUs it may really use.

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

AVX-512 emulated for testing (``APP_CPU_EMULATE_AVX512=1``, :mod:`app._cpu.emulation`): on a CPU
without AVX-512 where it takes effect, :func:`cpu_flags` and this machine's features
(:func:`read_cpu_features`, :func:`detect_cpu_features`) report the emulated extensions (the
source says EMULATED); :func:`real_cpu_flags` is always the CPU's own, and is what the native
loader checks a library's instructions against.

Importing this module (``app/__init__`` does it first) also sets ``OMP_WAIT_POLICY=PASSIVE``
for the OpenMP runtime torch is about to load, unless the user set a policy or torch is
already loaded (:func:`prefer_passive_wait`).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from app._cpu.emulation import EMULATED_FLAGS, Avx512Emulation, decide

if TYPE_CHECKING:  # torch is imported where used: importing this module must not load
    import torch  # it (the OpenMP wait policy below is read when torch loads OpenMP)

__all__ = [
    "CGROUP_ROOT",
    "CPUINFO_PATH",
    "FEATURE_NAMES",
    "MKL_ENV",
    "OMP_ENV",
    "PROC_SELF_CGROUP",
    "WAIT_POLICY_ENV",
    "CpuFeatures",
    "ThreadCount",
    "affinity_cpus",
    "apply_thread_count",
    "available_host_bytes",
    "avx512_emulation",
    "cgroup_cpu_limit",
    "copy_to_device",
    "cpu_flags",
    "cpu_has_native_bf16",
    "detect_cpu_features",
    "parse_cfs_quota",
    "parse_cpu_max",
    "parse_cpuinfo",
    "physical_memory_bytes",
    "prefer_passive_wait",
    "read_cpu_features",
    "real_cpu_flags",
    "required_cpu_flags",
    "thread_count",
    "wait_policy",
]

#: Where Linux publishes the CPU's flags.
CPUINFO_PATH = Path("/proc/cpuinfo")
#: The features reported, by their ``/proc/cpuinfo`` flag names.
FEATURE_NAMES = ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")


@attrs.frozen
class CpuFeatures:
    """The vector features of this CPU that the kernels care about, and where they were read.

    ``model_name`` is the CPU's model string (``/proc/cpuinfo``'s ``model name``, else the
    platform's processor name); ``source`` is ``"/proc/cpuinfo"`` (or the file read),
    ``"torch capability AVX512"`` (fallback) or ``"none"`` (not an x86-64 CPU); with
    ``, AVX-512 EMULATED by SIMDe ...`` after it where ``APP_CPU_EMULATE_AVX512`` is in effect
    (:func:`detect_cpu_features`; for testing only).
    """

    avx512f: bool = False
    avx512_bf16: bool = False
    amx_bf16: bool = False
    avx512_fp16: bool = False
    model_name: str = ""
    source: str = "none"

    @property
    def fast_bfloat16(self) -> bool:
        """True where bf16 products run natively: AVX512-BF16 (``vdpbf16ps``) or AMX-BF16."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def fast_float16(self) -> bool:
        """True where fp16 arithmetic runs natively (AVX512-FP16)."""
        return self.avx512_fp16

    def present(self) -> list[str]:
        """The names of :data:`FEATURE_NAMES` this CPU has, in that order."""
        return [name for name in FEATURE_NAMES if getattr(self, name)]

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly: every feature as a bool, the model name and the source."""
        return {**{name: getattr(self, name) for name in FEATURE_NAMES},
                "model_name": self.model_name, "source": self.source}

    def describe(self) -> str:
        """One line: ``avx512f=yes avx512_bf16=no ... (from /proc/cpuinfo)``."""
        flags = " ".join(f"{name}={'yes' if getattr(self, name) else 'no'}"
                         for name in FEATURE_NAMES)
        return f"{flags} (from {self.source})"


def parse_cpuinfo(text: str, source: str = str(CPUINFO_PATH)) -> CpuFeatures:
    """The features in the text of a ``/proc/cpuinfo``: the first processor's ``flags`` line
    (x86) and ``model name``. ``ValueError`` when the text has no ``flags`` line."""
    flags: set[str] | None = None
    model = ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "flags" and flags is None:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    if flags is None:
        raise ValueError(f"{source}: expected a 'flags' line (x86 /proc/cpuinfo), found none")
    return CpuFeatures(avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                       amx_bf16="amx_bf16" in flags, avx512_fp16="avx512_fp16" in flags,
                       model_name=model, source=source)


def _from_torch_capability() -> CpuFeatures:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuFeatures(model_name=platform.processor() or platform.machine())
    import torch

    capability = torch.backends.cpu.get_cpu_capability().upper()
    # torch's string ranks DEFAULT < AVX2 < AVX512 < AMX (an AMX CPU has AVX512-BF16 too).
    amx = capability.startswith("AMX")
    return CpuFeatures(avx512f=amx or capability.startswith("AVX512"), avx512_bf16=amx,
                       amx_bf16=amx, model_name=platform.processor() or platform.machine(),
                       source=f"torch capability {capability}")


def read_cpu_features(cpuinfo: Path | str | None = None) -> CpuFeatures:
    """Read the features now (no caching): from ``cpuinfo`` (default ``/proc/cpuinfo``) on
    Linux x86, falling back to torch's capability string where the file is absent, unreadable
    or has no ``flags`` line (another OS, another architecture). This machine's (no
    ``cpuinfo``) read AVX-512F and AVX512-BF16 present where :func:`avx512_emulation` is in
    effect (for testing only; ``source`` says EMULATED)."""
    path = Path(cpuinfo) if cpuinfo is not None else CPUINFO_PATH
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        features = _from_torch_capability()
    else:
        try:
            features = parse_cpuinfo(text, str(path))
        except ValueError:
            features = _from_torch_capability()
    return features if cpuinfo is not None else _emulated(features)


def _emulated(features: CpuFeatures) -> CpuFeatures:
    emulation = avx512_emulation()
    if not emulation.active or features.avx512f:  # (a test's faked CPU may have it)
        return features
    return attrs.evolve(features, avx512f=True, avx512_bf16=True,
                        source=f"{features.source}, AVX-512 EMULATED by {emulation.simde}")


_lock = threading.Lock()


@functools.cache
def _cached() -> CpuFeatures:
    return read_cpu_features()


def detect_cpu_features() -> CpuFeatures:
    """This machine's features (:func:`read_cpu_features`), read once per process
    (thread-safe)."""
    with _lock:
        return _cached()


def _reset_for_tests() -> None:
    """Forget the cached features, so the next :func:`detect_cpu_features` reads them again."""
    with _lock:
        _cached.cache_clear()


def cpu_has_native_bf16() -> bool:
    """Whether bf16 products run natively (AVX512-BF16 or AMX-BF16, read from the CPU);
    plain AVX2 / AVX512 convert through float32."""
    return detect_cpu_features().fast_bfloat16


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host`` on ``device``, without a host-device synchronisation: ``host``
    itself on the CPU; elsewhere an asynchronous copy from pinned memory (a plain ``.to(device)``
    of pageable memory waits for every kernel queued before it). The copy is queued on the
    current stream, before any kernel that reads it; the pinned staging buffer is not reused
    until the copy is done (torch's caching host allocator records that)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def physical_memory_bytes() -> int | None:
    """The host's physical memory; None where ``sysconf`` cannot tell."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_host_bytes() -> int | None:
    """Host memory a new allocation can get now: ``MemAvailable`` of ``/proc/meminfo`` (free
    plus reclaimable), else the physical memory; None when neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory_bytes()


# -- the flags a native library needs ----------------------------------------------------

def avx512_emulation() -> Avx512Emulation:
    """Whether AVX-512 is emulated in this process (``APP_CPU_EMULATE_AVX512``), and why (not):
    see :mod:`app._cpu.emulation`."""
    return decide(real_cpu_flags())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (:func:`real_cpu_flags`), with the emulated AVX-512 extensions
    where :func:`avx512_emulation` is in effect: what the kernels' requirements read."""
    real = real_cpu_flags()
    return real | EMULATED_FLAGS if decide(real).active else real


def real_cpu_flags() -> frozenset[str]:
    """The CPU's own feature flags from ``/proc/cpuinfo`` (empty where there is none), read
    every call: what the native loader checks a library's instruction sets against."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


#: ``-m`` flags whose ``/proc/cpuinfo`` name is not theirs with ``-`` made ``_``.
_ISA_FLAG_NAMES = {"avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
                   "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8",
                   "sse4.1": "sse4_1", "sse4.2": "sse4_2"}
#: ``-m`` flags that are not instruction sets.
_NOT_ISA = ("arch=", "tune=", "no-", "cpu=", "fpmath=", "abi=", "cmodel=", "prefer-")


def required_cpu_flags(flags: Sequence[str]) -> frozenset[str]:
    """The ``/proc/cpuinfo`` flags a library built with the compiler ``flags`` needs: one per
    ISA flag (``-mavx512f`` -> ``avx512f``, ``-mavx512bf16`` -> ``avx512_bf16``); flags that
    name no instruction set (``-O3``, ``-D...``, ``-march=...``) need nothing."""
    needed = set()
    for flag in flags:
        if not flag.startswith("-m") or flag[2:].startswith(_NOT_ISA):
            continue
        name = flag[2:]
        needed.add(_ISA_FLAG_NAMES.get(name, name.replace("-", "_")))
    return frozenset(needed)


# -- threads ----------------------------------------------------------------------------

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
_wait_policy = "not set up (app._cpu.prefer_passive_wait was not called)"


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
