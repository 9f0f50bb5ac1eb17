"""The decode contract's public forms: ``MLADecodeMetadata``, ``forward_decode`` (the old verb),
the step hook and the dimension declarations, old names and new."""

from __future__ import annotations

import pytest
import torch

from app._types import MLADimensions
from app.backends import MLADecodeBackend, MLADecodeMetadata
from app.backends.decode.base import DecodeMetadata
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend

RANK, ROPE, HEADS, BS = 64, 32, 3, 4


def _backend(cls: type[MLADecodeBackend] = TorchSDPADecodeBackend, **kw: object
             ) -> MLADecodeBackend:
    args: dict[str, object] = {"num_heads": HEADS, "scale": 0.1, "kv_lora_rank": RANK,
                               "qk_rope_head_dim": ROPE, "kv_cache_dtype": torch.float32}
    args.update(kw)
    return cls(**args)  # type: ignore[arg-type]


def _layout(seq_lens: list[int], query_len: int = 2
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    width = max(-(-n // BS) for n in seq_lens)
    table = torch.randperm(len(seq_lens) * width, generator=gen).to(torch.int32).view(-1, width)
    cache = torch.randn(len(seq_lens) * width, BS, RANK + ROPE, generator=gen)
    q = torch.randn(len(seq_lens), query_len, HEADS, RANK + ROPE, generator=gen)
    return table, torch.tensor(seq_lens, dtype=torch.int32), q, cache


def test_prepare_metadata_takes_the_public_metadata_or_the_three_tensors() -> None:
    table, lens, q, cache = _layout([9, 20, 2])
    by_tensors, by_name, by_metadata = _backend(), _backend(), _backend()
    by_tensors.prepare_metadata(table, lens, 2)
    by_name.prepare_metadata(block_table=table, seq_lens=lens, query_len=2)
    metadata = MLADecodeMetadata.build(table, lens, 2)
    by_metadata.prepare_metadata(metadata)
    assert by_metadata.metadata is metadata and DecodeMetadata is MLADecodeMetadata
    results = [b.run_decode(q, cache, return_softmax_lse=True)
               for b in (by_tensors, by_name, by_metadata)]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_the_metadata_is_checked_against_the_backend() -> None:
    table, lens, _, _ = _layout([9, 20, 2])

    class TwoRowsAtMost(TorchSDPADecodeBackend):
        max_query_len = 1

    with pytest.raises(ValueError, match=r"prepare_metadata: query_len must be an int in "
                                         r"\[1, 1\], got 2"):
        _backend(TwoRowsAtMost).prepare_metadata(MLADecodeMetadata.build(table, lens, 2))
    be = _backend()
    with pytest.raises(TypeError, match="pass an MLADecodeMetadata alone"):
        be.prepare_metadata(MLADecodeMetadata.build(table, lens, 2), lens)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_table given twice"):
        be.prepare_metadata(table, lens, 2, block_table=table)
    made = MLADecodeMetadata.build(table, lens, 2)
    forged = MLADecodeMetadata(block_table=made.block_table, seq_lens=made.seq_lens,
                               block_table_cpu=made.block_table_cpu,
                               seq_lens_cpu=made.seq_lens_cpu, query_len=2,
                               seq_lens_list=(9, 20, 200), max_seq_len=200)
    with pytest.raises(ValueError, match=r"make it with MLADecodeMetadata\.build"):
        be.prepare_metadata(forged)
    with pytest.raises(ValueError, match=r"MLADecodeMetadata\.build: seq_lens\[2\] = 2 is less "
                                         r"than query_len 3"):
        MLADecodeMetadata.build(table, lens, 3)


def test_forward_decode_is_run_decode_with_the_old_lse_layout() -> None:
    """``forward_decode(q, kv_cache, out=None, return_lse=False)``, as the README documented it
    and TokenSpeed's backend names it: the LSE is token-major, ``[B, query_len, H]``."""
    table, lens, q, cache = _layout([9, 20, 2])
    be = _backend()
    be.prepare_metadata(table, lens, 2)
    out, lse = be.run_decode(q, cache, return_softmax_lse=True)
    old_out, old_lse = be.forward_decode(q, cache, return_lse=True)
    assert old_lse.shape == (3, 2, HEADS) and old_lse.is_contiguous()
    assert torch.equal(old_out, out) and torch.equal(old_lse, lse.permute(1, 2, 0))
    assert torch.equal(be.forward_decode(q, cache), out)            # no LSE: a tensor
    buf = torch.full_like(out, float("nan"))
    got = be.forward_decode(q, cache, buf, True)                     # out= positionally
    assert got[0] is buf and torch.equal(buf, out)
    got2 = be.forward_decode(q, cache, out=buf, k_scale=2.0, softmax_scale=0.05)
    assert got2 is buf and torch.equal(buf, be.run_decode(q, cache, k_scale=2.0,
                                                          softmax_scale=0.05))
    with pytest.raises(TypeError, match="forward_decode: return_lse must be a bool"):
        be.forward_decode(q, cache, return_lse="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"forward_decode: q must be \[B, query_len, H"):
        be.forward_decode(q[:, :1], cache)


def test_the_step_hook_is_prepare_step_and_the_old_name_still_runs() -> None:
    seen: list[str] = []

    class NewHook(TorchSDPADecodeBackend):
        def _prepare_step(self, metadata: MLADecodeMetadata) -> None:
            seen.append(f"new {metadata.batch}")

    with pytest.warns(DeprecationWarning, match=r"_plan: the step hook is named _prepare_step"):
        class OldHook(TorchSDPADecodeBackend):
            def _plan(self, metadata: MLADecodeMetadata) -> None:
                seen.append(f"old {metadata.batch}")

    table, lens, q, cache = _layout([9, 20, 2])
    for cls in (NewHook, OldHook):
        _backend(cls).prepare_metadata(table, lens, 2)
    assert seen == ["new 3", "old 3"]

    class FailingPlan(TorchSDPADecodeBackend):
        def _prepare_step(self, metadata: MLADecodeMetadata) -> None:
            raise RuntimeError("no plan")

    be = _backend(FailingPlan)
    with pytest.raises(RuntimeError, match="no plan"):
        be.prepare_metadata(table, lens, 2)
    with pytest.raises(ValueError, match="call prepare_metadata"):   # no half-made step
        be.run_decode(q, cache)


def test_dimensions_are_declared_as_prefill_declares_them() -> None:
    class New(TorchSDPADecodeBackend):
        supported_mla_dimensions = (MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64),)

    with pytest.warns(DeprecationWarning, match="supported_head_dims: declare "
                                                "supported_mla_dimensions"):
        class Old(TorchSDPADecodeBackend):
            supported_head_dims = ((512, 64),)

    for cls in (New, Old):
        assert cls.supported_mla_dimensions == (
            MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64),)
        assert cls.supported_head_dims == ((512, 64),)            # kept in step, both ways
        assert cls.supports_mla_dimensions(MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64))
        assert not cls.supports_mla_dimensions(MLADimensions(kv_lora_rank=256,
                                                             qk_rope_head_dim=64))
        assert cls.declaration_problems() == []
    assert TorchSDPAPrefillBackend.supported_mla_dimensions == ()  # the same attribute, prefill


@pytest.mark.parametrize("scale", [float("inf"), 0.0, "0.1", True, 1e300, 3e38])
def test_both_kinds_refuse_a_scale_with_the_same_words(scale: object) -> None:
    with pytest.raises(ValueError) as decode:
        _backend(scale=scale)
    with pytest.raises(ValueError) as prefill:
        TorchSDPAPrefillBackend(num_heads=2, scale=scale, kv_lora_rank=16,  # type: ignore[arg-type]
                                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert str(decode.value).removeprefix("TorchSDPADecodeBackend") == \
        str(prefill.value).removeprefix("TorchSDPAPrefillBackend")
    assert "scale must be a positive, finite float in [1.175e-38, 2.359e+38]" in \
        str(decode.value)
