"""Our decode behind vLLM's ``AttentionBackendEnum.CPU_MLA``, class by class (no engine).

On the same paged latent cache and decode metadata, our impl's ``forward_mqa`` agrees with
vLLM's own ``CPUMLAImpl`` (``mla_decode_kvcache``) at head 576 / block 16, in fp32 and bf16;
beyond vLLM's limits (kv_lora_rank 256 and 128, block size 32) it matches a float64 reference;
the builder maps a step's decode metadata onto our plan once, and every layer of the step reuses
it; wrong inputs are typed errors.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.integrations._require import require_vllm

require_vllm()

from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl  # noqa: E402

from app.integrations import _vllm_backends  # noqa: E402
from app.integrations.vllm_decode import (  # noqa: E402
    AppCPUMLABackend,
    AppCPUMLAImpl,
    AppCPUMLAMetadataBuilder,
    AppMLADecodeMetadata,
    AppMLAMetadata,
)
from app.testing import reference_decode  # noqa: E402

HEADS, ROPE, NOPE, V = 8, 64, 128, 128
SEQ_LENS = [1, 17, 300, 64, 129]


def _impl(cls: type[Any], kv_lora_rank: int = 512, scale: float = 0.07) -> Any:
    return cls(num_heads=HEADS, head_size=kv_lora_rank + ROPE, scale=scale, num_kv_heads=1,
               alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
               logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
               q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=NOPE,
               qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE, v_head_dim=V, kv_b_proj=None)


def _paged(seq_lens: list[int], block_size: int, head: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache with one spare block and a shuffled block table (int32, padded with 0)."""
    blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(blocks) + 1
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32)
    starts = [0, *itertools.accumulate(blocks)]
    for b, n in enumerate(blocks):
        table[b, :n] = perm[starts[b]:starts[b] + n]
    cache = torch.randn(total, block_size, head, generator=gen).to(dtype)
    return cache, table


def _step(seq_lens: list[int], table: torch.Tensor, head: int, tokens_per_request: int = 1
          ) -> AppMLAMetadata:
    """vLLM's metadata of a decode-only step, as ``MLACommonMetadataBuilder.build`` makes it."""
    batch = len(seq_lens)
    tokens = batch * tokens_per_request
    return AppMLAMetadata(
        num_reqs=batch, max_query_len=tokens_per_request, max_seq_len=max(seq_lens),
        num_actual_tokens=tokens,
        query_start_loc=torch.arange(0, tokens + 1, tokens_per_request, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), num_decodes=batch,
        num_decode_tokens=tokens, num_prefills=0, head_dim=head,
        decode=MLACommonDecodeMetadata(block_table=table,
                                       seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                       dcp_tot_seq_lens=None))


def _builder(kv_lora_rank: int, dtype: torch.dtype) -> AppCPUMLAMetadataBuilder:
    """Our builder without vLLM's engine around it: only its decode backend is set up, as its
    ``__init__`` does (the rest of ``__init__`` needs a model's layers)."""
    builder = AppCPUMLAMetadataBuilder.__new__(AppCPUMLAMetadataBuilder)
    builder.decode_backend = _vllm_backends.decode_backend_class()(
        num_heads=HEADS, scale=1.0, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=ROPE,
        kv_cache_dtype=dtype)
    return builder


def _build(monkeypatch: pytest.MonkeyPatch, builder: AppCPUMLAMetadataBuilder,
           step: AppMLAMetadata) -> AppMLAMetadata:
    """``builder.build`` with vLLM's own ``build`` answering ``step``."""
    monkeypatch.setattr(MLACommonMetadataBuilder, "build", lambda self, *a, **k: step)
    built: AppMLAMetadata = builder.build(0, None)
    return built


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_forward_mqa_agrees_with_vllms_cpu_decode_on_the_same_cache(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    cache, table = _paged(SEQ_LENS, 16, 576, dtype, gen)
    q = torch.randn(len(SEQ_LENS), HEADS, 576, generator=gen).to(dtype)
    step = _step(SEQ_LENS, table, 576)
    theirs, _ = _impl(CPUMLAImpl).forward_mqa(q, cache, step, None)
    built = _build(monkeypatch, _builder(512, dtype), step)
    assert isinstance(built.decode, AppMLADecodeMetadata)
    ours, lse = _impl(AppCPUMLAImpl).forward_mqa(q, cache, built, None)
    assert lse is None and ours.shape == theirs.shape == (len(SEQ_LENS), HEADS, 512)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)
    # vLLM hands the absorbed query as a (ql_nope, q_pe) pair too.
    pair = _impl(AppCPUMLAImpl).forward_mqa((q[..., :512], q[..., 512:]), cache, built, None)
    torch.testing.assert_close(pair[0], ours, atol=0, rtol=0)


