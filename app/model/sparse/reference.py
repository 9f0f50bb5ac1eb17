"""The lightning indexer in the dense reference (``app.model.ReferenceModel``), float64 by default.

For every layer with an indexer, ``SparseReference`` keeps the index key of every position of
the sequence the reference is on (reused along the common prefix of the next one, as the
reference reuses its keys and values), and each position's selection: its ``index_topk`` best
visible positions (``-1`` padding where fewer are visible), and how close that selection is to a
tie (``selection margin``: the ``topk``-th best score minus the next one, over the largest score
magnitude of the row; inf where every visible key is selected). A ``shared`` layer (GLM-5)
takes the selection of the layer before it. Where a row's margin is within an engine's rounding
(``SELECTION_TOLERANCES``), the engine may select another key and still be right: the checks
count such rows apart, as they count routing near-ties.

Given an engine's own selection (``forced``: the positions each row attended to), the reference
attends to those instead of its own, so that the attention is compared without the selection's
rounding, and compares the two selections apart (``compare_selection``): per row, the keys the
two share, and the *violation* of the engine's selection in the reference's scores (the best
score it left out minus the worst it kept, over the row's largest score magnitude; 0 or below
for a selection the reference's scores allow, ties included; inf for a position that is not
visible or a wrong count). A row without one (the engine did not compute it, e.g. a
prefix-cache hit) takes the reference's own selection and is not compared. Selections are as
wide as a row can use (``min(index_topk, the row's visible keys)``, -1 padding), never
``index_topk`` wide as such; the engine's come as bitmasks (``app.model.sparse.selections``).

``ReferenceModel(weights, dtype=bf16)`` computes the indexer as transformers does in that dtype:
queries and keys in the dtype, scores in float32 (``weights_proj`` in float32 too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.backends.sparse.indexer import topk_positions
from app.model.config import DeepseekConfig
from app.model.rope import apply_rope, rope_inv_freq
from app.model.sparse.layer import INDEXER_NORM_EPS
from app.model.sparse.selections import checked_selections, pack_positions, unpack_positions
from app.model.sparse.weights import IndexerWeights

__all__ = ["SELECTION_TOLERANCES", "SparseReference", "accumulate_comparisons",
           "checked_selections", "compare_selection", "selection_mask"]

#: Relative selection margins (gap / the row's largest score magnitude) within which the rounding
#: of an engine of the dtype may select either way. Measured on a random V3.2-shaped model
#: (hidden 1024, 64 index heads of 128, topk 64, 400 tokens; ``ReferenceModel`` in the dtype
#: against float64) in the first layer, whose input is exact in both (the indexer's own
#: rounding): float32 flipped no row, float16 rows with margins up to 3.3e-4, bfloat16 up to
#: 7.5e-3 (91 of 336 rows with more candidates than k). Deeper layers flip at larger margins
#: (bf16 up to 2.8e-2 in the second layer: their inputs carry the rounding of the layers below);
#: those rows are compared, and the tolerance the check derives from the plain dense model in
#: the dtype, which flips alike, covers them. A random model's index scores are close
#: together: in 16 bits, most of its rows are near-ties (counted, and said).
SELECTION_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
#: Most float64 scores held at once (``[rows, heads, positions]``): 128 MiB.
_SCORE_BUDGET = 1 << 24


def selection_mask(selected: torch.Tensor, end: int) -> torch.Tensor:
    """``[rows, end]`` bool: True at the positions ``selected [rows, topk]`` names (-1:
    none)."""
    rows = selected.shape[0]
    keep = torch.zeros(rows, end + 1, dtype=torch.bool)
    keep.scatter_(1, torch.where(selected >= 0, selected, end), True)
    return keep[:, :end]


def compare_selection(total: torch.Tensor, chosen: torch.Tensor, own: torch.Tensor
                      ) -> torch.Tensor:
    """``chosen [rows, topk]`` (an engine's positions, -1 padding) against ``own`` (the
    reference's top-k of the float64 scores ``total [rows, n]``, ``-inf`` where not visible):
    ``[rows, 3]`` float64 of the keys both select, the keys the reference selects, and the
    violation of ``chosen`` (see the module; inf for an invisible position or a count other
    than the reference's)."""
    end = total.shape[1]
    visible = torch.isfinite(total)
    beyond = (chosen >= end).any(dim=1)         # past every visible key: never right
    chosen = torch.where(chosen >= end, -1, chosen)
    mine, theirs = selection_mask(chosen, end), selection_mask(own, end)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    worst_kept = torch.where(mine, total, inf).amin(dim=1)
    best_left = torch.where(visible & ~mine, total, -inf).amax(dim=1)
    scale = torch.where(visible, total, 0.0).abs().amax(dim=1).clamp(min=1e-300)
    violation = ((best_left - worst_kept) / scale).clamp(min=0.0).nan_to_num(nan=0.0)
    wrong = beyond | (mine.sum(dim=1) != theirs.sum(dim=1)) | (mine & ~visible).any(dim=1)
    violation = torch.where(wrong, inf, violation)
    return torch.stack([(mine & theirs).sum(dim=1).double(), theirs.sum(dim=1).double(),
                        violation], dim=1)


def accumulate_comparisons(so_far: torch.Tensor, compared: torch.Tensor) -> torch.Tensor:
    """``compare_selection`` results ``[n, 3]`` of two layers in one: keys summed, the larger
    violation."""
    return torch.cat([so_far[:, :2] + compared[:, :2],
                      torch.maximum(so_far[:, 2:], compared[:, 2:])], dim=1)


def _grown(buffer: torch.Tensor | None, n: int, keep: int, tail: tuple[int, ...],
           dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
    """``buffer`` with room for ``n`` positions (its first ``keep`` kept)."""
    if buffer is not None and buffer.shape[0] >= n:
        return buffer
    grown = torch.full((max(n, 2 * (0 if buffer is None else buffer.shape[0])), *tail), fill,
                       dtype=dtype)
    if buffer is not None and keep:
        grown[:keep] = buffer[:keep]
    return grown


def _stored(buffer: torch.Tensor | None, sel: torch.Tensor, common: int, n: int
            ) -> torch.Tensor:
    """``buffer`` (positions ``[N, width]``, -1 padding) holding ``sel`` at positions
    ``common..n``, widened (with -1) when ``sel`` is wider (a longer sequence sees more keys)."""
    width = int(sel.shape[1]) if buffer is None else max(int(sel.shape[1]),
                                                          int(buffer.shape[1]))
    if buffer is not None and buffer.shape[1] < width:
        buffer = torch.nn.functional.pad(buffer, (0, width - int(buffer.shape[1])), value=-1)
    stored = _grown(buffer, n, common, (width,), torch.int64, -1)
    stored[common:n] = -1
    stored[common:n, :sel.shape[1]] = sel
    return stored


def _fitted(sel: torch.Tensor, width: int) -> torch.Tensor:
    """``sel [rows, w]`` (positions, -1 padding) ``width`` wide: padded with -1, or cut."""
    have = int(sel.shape[1])
    if have >= width:
        return sel[:, :width]
    return torch.nn.functional.pad(sel, (0, width - have), value=-1)


class SparseReference:
    """The indexer state of ``ReferenceModel`` over one sequence at a time (see the module).

    ``f`` casts a weight to the reference's dtype (cached), ``rms`` is the reference's
    RMSNorm; ``norms[i]`` is layer ``i``'s input RMSNorm weight, ``q_a`` its q LoRA
    (``q_a_proj``, ``q_a_layernorm``)."""

    def __init__(self, config: DeepseekConfig, indexers: list[IndexerWeights | None],
                 norms: list[torch.Tensor], q_a: list[tuple[torch.Tensor, torch.Tensor]],
                 f: Callable[[torch.Tensor], torch.Tensor],
                 rms: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                 dtype: torch.dtype) -> None:
        if config.indexer is None:
            raise ValueError("SparseReference: the model has no indexer")
        self.config, self.indexer = config, config.indexer
        self.weights, self.norms, self.q_a, self.f, self.rms = indexers, norms, q_a, f, rms
        self.dtype = dtype
        self.topk = self.indexer.index_topk
        self.inv_freq = rope_inv_freq(config.rope, config.qk_rope_head_dim)
        #: Each layer with its own indexer: its index among those (an engine's selections').
        self.ordinal = {i: j for j, i in enumerate(i for i, w in enumerate(indexers)
                                                   if w is not None)}
        self._keys: list[torch.Tensor | None] = [None] * len(indexers)
        self._selected: list[torch.Tensor | None] = [None] * len(indexers)
        self._margins: list[torch.Tensor | None] = [None] * len(indexers)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first ``qk_rope_head_dim`` values of ``x [n, ..., Di]`` roped at
        ``positions``."""
        r = self.config.qk_rope_head_dim
        if not r:
            return x
        freqs = torch.outer(positions.to(torch.float64), self.inv_freq)
        scale = self.config.rope.cos_sin_scale
        cos, sin = (freqs.cos() * scale).to(x.dtype), (freqs.sin() * scale).to(x.dtype)
        return torch.cat([apply_rope(x[..., :r], cos, sin, self.indexer.rope_interleave),
                          x[..., r:]], dim=-1)

    def add_keys(self, i: int, h: torch.Tensor, start: int, n: int) -> None:
        """Layer ``i``'s index keys at positions ``start..n`` from its inputs ``h``."""
        w = self.weights[i]
        if w is None:
            return
        x = self.rms(h, self.f(self.norms[i]), self.config.rms_norm_eps)
        wide = torch.float64 if self.dtype == torch.float64 else torch.float32
        k = torch.nn.functional.layer_norm(
            (x @ self.f(w.wk).t()).to(wide), (w.wk.shape[0],), w.k_norm_weight.to(wide),
            w.k_norm_bias.to(wide), INDEXER_NORM_EPS).to(self.dtype)
        keys = _grown(self._keys[i], n, start, (k.shape[1],), self.dtype)
        keys[start:n] = self._rope(k, torch.arange(start, n))
        self._keys[i] = keys

    def select(self, i: int, h: torch.Tensor, rows: torch.Tensor, common: int, n: int,
               store: bool, forced: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s selection ``[len(rows), width]`` (int64 positions, -1 padding; ``width``
        ``min(topk, max(rows) + 1)``, a shared layer's its source's stored width), its margins
        and its comparison with ``forced`` (``compare_selection``; zeros where not compared) at
        ``rows`` (sorted; inputs ``h``), a shared layer's taken from the layer before (compared
        there). ``forced [len(rows), any width]``: the engine's selection, used where a row has
        one (see the module). ``store``: ``rows`` are ``common..n`` and are kept for later
        sequences."""
        compared = torch.zeros(rows.numel(), 3, dtype=torch.float64)
        if self.weights[i] is None:
            source = next(j for j in range(i - 1, -1, -1) if self.weights[j] is not None)
            selected, margins = self._selected[source], self._margins[source]
            if selected is None or margins is None:  # pragma: no cover - layers run in order
                raise RuntimeError("the shared layer's source was not computed")
            return selected.index_select(0, rows), margins.index_select(0, rows), compared
        end = int(rows.max()) + 1 if rows.numel() else 1
        # No row sees more than ``end`` keys: a wider selection could hold only padding.
        width = min(self.topk, end)
        sel = torch.empty(rows.numel(), width, dtype=torch.int64)
        margins = torch.empty(rows.numel(), dtype=torch.float64)
        block = max(1, _SCORE_BUDGET // (self.indexer.index_n_heads * end))
        for b0 in range(0, rows.numel(), block):
            part = slice(b0, b0 + block)
            total = self._scores(i, h[part], rows[part])
            # ``width`` >= this block's keys or == topk: its best ``width`` are its best ``topk``.
            own = topk_positions(total, width).to(torch.int64)
            sel[part], margins[part] = own, _margins(total, self.topk)
            if forced is not None:
                given = forced[part].to(torch.int64)
                known = (given >= 0).any(dim=1)
                # a valid selection names at most ``width`` keys (the row's visible ones, at
                # most topk); a wider one is compared as it is (a wrong count: inf) and
                # attended to cut to ``width``
                sel[part] = torch.where(known[:, None], _fitted(given, width), own)
                compared[part] = torch.where(known[:, None],
                                             compare_selection(total, given, own), 0.0)
        if store:
            self._selected[i] = _stored(self._selected[i], sel, common, n)
            self._margins[i] = _grown(self._margins[i], n, common, (), torch.float64)
            self._margins[i][common:n] = margins   # type: ignore[index]
        return sel, margins, compared

    @property
    def layers(self) -> int:
        """How many layers have their own indexer (an engine's selections' first dim)."""
        return len(self.ordinal)

    def forced_rows(self, forced: torch.Tensor | None, i: int, rows: torch.Tensor
                    ) -> torch.Tensor | None:
        """Layer ``i``'s selections of ``forced`` (an engine's bitmasks,
        ``app.model.sparse.selections``) at ``rows`` as positions (a row of -1 where none;
        None: none given, or a layer without its own indexer)."""
        j = self.ordinal.get(i)
        return None if forced is None or j is None \
            else unpack_positions(forced[j].index_select(0, rows))

    def agreeing_prefix(self, forced: torch.Tensor, limit: int) -> int:
        """How many of the first ``limit`` positions the stored selections (of the sequence
        before) share with ``forced`` (the engine's bitmasks of this sequence; rows without
        one agree): the reuse of that sequence's state stops at the first that differs."""
        agree = limit
        for i, j in self.ordinal.items():
            stored = self._selected[i]
            if stored is None or not limit:
                continue
            given = forced[j, :limit]
            mine = pack_positions(stored[:limit], 8 * int(given.shape[1]))
            differ = given.any(dim=1) & (given != mine).any(dim=1)
            if bool(differ.any()):
                agree = min(agree, int(differ.nonzero()[0, 0]))
        return agree

    def _scores(self, i: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s index scores ``[len(rows), rows[-1] + 1]`` float64 (``-inf``: not
        visible) of the rows ``rows`` (inputs ``h``)."""
        w, keys = self.weights[i], self._keys[i]
        if w is None or keys is None:  # pragma: no cover - checked by the caller
            raise RuntimeError("no indexer keys")
        heads, dim = self.indexer.index_n_heads, self.indexer.index_head_dim
        x = self.rms(h, self.f(self.norms[i]), self.config.rms_norm_eps)
        q_a, q_a_norm = self.q_a[i]
        resid = self.rms(x @ self.f(q_a).t(), self.f(q_a_norm), self.config.rms_norm_eps)
        q = self._rope((resid @ self.f(w.wq_b).t()).view(-1, heads, dim), rows)
        score_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        weights = (x.to(score_dtype) @ w.weights_proj.to(score_dtype).t()) \
            * self.indexer.weights_scale
        end = int(rows[-1]) + 1
        scores = torch.einsum("rhd,nd->rhn", q.to(score_dtype), keys[:end].to(score_dtype))
        total = torch.einsum("rh,rhn->rn", weights, scores.relu_()).to(torch.float64)
        total.masked_fill_(torch.arange(end).view(1, -1) > rows.view(-1, 1), float("-inf"))
        return total


def _margins(total: torch.Tensor, topk: int) -> torch.Tensor:
    """Each row's selection margin (see the module): how far the scores around the ``topk``-th
    are from changing the selection, over the row's largest score magnitude. Keys tied with the
    ``topk``-th are split by position (``topk_positions``): the same in every dtype, so a tie
    alone is no near-tie; a key moving into or out of the tied group is."""
    k = min(topk, total.shape[1])
    finite = torch.isfinite(total)
    kth = torch.topk(total, k, dim=1).values[:, -1:]
    above, tied, below = (total > kth) & finite, (total == kth) & finite, (total < kth) & finite
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    gap_below = (kth[:, 0] - torch.where(below, total, -inf).amax(dim=1))
    gap_above = torch.where(above, total, inf).amin(dim=1) - kth[:, 0]
    straddle = above.sum(dim=1) + tied.sum(dim=1) > k
    gap = torch.where(straddle, torch.minimum(gap_above, gap_below), gap_below)
    scale = torch.where(finite, total, 0.0).abs().amax(dim=1).clamp(min=1e-300)
    return torch.where(torch.isfinite(gap), gap / scale, inf)
