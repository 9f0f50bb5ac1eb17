"""The lightning indexer: ``TorchSparseIndexer`` against a float64 brute force over a paged key
cache, its one tie rule, its metadata and its input checks."""

from __future__ import annotations

import pytest
import torch

from app.backends.sparse import indexer as indexer_module
from app.backends.sparse.indexer import (
    SparseIndexerMetadata,
    TorchSparseIndexer,
    topk_positions,
)

HEADS, DIM, BS = 6, 16, 4


def _paged(seq_lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """Keys in order ``[sum, DIM]``, a shuffled paged cache holding them and the block table."""
    blocks = [-(-n // BS) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32)
    cache = torch.randn(num_blocks, BS, DIM, generator=gen)
    keys = []
    for b, n in enumerate(seq_lens):
        table[b, :blocks[b]] = torch.tensor(perm[:blocks[b]])
        perm = perm[blocks[b]:]
        pos = torch.arange(n)
        keys.append(cache[table[b, pos // BS].long(), pos % BS])
    return torch.cat(keys), cache, table


def _brute(q: torch.Tensor, w: torch.Tensor, keys: list[torch.Tensor], visible: list[int],
           request: list[int], topk: int) -> list[set[int]]:
    out = []
    for t, (b, v) in enumerate(zip(request, visible, strict=True)):
        k = keys[b][:v].double()
        score = (w[t].double().unsqueeze(1) * (q[t].double() @ k.t()).relu()).sum(0)
        order = sorted(range(v), key=lambda s: (-float(score[s]), s))
        out.append(set(order[:topk]))
    return out


@pytest.mark.parametrize("budget", [indexer_module.SCORE_BUDGET, 50])
def test_the_torch_indexer_is_the_brute_force(monkeypatch: pytest.MonkeyPatch,
                                              budget: int) -> None:
    monkeypatch.setattr(indexer_module, "SCORE_BUDGET", budget)   # 50: one row at a time
    gen = torch.Generator().manual_seed(0)
    seq_lens, new = [30, 7, 53], [5, 7, 1]                       # a prefill-like step
    _, cache, table = _paged(seq_lens, gen)
    visible = [n - m + j + 1 for n, m in zip(seq_lens, new, strict=True) for j in range(m)]
    request = [b for b, m in enumerate(new) for _ in range(m)]
    q = torch.randn(len(visible), HEADS, DIM, generator=gen)
    w = torch.randn(len(visible), HEADS, generator=gen)
    meta = SparseIndexerMetadata.build(table, new, visible)
    chosen = TorchSparseIndexer().select(q, w, cache, meta, 10)
    keys = [cache[table[b, torch.arange(n) // BS].long(), torch.arange(n) % BS]
            for b, n in enumerate(seq_lens)]
    want = _brute(q, w, keys, visible, request, 10)
    for t, row in enumerate(chosen.tolist()):
        picked = [p for p in row if p >= 0]
        assert picked == sorted(picked) and set(picked) == want[t]
        assert len(picked) == min(10, visible[t]) and row[len(picked):] == [-1] * (10 -
                                                                                  len(picked))
    slots = meta.to_slots(chosen, BS)
    for t, row in enumerate(chosen.tolist()):
        for j, p in enumerate(row):
            b = request[t]
            expect = -1 if p < 0 else int(table[b, p // BS]) * BS + p % BS
            assert int(slots[t, j]) == expect


def test_ties_go_to_the_earliest_positions_whatever_the_shape() -> None:
    scores = torch.tensor([[0.0, 0.0, 5.0, 0.0, 3.0, float("-inf")],
                           [1.0, 2.0, 3.0, float("-inf"), float("-inf"), float("-inf")]])
    assert topk_positions(scores, 3).tolist() == [[0, 2, 4], [0, 1, 2]]
    assert topk_positions(scores, 8).tolist() == [[0, 1, 2, 3, 4, -1, -1, -1],
                                                  [0, 1, 2, -1, -1, -1, -1, -1]]
    wide = torch.zeros(3, 1000)                              # torch.topk would pick anywhere
    wide[:, 500] = 1.0
    assert topk_positions(wide, 4).tolist() == [[0, 1, 2, 500]] * 3
    assert topk_positions(torch.zeros(0, 5), 3).shape == (0, 3)


def test_metadata_and_input_checks() -> None:
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="one per block-table row"):
        SparseIndexerMetadata.build(table, [1], [1])
    with pytest.raises(ValueError, match="visible counts >= 1"):
        SparseIndexerMetadata.build(table, [1, 1], [1, 0])
    with pytest.raises(ValueError, match="fit int32"):
        SparseIndexerMetadata.build(torch.tensor([[2**40]]), [1], [1])
    indexer, cache = TorchSparseIndexer(), torch.randn(3, BS, DIM)
    q, w = torch.randn(2, HEADS, DIM), torch.randn(2, HEADS)
    narrow = SparseIndexerMetadata.build(table[:, :1], [1, 1], [4, 5])
    with pytest.raises(ValueError, match="need 2 blocks of 4"):
        indexer.select(q, w, cache, narrow, 4)               # request 1 sees 5 tokens
    with pytest.raises(ValueError, match="outside"):
        indexer.select(q, w, cache, SparseIndexerMetadata.build(table, [1, 1], [8, 5]), 4)
    meta = SparseIndexerMetadata.build(table, [1, 1], [8, 4])
    with pytest.raises(ValueError, match="outside"):
        indexer.select(q, w, torch.randn(2, BS, DIM), meta, 4)   # block 2 of 2 blocks
    with pytest.raises(ValueError, match="weights must be float32"):
        indexer.select(q, w.double(), cache, meta, 4)
    with pytest.raises(ValueError, match="key_cache must be"):
        indexer.select(q, w, torch.randn(3, BS, DIM + 1), meta, 4)
    with pytest.raises(ValueError, match="q must be"):
        indexer.select(q[:1], w, cache, meta, 4)
    with pytest.raises(ValueError, match="topk"):
        indexer.select(q, w, cache, meta, 0)
    assert indexer.select(q, w, cache, meta, 4).shape == (2, 4)


@pytest.mark.parametrize("topk", [10**6, 2**31 - 1])
def test_a_top_k_past_every_context_is_only_as_wide_as_the_step_s_keys(topk: int) -> None:
    """Issue 44: a model's ``index_topk`` never sizes the selection; past every row's keys it
    is ``min(topk, the most keys a row sees)`` wide, every visible key then ``-1``."""
    gen = torch.Generator().manual_seed(3)
    seq_lens, new = [30, 7, 53], [5, 7, 1]
    _, cache, table = _paged(seq_lens, gen)
    visible = [n - m + j + 1 for n, m in zip(seq_lens, new, strict=True) for j in range(m)]
    q = torch.randn(len(visible), HEADS, DIM, generator=gen)
    w = torch.randn(len(visible), HEADS, generator=gen)
    meta = SparseIndexerMetadata.build(table, new, visible)
    chosen = TorchSparseIndexer().select(q, w, cache, meta, topk)
    assert chosen.shape == (len(visible), max(seq_lens))
    assert torch.equal(chosen, TorchSparseIndexer().select(q, w, cache, meta, max(seq_lens)))
    for t, row in enumerate(chosen.tolist()):
        assert row == list(range(visible[t])) + [-1] * (max(seq_lens) - visible[t])
    narrow = TorchSparseIndexer().select(q, w, cache, meta, 10)     # below: k stays k
    assert narrow.shape == (len(visible), 10)
