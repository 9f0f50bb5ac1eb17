"""The prefill step's layout: what a caller gives (``MLAPrefillMetadata``) and what a backend
checks it into (``StepLayouts``), shared by every layer of the step.

``MLAPrefillMetadata.build`` makes the public metadata from host lengths; a backend's
``prepare_metadata`` checks each of its ``cu_seqlens`` once per step (host copies only: no
device sync) into a ``RaggedLayout`` per call (the causal new tokens, each context chunk),
which every layer of the step reads. Every failure raises ``ValueError`` naming the expected and
the actual value.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import torch

from app._validation import INT32_MAX, check_int_at_least

__all__ = [
    "ContextChunkMetadata",
    "MLAPrefillMetadata",
    "RaggedLayout",
    "StepLayouts",
    "check_cu_seqlens",
]

_INT_DTYPES = (torch.int32, torch.int64)


def _cu_seqlens(lengths: Sequence[int], what: str) -> torch.Tensor:
    for i, n in enumerate(lengths):
        check_int_at_least(f"{what}[{i}]", n, 0)
    # The prefix sums are int32 (the kernels' layout): refuse what would wrap around.
    if sum(lengths) > INT32_MAX:
        raise ValueError(f"{what}: {sum(lengths)} tokens in all; the int32 prefix sums hold at "
                         f"most {INT32_MAX} (2**31 - 1)")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return cu


@attrs.frozen
class ContextChunkMetadata:
    """One chunk of cached context, per request: ``cu_seqlens_kv [B+1]`` int32 prefix sums."""

    cu_seqlens_kv: torch.Tensor
    cu_seqlens_kv_cpu: torch.Tensor
    max_seq_len_kv: int
    total_kv: int


@attrs.frozen
class MLAPrefillMetadata:
    """The ragged layout of one prefill step, shared by every layer of the step.

    ``cu_seqlens_q [B+1]`` int32: new tokens per request. ``cu_seqlens_kv_new [B+1]``: keys
    each request's new tokens attend causally (equal to ``cu_seqlens_q`` unless built with
    ``new_kv_lens``). ``context_chunks``: the chunks of cached context. Each tensor exists on
    the device (for kernels) and on the host (``*_cpu``, read without a device sync).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_cpu: torch.Tensor
    max_query_len: int
    total_q: int
    cu_seqlens_kv_new: torch.Tensor
    cu_seqlens_kv_new_cpu: torch.Tensor
    max_new_kv_len: int
    total_new_kv: int
    context_chunks: tuple[ContextChunkMetadata, ...] = ()

    @property
    def num_requests(self) -> int:
        """The batch size B."""
        return int(self.cu_seqlens_q_cpu.numel()) - 1

    @classmethod
    def build(cls, query_lens: Sequence[int],
              context_chunk_lens: Sequence[Sequence[int]] = (),
              device: torch.device | str = "cpu",
              new_kv_lens: Sequence[int] | None = None) -> MLAPrefillMetadata:
        """Build from host lengths: ``query_lens[b]`` new tokens of request b, and for each
        context chunk ``c``, ``context_chunk_lens[c][b]`` cached tokens of request b in it.

        ``new_kv_lens[b]`` (default ``query_lens[b]``) lets the causal call see more keys than
        queries (bottom-right aligned). Raises ``ValueError`` on negative or mismatched lengths.
        """
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:   # torch's "Invalid device string"
            raise ValueError(f"MLAPrefillMetadata.build: device must be a torch.device or a "
                             f"device string ('cpu', 'cuda:0'), got {device!r}") from exc
        cu_q_cpu = _cu_seqlens(query_lens, "query_lens")
        batch = len(query_lens)
        if new_kv_lens is None:
            new_kv_lens = query_lens
        if len(new_kv_lens) != batch:
            raise ValueError(f"new_kv_lens has {len(new_kv_lens)} entries, expected {batch}")
        cu_kv_cpu = _cu_seqlens(new_kv_lens, "new_kv_lens")
        chunks = []
        for c, lens in enumerate(context_chunk_lens):
            if len(lens) != batch:
                raise ValueError(f"context_chunk_lens[{c}] has {len(lens)} entries, "
                                 f"expected {batch} (one per request)")
            cu = _cu_seqlens(lens, f"context_chunk_lens[{c}]")
            chunks.append(ContextChunkMetadata(
                cu_seqlens_kv=cu.to(device), cu_seqlens_kv_cpu=cu,
                max_seq_len_kv=max(lens, default=0), total_kv=int(cu[-1])))
        return cls(
            cu_seqlens_q=cu_q_cpu.to(device), cu_seqlens_q_cpu=cu_q_cpu,
            max_query_len=max(query_lens, default=0), total_q=int(cu_q_cpu[-1]),
            cu_seqlens_kv_new=cu_kv_cpu.to(device), cu_seqlens_kv_new_cpu=cu_kv_cpu,
            max_new_kv_len=max(new_kv_lens, default=0), total_new_kv=int(cu_kv_cpu[-1]),
            context_chunks=tuple(chunks))


