"""The chunked, paged, merged prefill step of a DeepSeek MLA layer equals the dense float64
reference."""

from __future__ import annotations

import pytest
import torch

from app.model import PrefillSlice, plan_context_chunks
from tests.model.conftest import TOL, Harness


def test_plan_context_chunks_packs_in_order_and_respects_the_bound() -> None:
    assert plan_context_chunks([0, 0], 8) == []
    assert plan_context_chunks([5, 3], 8) == [[(0, 5), (0, 3)]]
    # Exactly at the boundary: no empty trailing chunk.
    assert plan_context_chunks([8], 8) == [[(0, 8)]]
    assert plan_context_chunks([8, 8], 8) == [[(0, 8), (0, 0)], [(0, 0), (0, 8)]]
    assert plan_context_chunks([3, 0, 10], 4) == [
        [(0, 3), (0, 0), (0, 1)], [(0, 0), (0, 0), (1, 5)], [(0, 0), (0, 0), (5, 9)],
        [(0, 0), (0, 0), (9, 10)]]
    for lens, bound in (([7, 1, 30, 4], 5), ([64], 16), ([1] * 9, 2)):
        chunks = plan_context_chunks(lens, bound)
        assert all(sum(e - a for a, e in c) <= bound for c in chunks)
        assert len(chunks) == -(-sum(lens) // bound)
        for b, n in enumerate(lens):  # each request's spans tile [0, n)
            spans = [c[b] for c in chunks if c[b][1] > c[b][0]]
            assert [a for a, _ in spans] == [0] + [e for _, e in spans[:-1]]
            assert (spans[-1][1] if spans else 0) == n
    with pytest.raises(ValueError):
        plan_context_chunks([1], 0)


def _two_step(h: Harness, length: int, context: int) -> float:
    tokens = h.tokens(length)
    table = h.blocks(length)
    h.step([(tokens, table, 0, context)])
    (out,) = h.step([(tokens, table, context, length - context)])
    return h.error(out, tokens, context)


def test_empty_context(harness: Harness) -> None:
    seqs = [harness.tokens(n) for n in (9, 16, 3)]
    outs = harness.step([(t, harness.blocks(len(t)), 0, len(t)) for t in seqs])
    for t, out in zip(seqs, outs, strict=True):
        assert harness.error(out, t, 0) < TOL[torch.float32]


def test_one_context_chunk(harness: Harness) -> None:
    assert _two_step(harness, 40, 13) < TOL[torch.float32]


def test_many_context_chunks() -> None:
    h = Harness(chunk_tokens=5)
    assert _two_step(h, 41, 23) < TOL[torch.float32]  # 5 chunks, the last one partial


@pytest.mark.parametrize("chunk_tokens", [8, 4, 24])
def test_context_exactly_at_a_chunk_boundary(chunk_tokens: int) -> None:
    h = Harness(chunk_tokens=chunk_tokens)
    assert _two_step(h, 30, 24) < TOL[torch.float32]


def test_chunked_prefill_over_many_steps(harness: Harness) -> None:
    tokens = harness.tokens(50)
    table = harness.blocks(50)
    outs, done = [], 0
    for n in (7, 1, 16, 26):
        (out,) = harness.step([(tokens, table, done, n)])
        outs.append(out)
        done += n
    assert harness.error(torch.cat(outs), tokens, 0) < TOL[torch.float32]


def test_prefix_cache_hit_reads_another_requests_blocks(harness: Harness) -> None:
    """B's block table starts with A's full prefix blocks, as a prefix-cache hit gives it:
    B computes only its own tokens, over context that A wrote."""
    h = harness
    prefix = h.tokens(12)
    a = prefix + h.tokens(9)
    b = prefix + h.tokens(14)
    table_a = h.blocks(len(a))
    (out_a,) = h.step([(a, table_a, 0, len(a))])
    table_b = h.blocks(len(b), shared=table_a[:3].tolist())
    (out_b,) = h.step([(b, table_b, 12, len(b) - 12)])
    assert h.error(out_a, a, 0) < TOL[torch.float32]
    assert h.error(out_b, b, 12) < TOL[torch.float32]


def test_requests_of_length_one(harness: Harness) -> None:
    h = harness
    singles = [h.tokens(1) for _ in range(3)]
    outs = h.step([(t, h.blocks(1), 0, 1) for t in singles])
    for t, out in zip(singles, outs, strict=True):
        assert out.shape == (1, 64)
        assert h.error(out, t, 0) < TOL[torch.float32]
    assert _two_step(h, 13, 12) < TOL[torch.float32]  # one new token after 12 of context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mix_of_everything_in_one_batch(dtype: torch.dtype) -> None:
    """Empty context, many chunks, a chunk boundary, a prefix hit, length-1 requests and a
    one-token continuation, all in one step with a small chunk bound."""
    h = Harness(dtype=dtype, chunk_tokens=8)
    prefix = h.tokens(16)
    warm = prefix + h.tokens(5)
    table_warm = h.blocks(len(warm))
    long_ = h.tokens(60)
    table_long = h.blocks(60)
    edge = h.tokens(20)
    table_edge = h.blocks(20)
    cont = h.tokens(9)
    table_cont = h.blocks(9)
    # Earlier steps: A writes the shared prefix; the others their first chunks.
    h.step([(warm, table_warm, 0, len(warm)), (long_, table_long, 0, 37),
            (edge, table_edge, 0, 8), (cont, table_cont, 0, 8)])
    hit = prefix + h.tokens(11)
    table_hit = h.blocks(len(hit), shared=table_warm[:4].tolist())
    fresh = h.tokens(6)
    single = h.tokens(1)
    items = [(fresh, h.blocks(6), 0, 6),            # empty context
             (long_, table_long, 37, 23),           # 37 cached tokens: several chunks
             (edge, table_edge, 8, 12),             # context exactly one chunk
             (hit, table_hit, 16, 11),              # prefix-cache hit
             (single, h.blocks(1), 0, 1),           # length 1
             (cont, table_cont, 8, 1)]              # one new token over context
    outs = h.step(items)
    for (tokens, _, context, _), out in zip(items, outs, strict=True):
        assert h.error(out, tokens, context) < TOL[dtype], (len(tokens), context)


def test_inputs_are_checked(harness: Harness) -> None:
    h = harness
    tokens = h.tokens(4)
    table = h.blocks(4)
    x = h.lookup(tokens)
    with pytest.raises(ValueError, match="x must be"):
        h.executor.forward(x[:3], [PrefillSlice(table, 0, 4)])
    with pytest.raises(ValueError, match="new token"):
        h.executor.forward(x[:0], [PrefillSlice(table, 0, 0)])
    with pytest.raises(ValueError, match="blocks"):
        h.executor.forward(torch.cat([x, x]), [PrefillSlice(table, 0, 8)])
