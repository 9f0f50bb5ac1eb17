"""Our vLLM backend against vLLM's own ``CPUSDPAMLAPrefillBackend``, on vLLM's metadata.

Same inputs, same ``MLACommonPrefillMetadata`` (context chunks planned by vLLM's own
``build_mla_chunked_context_metadata``), both driven exactly as vLLM's ``MLAAttention`` drives a
prefill backend: outputs and LSE agree within the dtype's tolerance, on ragged batches and on
every context chunk, in bf16 and fp32; vLLM's whole chunked-prefill flow (its partial folding
and merge) gives the same result with either, and matches a float64 reference; ``clone()`` and
``out=`` behave as vLLM expects.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integrations._require import require_vllm

require_vllm()

from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402
    accumulate_mla_context_chunk,
    init_mla_context_partial,
)
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (  # noqa: E402
    CPUSDPAMLAPrefillBackend,
)
from vllm.v1.attention.ops.merge_attn_states import merge_attn_states  # noqa: E402

from app.backends.prefill.torch_sdpa import TorchSDPABackend  # noqa: E402
from app.containers import create_container  # noqa: E402
from app.integrations.vllm import AppCPUMLAPrefillBackend  # noqa: E402
from app.testing import reference_attention  # noqa: E402
from tests.integrations._vllm_inputs import (  # noqa: E402
    HEADS,
    NOPE,
    SCALE,
    TOLERANCE,
    V,
    backend_kwargs,
    mla_qkv,
    prefill_metadata,
)

DTYPES = [torch.bfloat16, torch.float32]
RAGGED = [37, 1, 90, 64, 20]
CONTEXTS = [0, 50, 300, 17, 0]   # vLLM plans 3 chunks: two requests, a continuation, both


def _pair() -> tuple[AppCPUMLAPrefillBackend, CPUSDPAMLAPrefillBackend]:
    return AppCPUMLAPrefillBackend(**backend_kwargs()), CPUSDPAMLAPrefillBackend(**backend_kwargs())


def _assert_agree(ours: Any, theirs: Any, dtype: torch.dtype) -> None:
    atol, rtol, lse_atol = TOLERANCE[dtype]
    (out, lse), (ref, ref_lse) = ours, theirs
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    torch.testing.assert_close(lse, ref_lse.float(), atol=lse_atol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens", [RAGGED, [256], [1, 1, 1]])
def test_new_tokens_agree_with_vllm_cpu_backend(dtype: torch.dtype, query_lens: list[int]
                                                ) -> None:
    gen = torch.Generator().manual_seed(sum(query_lens))
    q, k, v = mla_qkv(sum(query_lens), dtype, gen)
    assert q is not None
    md = prefill_metadata(query_lens)
    ours, theirs = _pair()
    ours.prepare_metadata(md)
    theirs.prepare_metadata(md)
    _assert_agree(ours.run_prefill_new_tokens(q, k, v, True),
                  theirs.run_prefill_new_tokens(q, k, v, True), dtype)
    out = ours.run_prefill_new_tokens(q, k, v, False)
    ref = theirs.run_prefill_new_tokens(q, k, v, False)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, ref, atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("host_query_lens", [True, False])
def test_context_chunks_agree_with_vllm_cpu_backend(dtype: torch.dtype,
                                                    host_query_lens: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    q, _, _ = mla_qkv(sum(RAGGED), dtype, gen)
    assert q is not None
    md = prefill_metadata(RAGGED, CONTEXTS, host_query_lens=host_query_lens)
    assert md.chunked_context is not None
    chunks = md.chunked_context.chunks
    assert len(chunks) == 3 and any(c.is_continuation for c in chunks)
    assert any(c.num_requests > 1 for c in chunks)
    ours, theirs = _pair()
    ours.prepare_metadata(md)
    theirs.prepare_metadata(md)
    for chunk in chunks:   # as vLLM's _compute_prefill_context calls them
        _, k, v = mla_qkv(chunk.num_context_tokens, dtype, gen, with_q=False)
        q_chunk = q[chunk.token_slice]
        _assert_agree(ours.run_prefill_context_chunk(chunk=chunk, q=q_chunk, k=k, v=v),
                      theirs.run_prefill_context_chunk(chunk=chunk, q=q_chunk, k=k, v=v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_is_written_in_place_and_returned(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = mla_qkv(sum(RAGGED), dtype, gen)
    assert q is not None
    md = prefill_metadata(RAGGED, CONTEXTS)
    ours, theirs = _pair()
    assert ours.supports_out()
    ours.prepare_metadata(md)
    theirs.prepare_metadata(md)
    ref, ref_lse = theirs.run_prefill_new_tokens(q, k, v, True)
    # vLLM's forward_mha hands a view of its [T, H * V] output buffer.
    buffer = torch.full((q.shape[0], HEADS * V), float("nan"), dtype=dtype)
    out = buffer.view(-1, HEADS, V)
    got = ours.run_prefill_new_tokens(q=q, k=k, v=v, return_softmax_lse=False, out=out)
    assert got is out
    torch.testing.assert_close(out, ref, atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])
    out.fill_(float("nan"))
    got_out, got_lse = ours.run_prefill_new_tokens(q, k, v, True, out=out)
    assert got_out is out
    _assert_agree((out, got_lse), (ref, ref_lse), dtype)
    assert md.chunked_context is not None
    chunk = md.chunked_context.chunks[2]
    _, kc, vc = mla_qkv(chunk.num_context_tokens, dtype, gen, with_q=False)
    partial = torch.full((chunk.token_slice.stop - chunk.token_slice.start, HEADS, V),
                         float("nan"), dtype=dtype)
    got_out, got_lse = ours.run_prefill_context_chunk(chunk, q[chunk.token_slice], kc, vc,
                                                      out=partial)
    assert got_out is partial
    _assert_agree((partial, got_lse),
                  theirs.run_prefill_context_chunk(chunk, q[chunk.token_slice], kc, vc), dtype)


def test_out_of_the_wrong_shape_is_a_value_error() -> None:
    q, k, v = mla_qkv(8, torch.float32, torch.Generator().manual_seed(0))
    ours = AppCPUMLAPrefillBackend(**backend_kwargs())
    ours.prepare_metadata(prefill_metadata([8]))
    with pytest.raises(ValueError, match=r"out shape: expected \[8, 8, 128\]"):
        ours.run_prefill_new_tokens(q, k, v, False, out=torch.empty(8, HEADS, V + 64))


def test_clone_is_an_independent_backend_of_the_same_shape() -> None:
    dtype = torch.float32
    gen = torch.Generator().manual_seed(11)
    ours = AppCPUMLAPrefillBackend(**backend_kwargs())
    twin = ours.clone()
    assert type(twin) is AppCPUMLAPrefillBackend and twin is not ours
    for name, value in backend_kwargs().items():
        assert getattr(twin, name) == value
    # vLLM clones one backend per metadata builder (micro-batches): each keeps its own step.
    md_a, md_b = prefill_metadata([40, 24], [33, 0]), prefill_metadata([5, 70, 9])
    ours.prepare_metadata(md_a)
    with pytest.raises(ValueError, match="prepare_metadata"):
        twin.run_prefill_new_tokens(*mla_qkv(64, dtype, gen), True)
    twin.prepare_metadata(md_b)
    theirs = CPUSDPAMLAPrefillBackend(**backend_kwargs())
    for backend, md, tokens in ((ours, md_a, 64), (twin, md_b, 84), (ours, md_a, 64)):
        q, k, v = mla_qkv(tokens, dtype, gen)
        theirs.prepare_metadata(md)
        _assert_agree(backend.run_prefill_new_tokens(q, k, v, True),
                      theirs.run_prefill_new_tokens(q, k, v, True), dtype)


def test_a_chunk_from_another_step_is_a_value_error() -> None:
    ours = AppCPUMLAPrefillBackend(**backend_kwargs())
    ours.prepare_metadata(prefill_metadata(RAGGED, CONTEXTS))
    stale = prefill_metadata(RAGGED, CONTEXTS).chunked_context
    assert stale is not None
    q, k, v = mla_qkv(50, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="context chunk 0 is not one of the 3 chunk"):
        ours.run_prefill_context_chunk(stale.chunks[0], q[:1], k, v)


def test_fused_quantized_output_is_a_value_error() -> None:
    q, k, v = mla_qkv(4, torch.float32, torch.Generator().manual_seed(0))
    ours = AppCPUMLAPrefillBackend(**backend_kwargs())
    ours.prepare_metadata(prefill_metadata([4]))
    with pytest.raises(ValueError, match="output_scale"):
        ours.run_prefill_new_tokens(q, k, v, False, output_scale=torch.ones(1))


def test_runs_the_torch_sdpa_class_our_container_provides() -> None:
    class CountingSDPA(TorchSDPABackend):
        calls = 0

        def run_prefill_new_tokens(self, *args: Any, **kwargs: Any) -> Any:
            CountingSDPA.calls += 1
            return super().run_prefill_new_tokens(*args, **kwargs)

    from dependency_injector import providers

    container = create_container()
    container.mla_prefill_backends.TORCH_SDPA.override(providers.Object(CountingSDPA))
    try:
        assert AppCPUMLAPrefillBackend.bind_container(container) is CountingSDPA
        ours = AppCPUMLAPrefillBackend(**backend_kwargs())
        clone = ours.clone()
    finally:
        AppCPUMLAPrefillBackend.bind_container(create_container())
    assert AppCPUMLAPrefillBackend.backend_class() is TorchSDPABackend
    q, k, v = mla_qkv(16, torch.float32, torch.Generator().manual_seed(0))
    for backend in (ours, clone):   # resolved at construction: the rebinding above is unseen
        backend.prepare_metadata(prefill_metadata([16]))
        backend.run_prefill_new_tokens(q, k, v, False)
    assert CountingSDPA.calls == 2
    with pytest.raises(TypeError, match=r"expected an app\.containers\.Application, got str"):
        AppCPUMLAPrefillBackend.bind_container("default")  # type: ignore[arg-type]
    assert AppCPUMLAPrefillBackend.backend_class() is TorchSDPABackend


def _vllm_chunked_prefill(backend: Any, md: Any, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, ctx_k: list[torch.Tensor],
                          ctx_kv_nope: list[torch.Tensor]) -> torch.Tensor:
    """vLLM's own chunked prefill around a backend: ``forward_mha`` (new tokens with LSE,
    then the merge) and ``_compute_prefill_context`` (each chunk's cached tokens gathered from
    ``chunk.starts``/``chunk.seq_lens``, the partials folded by vLLM's helpers)."""
    backend.prepare_metadata(md)
    suffix_out, suffix_lse = backend.run_prefill_new_tokens(q=q, k=k, v=v,
                                                            return_softmax_lse=True)
    chunked = md.chunked_context
    output = output_lse = None
    for chunk in chunked.chunks:
        rows = zip(range(chunk.request_slice.start, chunk.request_slice.stop),
                   chunk.starts.tolist(), chunk.seq_lens.tolist(), strict=True)
        picked = [(ctx_k[r][s:s + n], ctx_kv_nope[r][s:s + n]) for r, s, n in rows]
        kc = torch.cat([p[0] for p in picked])
        vc = torch.cat([p[1] for p in picked])[..., NOPE:]   # a split view, as vLLM's
        attn_out, attn_lse = backend.run_prefill_context_chunk(chunk=chunk,
                                                               q=q[chunk.token_slice], k=kc, v=vc)
        if output is None:
            if len(chunked.chunks) == 1 and not chunked.empty_token_slices:
                output, output_lse = attn_out, attn_lse
                break
            output, output_lse = init_mla_context_partial(chunked, attn_out, attn_lse,
                                                          num_tokens=q.shape[0])
        accumulate_mla_context_chunk(chunk, attn_out, attn_lse, output, output_lse)
    final = torch.empty(q.shape[0], HEADS, V, dtype=q.dtype)
    merge_attn_states(output=final, prefix_output=output, prefix_lse=output_lse,
                      suffix_output=suffix_out, suffix_lse=suffix_lse)
    return final


@pytest.mark.parametrize("dtype", DTYPES)
def test_vllms_chunked_prefill_flow_matches_vllm_and_a_float64_reference(dtype: torch.dtype
                                                                         ) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = mla_qkv(sum(RAGGED), dtype, gen)
    assert q is not None
    ctx = [mla_qkv(n, dtype, gen, with_q=False) for n in CONTEXTS]
    ctx_k = [c[1] for c in ctx]
    ctx_kv_nope = [torch.cat([c[1][..., :NOPE], c[2]], dim=-1) for c in ctx]
    md = prefill_metadata(RAGGED, CONTEXTS)
    ours = _vllm_chunked_prefill(AppCPUMLAPrefillBackend(**backend_kwargs()), md, q, k, v,
                                 ctx_k, ctx_kv_nope)
    theirs = _vllm_chunked_prefill(CPUSDPAMLAPrefillBackend(**backend_kwargs()), md, q, k, v,
                                   ctx_k, ctx_kv_nope)
    atol, rtol, _ = TOLERANCE[dtype]
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol)
    # Each request: its whole context, then its new tokens causally (bottom-right).
    keys, values, cu_q, cu_kv = [], [], [0], [0]
    starts = [0]
    for n in RAGGED:
        starts.append(starts[-1] + n)
    for b, n in enumerate(CONTEXTS):
        keys += [ctx_k[b], k[starts[b]:starts[b + 1]]]
        values += [ctx[b][2], v[starts[b]:starts[b + 1]]]
        cu_q.append(starts[b + 1])
        cu_kv.append(cu_kv[-1] + n + RAGGED[b])
    ref, _ = reference_attention(q, torch.cat(keys), torch.cat(values), cu_q, cu_kv,
                                 causal=True, scale=SCALE)
    torch.testing.assert_close(ours.double(), ref, atol=atol, rtol=rtol)
