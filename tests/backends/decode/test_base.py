"""The decode contract's shared checks: every bad input is refused before any kernel runs."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from app._types import DeviceCapability
from app.backends import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.decode.base import DecodeMetadata

RANK, ROPE, HEADS, BS = 8, 4, 2, 4


class _Recorder(MLADecodeBackend):
    """A backend whose 'kernel' records that it ran and writes zeros."""

    calls = 0
    supported_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def get_name() -> str:
        return "RECORDER"

    def _run_decode(self, metadata: DecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> None:
        type(self).calls += 1
        out.zero_()
        if lse is not None:
            lse.fill_(softmax_scale * k_scale)


def _backend(**kw: object) -> _Recorder:
    args: dict[str, object] = {"num_heads": HEADS, "scale": 0.5, "kv_lora_rank": RANK,
                               "qk_rope_head_dim": ROPE, "kv_cache_dtype": torch.float32}
    args.update(kw)
    return _Recorder(**args)  # type: ignore[arg-type]


def _step(b: _Recorder, seq_lens: list[int], query_len: int = 1, width: int = 3,
          num_blocks: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    bt = torch.arange(len(seq_lens) * width, dtype=torch.int32).reshape(-1, width) % num_blocks
    b.prepare_metadata(bt, torch.tensor(seq_lens, dtype=torch.int32), query_len)
    q = torch.randn(len(seq_lens), query_len, HEADS, RANK + ROPE)
    cache = torch.randn(num_blocks, BS, RANK + ROPE)
    return q, cache


def test_forward_runs_and_reads_scales_every_call() -> None:
    b = _backend()
    q, cache = _step(b, [5, 9])
    out, lse = b.run_decode(q, cache, return_softmax_lse=True)
    assert out.shape == (2, 1, HEADS, RANK) and lse.shape == (HEADS, 2, 1)
    assert lse.dtype == torch.float32 and float(lse[0, 0, 0]) == 0.5
    _, lse = b.run_decode(q, cache, return_softmax_lse=True, softmax_scale=0.25, k_scale=2.0)
    assert float(lse[0, 0, 0]) == 0.5
    _, lse = b.run_decode(q, cache, return_softmax_lse=True)
    assert float(lse[0, 0, 0]) == 0.5


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan, "1", True])
def test_bad_scale_is_refused(scale: object) -> None:
    with pytest.raises(ValueError, match="scale"):
        _backend(scale=scale)
    b = _backend()
    q, cache = _step(b, [5])
    with pytest.raises(ValueError, match="softmax_scale"):
        b.run_decode(q, cache, softmax_scale=scale)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k_scale"):
        b.run_decode(q, cache, k_scale=scale)  # type: ignore[arg-type]


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="num_heads"):
        _backend(num_heads=0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _backend(kv_cache_dtype=torch.int8)
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        _backend(kv_cache_dtype="bf16")
    with pytest.raises(TypeError, match="device_capability"):
        _backend(device_capability=(9, 0))


def test_non_uniform_batch_is_refused() -> None:
    b = _backend()
    bt = torch.zeros(2, 3, dtype=torch.int32)
    sl = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="uniform query_len"):
        b.prepare_metadata(bt, sl, [1, 2])
    with pytest.raises(ValueError, match="uniform query_len"):
        b.prepare_metadata(bt, sl, torch.tensor([2, 1], dtype=torch.int32))
    b.prepare_metadata(bt, sl, [2, 2])
    assert b.metadata.query_len == 2
    for bad in (0, 17, 1.0):
        with pytest.raises(ValueError, match="query_len"):
            b.prepare_metadata(bt, sl, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="less than query_len"):
        b.prepare_metadata(bt, torch.tensor([1, 6], dtype=torch.int32), 2)


def test_layout_checks_before_the_kernel() -> None:
    b = _backend()
    before = _Recorder.calls
    q, cache = _step(b, [13], width=3)          # 13 tokens at block size 4 need 4 blocks
    with pytest.raises(ValueError, match="needs 4 blocks"):
        b.run_decode(q, cache)
    b.prepare_metadata(torch.tensor([[0, 9, 1]], dtype=torch.int32),
                       torch.tensor([6], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9 is out of range"):
        b.run_decode(q, cache)
    b.prepare_metadata(torch.tensor([[0, -1, 9]], dtype=torch.int32),
                       torch.tensor([4], dtype=torch.int32), 1)
    b.run_decode(q, cache)                  # unused entries are never read
    b.prepare_metadata(torch.tensor([[0, -1]], dtype=torch.int32),
                       torch.tensor([5], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="-1 is out of range"):
        b.run_decode(q, cache)
    assert _Recorder.calls == before + 1


def test_tensor_checks() -> None:
    b = _backend()
    q, cache = _step(b, [5, 6], query_len=2)
    cases: list[tuple[torch.Tensor, torch.Tensor, str]] = [
        (q[:1], cache, "q must be"),                              # batch does not match
        (q[:, :1], cache, "q must be"),                           # query_len does not match
        (q, cache[..., :-1], "kv_cache must be"),                  # wrong width
        (q, cache[0], "kv_cache must be"),                         # wrong rank
        (q, cache.to(torch.bfloat16), "kv_cache dtype"),
        (q.to(torch.int32), cache, "q dtype"),
        (q, cache.repeat(1, 1, 2)[..., ::2], "unit stride"),
    ]
    for qq, cc, match in cases:
        with pytest.raises(ValueError, match=match):
            b.run_decode(qq, cc)
    with pytest.raises(ValueError, match="out must have"):
        b.run_decode(q, cache, out=torch.empty(2, 2, HEADS, RANK + 1))
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
        b.run_decode(q.numpy(), cache)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prepare_metadata"):
        _backend().run_decode(q, cache)


def test_out_and_empty_batch() -> None:
    b = _backend()
    q, cache = _step(b, [5, 6])
    out = torch.full((2, 1, HEADS, RANK * 2), 7.0)[..., ::2]     # non-contiguous out
    got = b.run_decode(q, cache, out=out)
    assert got is out and bool((out == 0).all())
    q, cache = _step(b, [])
    out, lse = b.run_decode(q, cache, return_softmax_lse=True)
    assert out.shape == (0, 1, HEADS, RANK) and lse.shape == (HEADS, 0, 1)


def test_selector_config_and_validate_configuration() -> None:
    cfg = MLADecodeSelectorConfig(dtype=torch.float64, kv_lora_rank=512, qk_rope_head_dim=64,
                                  num_heads=16, block_size=64, query_len=4)
    assert _Recorder.validate_configuration(None, cfg) == ["dtype torch.float64 not supported"]
    with pytest.raises(ValueError, match="query_len"):
        MLADecodeSelectorConfig(dtype=torch.float16, kv_lora_rank=512, qk_rope_head_dim=64,
                                num_heads=16, block_size=64, query_len=17)

    class Picky(_Recorder):
        supported_block_sizes = (32, 64)
        supported_head_dims = ((512, 64),)
        requires_device_capability = True
        max_query_len = 2

    bad = MLADecodeSelectorConfig(dtype=torch.float64, kv_lora_rank=256, qk_rope_head_dim=64,
                                  num_heads=16, block_size=16, query_len=4)
    reasons = Picky.validate_configuration(None, bad)
    assert [r.split(" ")[0] for r in reasons] == ["device", "dtype", "MLA", "block", "query_len"]
    assert "supported: 32, 64" in reasons[3]
    assert Picky.validate_configuration(DeviceCapability(9, 0), cfg) == [
        "dtype torch.float64 not supported", "query_len 4 exceeds the maximum 2"]


def test_reason_slots_let_a_backend_add_reasons_in_order() -> None:
    """A backend with a limit of its own adds it to its slot of ``reason_slots``; the flattened
    slots are ``validate_configuration``, whatever the backend."""

    class EvenHeads(_Recorder):
        requires_device_capability = True
        supported_block_sizes = (64,)

        @classmethod
        def validate_configuration(cls, device_capability: DeviceCapability | None,
                                   selector_config: MLADecodeSelectorConfig) -> list[str]:
            slots = cls.reason_slots(device_capability, selector_config)
            if selector_config.num_heads % 2:
                slots["dimensions"].append(f"{selector_config.num_heads} heads: odd")
            return [r for reasons in slots.values() for r in reasons]

    bad = MLADecodeSelectorConfig(dtype=torch.float64, kv_lora_rank=512, qk_rope_head_dim=64,
                                  num_heads=15, block_size=16, query_len=1)
    slots = EvenHeads.reason_slots(None, bad)
    assert list(slots) == ["capability", "dtype", "availability", "dimensions", "block_size",
                           "query_len", "sparsity"]
    assert slots["availability"] == slots["dimensions"] == slots["query_len"] == []
    assert EvenHeads.validate_configuration(None, bad) == [
        "device capability not available", "dtype torch.float64 not supported",
        "15 heads: odd", "block size 16 not supported (supported: 64)"]
    good = attrs.evolve(bad, dtype=torch.float32, num_heads=16, block_size=64)
    assert EvenHeads.validate_configuration(DeviceCapability(9, 0), good) == []
    for cfg in (bad, good):
        flat = [r for reasons in _Recorder.reason_slots(None, cfg).values() for r in reasons]
        assert _Recorder.validate_configuration(None, cfg) == flat
