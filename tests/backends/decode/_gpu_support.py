"""Shared by the GPU decode backends' CPU tests: stand-in installation, a CPU variant of a
backend, a random paged step and a bf16 query."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from app._types import DeviceCapability
from app.backends.decode import flashinfer_mla as fi_mod
from app.backends.decode import tokenspeed_mla as ts_mod
from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.flashinfer_mla import FlashInferMLAKernels
from tests.backends.decode import _kernel_fakes as fakes

#: The SM count the stand-in tokenspeed reports (a B200's).
NUM_SMS = 148


def on_cpu(cls: type[MLADecodeBackend], cap: DeviceCapability) -> type[MLADecodeBackend]:
    """The backend with its CUDA requirement lifted and ``cap`` passed as its capability, to
    run the stand-in kernels on CPU through the conformance kit."""

    def __init__(self: Any, *args: Any, device_capability: Any = None, **kwargs: Any) -> None:
        cls.__init__(self, *args, device_capability=cap, **kwargs)

    return type(f"Cpu{cls.__name__}", (cls,), {"requires_cuda": False,
                                               "requires_device_capability": False,
                                               "__init__": __init__})


def install_fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> fakes.FakeFlashInferMLA:
    """FLASHINFER_MLA's kernels replaced by stand-ins (skips when flashinfer is missing)."""
    pytest.importorskip("flashinfer")
    fake = fakes.FakeFlashInferMLA()
    kernels = FlashInferMLAKernels(wrapper_cls=fake.wrapper_cls,
                                   plan_metadata=fake.plan_metadata,
                                   trtllm_decode=fake.trtllm_decode)
    monkeypatch.setattr(fi_mod, "_probe", lambda: kernels)
    return fake


def install_fake_tokenspeed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """TOKENSPEED_MLA's kernel replaced by a stand-in; returns its call log."""
    pytest.importorskip("tokenspeed_mla")
    calls: list[dict[str, Any]] = []
    module = types.SimpleNamespace(
        tokenspeed_mla_decode=fakes.make_tokenspeed_decode(calls, NUM_SMS),
        get_num_sm=lambda device: NUM_SMS)
    monkeypatch.setattr(ts_mod, "_probe", lambda: module)
    return calls


def paged_step(lens: list[int], bs: int, extra_cols: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shuffled paged float32 cache ``[blocks, bs, 576]``, its int32 block table (unused
    entries -1) and int32 seq_lens for ``lens``."""
    gen = torch.Generator().manual_seed(len(lens) * 31 + bs)
    needed = [(n + bs - 1) // bs for n in lens]
    perm = torch.randperm(sum(needed) + 2, generator=gen)
    table = torch.full((len(lens), max(needed, default=0) + extra_cols), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = perm[at:at + n]
        at += n
    cache = torch.randn(sum(needed) + 2, bs, 576, generator=gen)
    return cache, table, torch.tensor(lens, dtype=torch.int32)


def bf16_query(batch: int, qlen: int, seed: int = 0) -> torch.Tensor:
    """A random bf16 query ``[batch, qlen, 16, 576]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, qlen, 16, 576, generator=gen).bfloat16()
