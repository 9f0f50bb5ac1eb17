"""An engine's own top-k selections, kept for the float64 check as bitmasks.

``MLAEngine(keep_selections=True)`` keeps, per request, the positions each computed row attended
to in each layer with its own indexer, and ``ReferenceModel.outputs_many(..., selections=...)``
attends to them. The check needs every computed row's, not only the rows it samples: a sampled
row reads the keys and values of the rows before it, which the reference computes from their
own selections; where those are the reference's instead of the engine's (a random bf16 model's
index scores are near ties in most rows), the sampled rows move far past the dense tolerance
(measured on the tiny V3.2 checkpoint of the tests: 0.73 against 0.11).

So the selections are kept as bitmasks, ``[indexer layers, S, ceil(S / 8)]`` uint8 (bit ``b``
of byte ``j`` of row ``r``: position ``8 j + b`` selected; an all-zero row: none kept, e.g. a
prefix-cache hit): ``S / 8`` bytes per row and layer whatever ``index_topk`` is, where the
positions themselves would be ``4 * min(index_topk, S)``. On a real V3.2 (61 indexer layers, top-k
2048) ``run``'s default workload (32 requests of 256 to 4096 tokens) keeps ~1.5 GB, not the
~35 GB of int32 positions: less than the outputs the check keeps already (7168 bf16 values per
row). An engine packs each step's selection on its device (``pack_positions``) as it is made.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_keep_selections", "checked_selections", "pack_positions", "selection_bytes",
           "unpack_positions"]

def selection_bytes(keys: int) -> int:
    """The bytes of one row's bitmask over ``keys`` positions."""
    return (keys + 7) // 8


def pack_positions(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """``positions [..., w]`` (integers, ``-1`` padding, each below ``keys``; one at or past
    ``8 * selection_bytes(keys)`` is dropped) as bitmasks ``[..., selection_bytes(keys)]``
    uint8 on their device."""
    lead, width = positions.shape[:-1], int(positions.shape[-1])
    flat = positions.reshape(-1, width).to(torch.int64)
    room = 8 * selection_bytes(keys)
    mask = torch.zeros(flat.shape[0], room + 1, dtype=torch.bool, device=positions.device)
    mask.scatter_(1, torch.where((flat >= 0) & (flat < room), flat, room), True)
    # bit by bit in uint8: nothing wider than the bitmask itself, nothing copied from the host
    eighths = mask[:, :room].view(-1, room // 8, 8).to(torch.uint8)
    bits = eighths[..., 0].clone()
    for b in range(1, 8):
        bits |= eighths[..., b] << b
    return bits.view(*lead, room // 8)


def unpack_positions(bits: torch.Tensor) -> torch.Tensor:
    """Bitmasks ``bits [rows, n]`` uint8 as positions ``[rows, width]`` int64 (increasing,
    ``-1`` padding; ``width`` the most any row selects, a row of ``-1`` where none)."""
    rows, room = int(bits.shape[0]), 8 * int(bits.shape[1])
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    mask = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(rows, room)
    width = int(mask.sum(dim=1).max()) if rows else 0
    position = torch.arange(room, dtype=torch.int64, device=bits.device).expand(rows, room)
    ordered = torch.where(mask, position, room).sort(dim=1).values[:, :width]
    return torch.where(ordered == room, -1, ordered)


def check_keep_selections(keep: object, keep_outputs: bool, sparse: bool) -> None:
    """``MLAEngine``'s ``keep_selections``: a bool (``TypeError``), True only with
    ``keep_outputs`` and a ``sparse`` model (``ValueError``)."""
    if not isinstance(keep, bool):
        raise TypeError(f"MLAEngine: keep_selections must be a bool, got {keep!r}")
    if keep and not keep_outputs:
        raise ValueError("MLAEngine: keep_selections=True needs keep_outputs=True (the "
                         "selections are checked with the rows they produced)")
    if keep and not sparse:
        raise ValueError("MLAEngine: keep_selections=True needs a sparse model (an indexer: "
                         "DeepSeek-V3.2, GLM-5); this one is dense")


def checked_selections(lengths: Sequence[int], selections: Sequence[torch.Tensor | None],
                       layers: int | None) -> list[torch.Tensor | None]:
    """An engine's ``selections`` (one per sequence of ``lengths``, or None) on the CPU, each
    checked to be a uint8 bitmask ``[layers, length, selection_bytes(length)]``; ``ValueError``
    otherwise (or when ``layers`` is None: a dense model)."""
    if len(selections) != len(lengths):
        raise ValueError(f"ReferenceModel.outputs_many: {len(selections)} selections for "
                         f"{len(lengths)} sequences")
    out: list[torch.Tensor | None] = []
    for length, given in zip(lengths, selections, strict=True):
        if given is None:
            out.append(None)
            continue
        want = [layers, length, selection_bytes(length)]
        if layers is None or not isinstance(given, torch.Tensor) \
                or list(given.shape) != want or given.dtype != torch.uint8:
            raise ValueError(f"ReferenceModel.outputs_many: a selection must be a uint8 "
                             f"bitmask [indexer layers, tokens, ceil(tokens / 8)] = {want} of "
                             f"a sparse model (RequestOutput.selections), got "
                             f"{getattr(given, 'dtype', type(given).__name__)} "
                             f"{list(getattr(given, 'shape', []))}")
        out.append(given.to("cpu"))
    return out
