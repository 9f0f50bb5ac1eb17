"""The GPU decode backends' workspaces, checked without a GPU: TokenSpeed's bound against the
package's own split-KV arithmetic, growth with the batch and query_len, sharing between
backends only when the same workspaces are passed in, and ``KernelWorkspaces`` itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app._types import DeviceCapability
from app.backends.decode import flashinfer_mla as fi_mod
from app.backends.decode import tokenspeed_mla as ts_mod
from app.backends.decode.flashinfer_mla import FlashInferMLADecodeBackend
from app.backends.decode.tokenspeed_mla import (
    TokenSpeedMLADecodeBackend,
    tokenspeed_workspace_bytes,
)
from app.backends.workspaces import KernelWorkspaces, WorkspaceSource
from tests.backends.decode import _gpu_support as support
from tests.backends.decode import _kernel_fakes as fakes

SM100 = DeviceCapability(10, 0)
FP8 = torch.float8_e4m3fn


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> fakes.FakeFlashInferMLA:
    return support.install_fake_flashinfer(monkeypatch)


@pytest.fixture
def fake_tokenspeed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return support.install_fake_tokenspeed(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_tokenspeed_workspace_bound_covers_the_package_requirement(dtype: torch.dtype) -> None:
    pytest.importorskip("tokenspeed_mla")
    for num_sms in (132, 148):
        for heads in (8, 16, 32, 48, 64, 128):
            for qlen in (1, 2, 3, 4, 5, 7, 8, 16):
                for batch in (1, 2, 3, 5, 8, 16, 33, 64, 100, 256):
                    bound = tokenspeed_workspace_bytes(batch, qlen, heads, 512, num_sms)
                    assert bound <= 128 * num_sms * 513 * 4
                    for max_seq in (100, 80_000):
                        need = fakes.tokenspeed_required_workspace(
                            batch, qlen, heads, 512, max_seq, dtype, num_sms)
                        assert bound >= need, (num_sms, heads, qlen, batch, max_seq)


def _ws_bytes(backend: Any) -> int:
    workspaces = backend.workspaces
    assert isinstance(workspaces, KernelWorkspaces)
    return workspaces.nbytes(ts_mod.WORKSPACE_NAME, "cpu")


@pytest.mark.slow
def test_tokenspeed_workspace_grows_with_batch_and_query_len(
        fake_tokenspeed: list[dict[str, Any]]) -> None:
    backend = support.on_cpu(TokenSpeedMLADecodeBackend, SM100)(16, 0.1, 512, 64, torch.bfloat16)
    sizes, buffers = [], []
    for lens, qlen in (([40], 1), ([40] * 4, 4), ([40] * 2, 1), ([40], 16)):
        cache, table, seq = support.paged_step(lens, 16)
        backend.prepare_metadata(table, seq, qlen)
        backend.run_decode(support.bf16_query(len(lens), qlen), cache.bfloat16())
        sizes.append(_ws_bytes(backend))
        buffers.append(fake_tokenspeed[-1]["workspace_buffer"].data_ptr())
    one, four = (tokenspeed_workspace_bytes(b, q, 16, 512, support.NUM_SMS)
                 for b, q in ((1, 1), (4, 4)))
    assert sizes == [one, four, four, four] and four > one   # grown, never shrunk
    fresh = support.on_cpu(TokenSpeedMLADecodeBackend, SM100)(16, 0.1, 512, 64, torch.bfloat16)
    cache, table, seq = support.paged_step([40] * 2, 16)
    fresh.prepare_metadata(table, seq, 1)                    # grown before the first layer
    assert _ws_bytes(fresh) == tokenspeed_workspace_bytes(2, 1, 16, 512, support.NUM_SMS)
    assert four <= 128 * support.NUM_SMS * 513 * 4                   # bounded whatever the batch
    assert buffers[1] != buffers[0] and buffers[1] == buffers[2] == buffers[3]


def test_decode_workspaces_per_name_and_device_replaced_when_grown() -> None:
    ws = KernelWorkspaces()
    assert isinstance(ws, WorkspaceSource)
    first = ws.get("a", 64, "cpu", zeroed=True)
    assert first.numel() == 64 and first.dtype == torch.uint8 and not first.any()
    assert ws.get("a", 10, "cpu") is first and ws.get("b", 10, "cpu") is not first
    bigger = ws.get("a", 100, "cpu", zeroed=True)
    assert bigger.numel() == 100 and bigger is not first and not bigger.any()
    assert ws.nbytes("a", "cpu") == 100 and ws.nbytes("a", "meta") == 0
    with pytest.raises(ValueError, match="nbytes"):
        ws.get("a", -1, "cpu")
    import threading
    got: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: got.append(ws.get("c", 1000, "cpu")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({t.data_ptr() for t in got}) == 1


def test_backends_share_workspaces_only_when_given_the_same(
        fake_flashinfer: fakes.FakeFlashInferMLA, fake_tokenspeed: list[dict[str, Any]]) -> None:
    shared = KernelWorkspaces()
    a, b = (support.on_cpu(FlashInferMLADecodeBackend, SM100)(16, 0.1, 512, 64, torch.bfloat16,
                                                      workspaces=shared) for _ in range(2))
    own = support.on_cpu(FlashInferMLADecodeBackend, SM100)(16, 0.1, 512, 64, torch.bfloat16)
    cpu = torch.device("cpu")
    assert a.workspace(cpu) is b.workspace(cpu) and own.workspace(cpu) is not a.workspace(cpu)
    assert a.workspace(cpu).numel() == fi_mod.WORKSPACE_BYTES and not a.workspace(cpu).any()
    ts = support.on_cpu(TokenSpeedMLADecodeBackend, SM100)(16, 0.1, 512, 64, torch.bfloat16,
                                                  workspaces=shared)
    assert ts.workspace(cpu, 10).dtype == torch.int8
    assert shared.nbytes(ts_mod.WORKSPACE_NAME, cpu) == 10


@pytest.mark.slow
def test_trtllm_gen_workspace_grows_with_the_batch_when_the_lse_is_asked(
        fake_flashinfer: fakes.FakeFlashInferMLA) -> None:
    backend = support.on_cpu(FlashInferMLADecodeBackend, SM100)(128, 0.1, 512, 64,
                                                               torch.bfloat16)
    sizes = []
    for batch, lse in ((2, False), (2, True), (600, True), (2, True)):
        cache, table, seq = support.paged_step([1] * batch, 32)
        backend.prepare_metadata(table, seq, 1)
        q = torch.zeros(batch, 1, 128, 576, dtype=torch.bfloat16)
        backend.run_decode(q, cache.bfloat16(), return_softmax_lse=lse)
        sizes.append(fake_flashinfer.trtllm_calls[-1]["workspace_buffer"].numel())
    big = fi_mod.trtllm_gen_workspace_bytes(600, 1, 128, True)
    assert fi_mod.WORKSPACE_BYTES < 8 * 128 * 600 * 256  # a fixed 128 MiB would overflow
    assert sizes == [fi_mod.WORKSPACE_BYTES, fi_mod.trtllm_gen_workspace_bytes(2, 1, 128, True),
                     big, big]


def test_the_container_kernel_workspaces_fit(fake_tokenspeed: list[dict[str, Any]]) -> None:
    """The container's ``KernelWorkspaces`` can be handed to both backends as is."""
    from app.backends.workspaces import KernelWorkspaces

    shared = KernelWorkspaces()
    assert isinstance(shared, WorkspaceSource)
    backend = support.on_cpu(TokenSpeedMLADecodeBackend, SM100)(16, 0.1, 512, 64,
                                                               torch.bfloat16,
                                                               workspaces=shared)
    cache, table, seq = support.paged_step([40, 9], 16)
    backend.prepare_metadata(table, seq, 2)
    backend.run_decode(support.bf16_query(2, 2), cache.bfloat16())
    assert fake_tokenspeed[-1]["workspace_buffer"].dtype == torch.int8 and len(shared) == 1
    fi = support.on_cpu(FlashInferMLADecodeBackend, SM100)(16, 0.1, 512, 64, torch.bfloat16,
                                                          workspaces=shared)
    assert not fi.workspace(torch.device("cpu")).any() and len(shared) == 2