def check_cu_seqlens(cu: torch.Tensor, what: str, *, batch: int | None = None,
                     total: int | None = None) -> list[int]:
    """Check a host ``cu_seqlens`` (1-D int, starts at 0, non-decreasing, ends at ``total``,
    ``batch + 1`` entries) and return it as a list of ints."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.dtype not in _INT_DTYPES:
        raise ValueError(f"{what}: expected a 1-D int32/int64 tensor, got shape "
                         f"{list(cu.shape)} dtype {cu.dtype}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{what}: expected {batch + 1} entries (batch {batch} + 1), "
                         f"got {cu.numel()}")
    values = [int(x) for x in cu.tolist()]
    if not values:
        raise ValueError(f"{what}: expected at least 1 entry, got 0")
    if values[0] != 0:
        raise ValueError(f"{what}: expected to start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(f"{what}: expected non-decreasing prefix sums, got "
                             f"{values[i - 1]} then {values[i]} at index {i}")
    if values[-1] > INT32_MAX:  # int64 sums narrowed to the kernels' int32 would wrap around
        raise ValueError(f"{what}: ends at {values[-1]}, beyond int32 (at most {INT32_MAX} "
                         f"tokens in all); refused, not narrowed")
    if total is not None and values[-1] != total:
        raise ValueError(f"{what}: expected to end at the token count {total}, got {values[-1]}")
    return values


def _check_device_copy(device_cu: torch.Tensor, host: torch.Tensor, what: str) -> None:
    if not isinstance(device_cu, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(device_cu).__name__}")
    if device_cu.dtype != torch.int32:
        raise ValueError(f"{what}: kernels need int32 prefix sums, got {device_cu.dtype}")
    if tuple(device_cu.shape) != tuple(host.shape):
        raise ValueError(f"{what}: expected shape {list(host.shape)} (as the host copy), "
                         f"got {list(device_cu.shape)}")


def _device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The checked host prefix sums on ``device`` (the host tensor itself on the CPU)."""
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


