"""AMX availability (``app.backends.cpu.amx``): the CPU's flags, the switch, and Linux's answer
to the tile-state request, each refusal a reason. The system call is faked where the test
needs an answer this machine cannot give; on a CPU without AMX the real request is refused
(checked too)."""

from __future__ import annotations

import ctypes
import errno
from typing import Any

import pytest

from app.backends.cpu import amx
from app.backends.cpu.amx import (
    ARCH_GET_XCOMP_PERM,
    ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA,
    amx_status,
    request_tile_permission,
)
from app.backends.cpu.loader import cpu_flags

AMX_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"})


class FakeKernel:
    """``arch_prctl`` as a kernel would answer it: the request refused with ``refuse``
    (an errno) or granted; the permitted mask then with or without the tile data."""

    def __init__(self, refuse: int = 0, grant_bit: bool = True) -> None:
        self.refuse, self.grant_bit, self.calls = refuse, grant_bit, []

    def __call__(self, number: int, code: int, arg: Any) -> tuple[int, int]:
        self.calls.append((number, code))
        if code == ARCH_REQ_XCOMP_PERM:
            assert arg == XFEATURE_XTILEDATA
            return (-1, self.refuse) if self.refuse else (0, 0)
        assert code == ARCH_GET_XCOMP_PERM
        arg._obj.value = 0x2E7 | (1 << XFEATURE_XTILEDATA if self.grant_bit else 0)
        return 0, 0


def test_no_amx_flags_is_not_available_and_asks_linux_nothing() -> None:
    kernel = FakeKernel()
    status = amx_status(flags=frozenset({"avx512f", "avx512_bf16"}), syscall=kernel)
    assert not status.available
    assert "no AMX-BF16 tiles" in status.reason and "amx_tile and amx_bf16" in status.reason
    assert kernel.calls == []
    only_tile = amx_status(flags=frozenset({"amx_tile"}), syscall=kernel)
    assert not only_tile.available and "amx_bf16 not in" in only_tile.reason


@pytest.mark.parametrize(("err", "says"), [
    (errno.EPERM, "seccomp"), (errno.EOPNOTSUPP, "no AMX tile state"),
    (errno.ENOSPC, "alternate stack"), (errno.EINVAL, "does not know"),
    (errno.EIO, "EIO")])
def test_a_refused_request_is_not_available_with_the_reason(err: int, says: str) -> None:
    status = amx_status(flags=AMX_FLAGS, syscall=FakeKernel(refuse=err))
    assert not status.available
    assert "Linux refused the AMX tile state" in status.reason
    assert errno.errorcode[err] in status.reason and says in status.reason


def test_a_granted_request_is_available_once_the_mask_holds_the_tile_data() -> None:
    kernel = FakeKernel()
    status = amx_status(flags=AMX_FLAGS, syscall=kernel)
    assert status.available and "granted" in status.reason
    assert [code for _, code in kernel.calls] == [ARCH_REQ_XCOMP_PERM, ARCH_GET_XCOMP_PERM]
    missing_bit = amx_status(flags=AMX_FLAGS, syscall=FakeKernel(grant_bit=False))
    assert not missing_bit.available and "do not include the tile data" in missing_bit.reason


def test_the_switch_turns_amx_off_before_linux_is_asked(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    kernel = FakeKernel()
    monkeypatch.setenv("APP_CPU_AMX", "0")
    status = amx_status(flags=AMX_FLAGS, syscall=kernel)
    assert not status.available and "APP_CPU_AMX=0" in status.reason and kernel.calls == []
    monkeypatch.setenv("APP_CPU_AMX", "maybe")
    with pytest.raises(ValueError, match="APP_CPU_AMX"):
        amx_status(flags=AMX_FLAGS, syscall=kernel)


def test_a_syscall_that_raises_is_a_reason() -> None:
    def broken(*args: Any) -> tuple[int, int]:
        raise OSError("no libc here")

    assert "could not call arch_prctl" in str(request_tile_permission(broken))


@pytest.mark.skipif({"amx_tile", "amx_bf16"} <= cpu_flags(),
                    reason="this CPU has AMX: Linux may grant the request")
def test_the_real_request_is_refused_on_a_cpu_without_amx() -> None:
    """This machine's own answer (EOPNOTSUPP on the project's AMD EPYC), kept per process."""
    refused = request_tile_permission()
    assert refused is not None and "Linux refused the AMX tile state" in refused
    assert request_tile_permission() == refused
    assert not amx_status(flags=AMX_FLAGS).available   # flags faked: Linux still says no


def test_the_real_mask_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """ARCH_GET_XCOMP_PERM through the real syscall wrapper (any x86-64 Linux answers it)."""
    mask = ctypes.c_uint64(0)
    result, err = amx._libc_syscall(158, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    assert result == 0 and err == 0 and mask.value & 0x3   # x87 and SSE are always there