@pytest.mark.parametrize(("kv_lora_rank", "block_size"), [(256, 16), (256, 32), (128, 7)])
def test_beyond_vllms_head_and_block_limits_it_matches_a_float64_reference(
        monkeypatch: pytest.MonkeyPatch, kv_lora_rank: int, block_size: int) -> None:
    head = kv_lora_rank + ROPE
    assert AppCPUMLABackend.supports_head_size(head)
    assert AppCPUMLABackend.supports_block_size(block_size)
    gen = torch.Generator().manual_seed(kv_lora_rank + block_size)
    cache, table = _paged(SEQ_LENS, block_size, head, torch.float32, gen)
    q = torch.randn(len(SEQ_LENS), HEADS, head, generator=gen)
    built = _build(monkeypatch, _builder(kv_lora_rank, torch.float32),
                   _step(SEQ_LENS, table, head))
    ours, _ = _impl(AppCPUMLAImpl, kv_lora_rank, scale=0.05).forward_mqa(q, cache, built, None)
    ref, _ = reference_decode(q.unsqueeze(1), cache, table, SEQ_LENS, kv_lora_rank, 0.05)
    torch.testing.assert_close(ours.double(), ref.squeeze(1), atol=1e-4, rtol=1e-4)


def test_the_step_is_planned_once_and_every_layer_reuses_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    builder = _builder(512, torch.float32)
    calls: list[int] = []
    prepare = builder.decode_backend.prepare_metadata

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        prepare(*args, **kwargs)

    monkeypatch.setattr(builder.decode_backend, "prepare_metadata", counting)
    layers = [_impl(AppCPUMLAImpl) for _ in range(4)]
    for seq_lens in ([5, 40], [6, 41, 1]):              # two steps
        caches = []
        for _ in layers:
            cache, table = _paged(seq_lens, 16, 576, torch.float32,
                                  torch.Generator().manual_seed(2))
            caches.append(cache)
        built = _build(monkeypatch, builder, _step(seq_lens, table, 576))
        q = torch.randn(len(seq_lens), HEADS, 576, generator=gen)
        for layer, cache in zip(layers, caches, strict=True):
            out, _ = layer.forward_mqa(q, cache, built, None)
            ref, _ = reference_decode(q.unsqueeze(1), cache, table, seq_lens, 512, 0.07)
            torch.testing.assert_close(out.double(), ref.squeeze(1), atol=1e-4, rtol=1e-4)
    assert len(calls) == 2                               # once per step, not per layer


def test_multi_token_decode_steps_are_mapped_as_uniform_query_lengths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    seq_lens = [9, 33]
    cache, table = _paged(seq_lens, 16, 576, torch.float32, gen)
    built = _build(monkeypatch, _builder(512, torch.float32), _step(seq_lens, table, 576, 3))
    q = torch.randn(6, HEADS, 576, generator=gen)
    out, _ = _impl(AppCPUMLAImpl).forward_mqa(q, cache, built, None)
    ref, _ = reference_decode(q.view(2, 3, HEADS, 576), cache, table, seq_lens, 512, 0.07)
    torch.testing.assert_close(out.double(), ref.reshape(6, HEADS, 512), atol=1e-4, rtol=1e-4)
    step = _step(seq_lens, table, 576, 3)
    step.num_decode_tokens = 5
    with pytest.raises(ValueError, match="uniform query length per request, got 5 decode "
                                         "tokens for 2 requests"):
        _build(monkeypatch, _builder(512, torch.float32), step)


def test_what_the_backend_declares() -> None:
    assert issubclass(AppCPUMLABackend, CPUMLABackend)
    assert AppCPUMLABackend.get_name() == "CPU_MLA"
    assert AppCPUMLABackend.get_impl_cls() is AppCPUMLAImpl
    assert AppCPUMLABackend.get_builder_cls() is AppCPUMLAMetadataBuilder
    assert CPUMLABackend.get_supported_head_sizes() == [576]
    for head in (576, 320, 192, 96):
        assert AppCPUMLABackend.supports_head_size(head)
    for head in (575, 32, 0):
        assert not AppCPUMLABackend.supports_head_size(head)
    assert not CPUMLABackend.supports_block_size(32)
    for size in (None, 1, 16, 32, 48):
        assert AppCPUMLABackend.supports_block_size(size)
    assert not AppCPUMLABackend.supports_block_size(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert AppCPUMLABackend.supports_dtype(dtype)
    # vLLM's own metadata refuses head 192 (its list is 320/512/576); ours takes it.
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="Head dimension 192 is not supported"):
        MLACommonMetadata(**{**vars(_step([1], table, 576)), "head_dim": 192})
    assert _step([1], table, 192).head_dim == 192
    with pytest.raises(ValueError, match=r"head size 100 .* not supported by our CPU MLA"):
        _step([1], table, 100)