@attrs.frozen
class RaggedLayout:
    """One ragged attention call's layout, read once from the host ``cu_seqlens``.

    ``q_lens[b]`` queries of request b attend ``kv_lens[b]`` keys; ``q_starts``/``kv_starts``
    are the offsets of each request in the packed tensors.
    """

    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    cu_q_cpu: torch.Tensor
    cu_kv_cpu: torch.Tensor
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    total_q: int
    total_kv: int
    max_q: int
    max_kv: int

    @property
    def batch(self) -> int:
        """The number of requests."""
        return len(self.q_lens)

    @classmethod
    def from_cu_seqlens(cls, cu_q_cpu: torch.Tensor, cu_kv_cpu: torch.Tensor,
                        cu_q: torch.Tensor, cu_kv: torch.Tensor, *, what: str,
                        total_q: int, total_kv: int, max_q: int, max_kv: int) -> RaggedLayout:
        """Check both prefix sums (host values, device dtype/shape) and build the layout.

        ``max_q``/``max_kv`` are the metadata's maxima: they must be at least the real
        maxima (kernels size their grids with them)."""
        q = check_cu_seqlens(cu_q_cpu, f"{what}: cu_seqlens_q", total=total_q)
        kv = check_cu_seqlens(cu_kv_cpu, f"{what}: cu_seqlens_kv", batch=len(q) - 1,
                              total=total_kv)
        _check_device_copy(cu_q, cu_q_cpu, f"{what}: cu_seqlens_q (device copy)")
        _check_device_copy(cu_kv, cu_kv_cpu, f"{what}: cu_seqlens_kv (device copy)")
        q_lens = tuple(b - a for a, b in itertools.pairwise(q))
        kv_lens = tuple(b - a for a, b in itertools.pairwise(kv))
        for name, lens, declared in (("query", q_lens, max_q), ("kv", kv_lens, max_kv)):
            actual = max(lens, default=0)
            if declared < actual:
                raise ValueError(f"{what}: max {name} length is {actual}, but the metadata "
                                 f"declares {declared}")
        # Copies of the checked values, never the caller's tensors: the caller may reuse
        # them, and a device copy that disagreed with the host one would be read unchecked.
        q_host = cu_q_cpu.to(torch.int32, copy=True)
        kv_host = cu_kv_cpu.to(torch.int32, copy=True)
        return cls(cu_q=_device_copy(q_host, cu_q.device),
                   cu_kv=_device_copy(kv_host, cu_kv.device), cu_q_cpu=q_host,
                   cu_kv_cpu=kv_host, q_lens=q_lens, kv_lens=kv_lens,
                   q_starts=tuple(q[:-1]), kv_starts=tuple(kv[:-1]), total_q=total_q,
                   total_kv=total_kv, max_q=max(q_lens, default=0),
                   max_kv=max(kv_lens, default=0))

    def empty_rows(self, causal: bool) -> list[tuple[int, int]]:
        """``(start, stop)`` query-row ranges that see no key: requests with no keys, and
        with a causal (bottom-right) mask the first ``q_len - kv_len`` rows of a request."""
        ranges = []
        for start, ql, kl in zip(self.q_starts, self.q_lens, self.kv_lens, strict=True):
            dead = ql if kl == 0 else (max(0, ql - kl) if causal else 0)
            if dead:
                ranges.append((start, start + dead))
        return ranges

    def runs(self) -> list[tuple[int, int, int, int, int]]:
        """Maximal runs of consecutive requests with equal ``(q_len, kv_len)``, as
        ``(q_start, kv_start, count, q_len, kv_len)``: each run is a dense batch."""
        out: list[tuple[int, int, int, int, int]] = []
        for qs, ks, ql, kl in zip(self.q_starts, self.kv_starts, self.q_lens, self.kv_lens,
                                  strict=True):
            if out and out[-1][3] == ql and out[-1][4] == kl:
                q0, k0, n, _, _ = out[-1]
                out[-1] = (q0, k0, n + 1, ql, kl)
            else:
                out.append((qs, ks, 1, ql, kl))
        return out


@attrs.frozen
class StepLayouts:
    """The layouts of one prefill step: the causal new-token call and each context chunk."""

    new_tokens: RaggedLayout
    chunks: tuple[RaggedLayout, ...]

    @classmethod
    def from_metadata(cls, md: MLAPrefillMetadata, who: str) -> StepLayouts:
        """Check every ``cu_seqlens`` of ``md`` and build the layouts (no device sync)."""
        new = RaggedLayout.from_cu_seqlens(
            md.cu_seqlens_q_cpu, md.cu_seqlens_kv_new_cpu, md.cu_seqlens_q,
            md.cu_seqlens_kv_new, what=f"{who}: new tokens", total_q=md.total_q,
            total_kv=md.total_new_kv, max_q=md.max_query_len, max_kv=md.max_new_kv_len)
        chunks = []
        for i, chunk in enumerate(md.context_chunks):
            if not isinstance(chunk, ContextChunkMetadata):
                raise ValueError(f"{who}: context chunk {i}: expected ContextChunkMetadata, "
                                 f"got {type(chunk).__name__}")
            chunks.append(RaggedLayout.from_cu_seqlens(
                md.cu_seqlens_q_cpu, chunk.cu_seqlens_kv_cpu, md.cu_seqlens_q,
                chunk.cu_seqlens_kv, what=f"{who}: context chunk {i}", total_q=md.total_q,
                total_kv=chunk.total_kv, max_q=md.max_query_len, max_kv=chunk.max_seq_len_kv))
        return cls(new_tokens=new, chunks=tuple(chunks))