def test_wrong_inputs_are_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="does not support kv_lora_rank 100"):
        _impl(AppCPUMLAImpl, kv_lora_rank=100)
    gen = torch.Generator().manual_seed(4)
    cache, table = _paged([4], 16, 576, torch.float32, gen)
    q = torch.randn(1, HEADS, 576, generator=gen)
    plain = SimpleNamespace(decode=MLACommonDecodeMetadata(
        block_table=table, seq_lens=torch.tensor([4], dtype=torch.int32),
        dcp_tot_seq_lens=None))
    with pytest.raises(TypeError, match="expected the decode metadata of "
                                        "AppCPUMLAMetadataBuilder"):
        _impl(AppCPUMLAImpl).forward_mqa(q, cache, plain, None)
    built = _build(monkeypatch, _builder(512, torch.float32), _step([4], table, 576))
    with pytest.raises(ValueError, match="q must be"):
        _impl(AppCPUMLAImpl).forward_mqa(q[..., :512], cache, built, None)
    with pytest.raises(ValueError, match="kv_cache"):
        _impl(AppCPUMLAImpl).forward_mqa(q, cache.to(torch.bfloat16), built, None)


def test_bf16_error_is_vllms_on_the_float32_path_and_bounded_on_bf16_dot_products(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 cache and q against float64: vLLM's kernel computes in float32 and rounds the
    output; ours does the same with ``APP_CPU_DECODE_BF16_DOT=0`` (the same error, to the
    rounding order); by default on AVX512-BF16 it takes bf16 dot products and rounds the
    probabilities to bf16 before p.v (as GPU kernels do): a little more error, ~3x faster."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = [1, 17, 300, 64, 129, 2000]
    cache, table = _paged(seq_lens, 16, 576, torch.bfloat16, gen)
    q = torch.randn(len(seq_lens), HEADS, 576, generator=gen).to(torch.bfloat16)
    step = _step(seq_lens, table, 576)
    ref, _ = reference_decode(q.unsqueeze(1), cache, table, seq_lens, 512, 0.07)

    def error(out: torch.Tensor) -> float:
        return float((out.double() - ref.squeeze(1)).abs().mean())

    theirs = error(_impl(CPUMLAImpl).forward_mqa(q, cache, step, None)[0])
    built = _build(monkeypatch, _builder(512, torch.bfloat16), step)
    fast = error(_impl(AppCPUMLAImpl).forward_mqa(q, cache, built, None)[0])
    monkeypatch.setenv("APP_CPU_DECODE_BF16_DOT", "0")  # read by a decode backend made now
    exact_built = _build(monkeypatch, _builder(512, torch.bfloat16), step)
    exact = error(_impl(AppCPUMLAImpl).forward_mqa(q, cache, exact_built, None)[0])
    assert exact == pytest.approx(theirs, rel=1e-3)
    assert fast < 2 * theirs


def test_an_engine_binds_its_own_container_once() -> None:
    from dependency_injector import providers

    from app.backends.decode.cpu_mla import CpuMLADecodeBackend
    from app.containers import create_container
    from app.integrations import bind_vllm_container

    class Mine(CpuMLADecodeBackend):
        pass

    container = create_container()
    container.mla_decode_backends.CPU_MLA.override(providers.Object(Mine))
    try:
        bind_vllm_container(container)
        assert _vllm_backends.decode_backend_class() is Mine
        assert type(_builder(512, torch.float32).decode_backend) is Mine
        with pytest.raises(TypeError, match=r"expected an app\.containers\.Application, got str"):
            bind_vllm_container("default")  # type: ignore[arg-type]
        assert _vllm_backends.decode_backend_class() is Mine        # nothing half-applied
    finally:
        bind_vllm_container(create_container())
    assert _vllm_backends.decode_backend_class() is CpuMLADecodeBackend
