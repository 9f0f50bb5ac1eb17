"""The sparse cases of the conformance kits: every backend with ``supports_sparse`` runs them.

DeepSeek Sparse Attention's contract (``MLADecodeBackend.run_sparse_decode``,
``MLAPrefillBackend.run_sparse_prefill``): each query row attends, in MLA's absorbed form, to the
latent rows its int32 indices name (``-1`` padding; every entry one softmax term; a row naming
nothing gets out 0 and LSE ``-inf``). The kit writes random latents into a paged cache, selects
random positions per row the way an indexer would (distinct visible positions, best first), turns
them into cache slots through the block table and compares every output and LSE with
``reference_sparse_attention`` (float64, from the same inputs). The cases, decode:

============================  ================================================================
``sparse_paged``              pages shuffled, seq_len 1 to 6 blocks, topk 8 (short requests
                              have fewer candidates than k: padded with -1)
``sparse_query_len_4``        query_len 4: row i selects among ``[0, seq_len - 4 + i]``
``sparse_repeats_padding``    indices named twice and -1 entries scattered through the row
``sparse_topk_over_context``  topk larger than every context: all visible keys, which must
                              equal dense attention (``reference_decode``)
``sparse_all_padding``        rows whose indices are all -1: out 0, LSE ``-inf``
``sparse_long_context``       one request of 1500 tokens, topk 64
``sparse_out_buffer``         ``out=`` (pre-filled with NaN) is written in place and returned
``sparse_noncontiguous_q``    q as a strided view of a larger tensor
``sparse_scales_per_call``    ``softmax_scale`` / ``k_scale`` change between calls
``sparse_empty_batch``        B = 0: empty outputs, no error
``sparse_index_checks``       an index out of ``[-1, rows)``, int64 indices or a wrong shape are
                              ``ValueError`` before any kernel runs
============================  ================================================================

and prefill (``sparse_`` cases of the same names where they apply, over the flat cache), plus
``sparse_context_chunks``: the same selection run over each request's context gathered in two
chunks and its new tokens, each call's indices into its own rows, merged by LSE
(``merge_attn_states``), equals one call over the whole cache.

Every LSE is also held to ``_FLOAT32_LSE_TOLERANCE`` (1e-4, the dense CPU kernels' bound) off
float64 whatever the dtype: the LSE is the float32 one even where p.v rounds p to bf16.

``run_conformance`` / ``run_decode_conformance`` add these cases for a backend that declares
``supports_sparse`` (and run the dense cases only for one that ``supports_dense``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from app.backends.contract import describe_value as _describe
from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.merge import merge_attn_states
from app.backends.prefill.base import MLAPrefillBackend
from app.testing._kit import CaseFailure, device_capability_of
from app.testing._kit import max_abs_error as _max_abs

__all__ = ["SPARSE_DECODE_CASES", "SPARSE_KIT_TOPK", "SPARSE_PREFILL_CASES",
           "reference_sparse_attention"]

#: The ``index_topk`` the kits validate a sparse backend with (the released models').
SPARSE_KIT_TOPK = 2048

#: The most a sparse LSE may be off the float64 one, whatever the dtype: the dense CPU kernels'
#: bound. The LSE is the float32 one (the log of the sum of the unrounded probabilities) even
#: where p.v multiplies p rounded to bf16: a chunked prefill merges its chunks by it, and one
#: summed from rounded p is ~6e-4 off (issue 44), inside bf16's output tolerance.
_FLOAT32_LSE_TOLERANCE = 1e-4

#: The sparse decode cases, in the order they run.
SPARSE_DECODE_CASES: tuple[str, ...] = (
    "sparse_paged", "sparse_query_len_4", "sparse_repeats_padding", "sparse_topk_over_context",
    "sparse_all_padding", "sparse_long_context", "sparse_out_buffer", "sparse_noncontiguous_q",
    "sparse_scales_per_call", "sparse_empty_batch", "sparse_index_checks")
#: The sparse prefill cases, in the order they run.
SPARSE_PREFILL_CASES: tuple[str, ...] = (
    "sparse_paged", "sparse_repeats_padding", "sparse_topk_over_context", "sparse_all_padding",
    "sparse_context_chunks", "sparse_long_context", "sparse_out_buffer",
    "sparse_noncontiguous_q", "sparse_scales_per_call", "sparse_empty_batch",
    "sparse_index_checks")


def reference_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                               kv_lora_rank: int, scale: float, k_scale: float = 1.0
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed attention in float64 on the host: ``q [T, H, D]`` over the rows of
    ``kv [N, D]`` that ``indices [T, topk]`` names (-1 padding; each entry one term). Logits
    ``scale * k_scale * (q . k)``, output ``k_scale * sum(p * v)``, ``v`` the first
    ``kv_lora_rank`` values. Returns ``out [T, H, kv_lora_rank]`` and ``lse [T, H]`` (natural
    log; ``-inf`` and out 0 where a row names nothing)."""
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float64)
    rows = kv.detach().to("cpu", torch.float64)
    for t, row in enumerate(indices.detach().to("cpu", torch.long)):
        picked = rows[row[row >= 0]] * k_scale                       # [n, D], repeats kept
        if not picked.shape[0]:
            continue
        s = q[t].detach().to("cpu", torch.float64) @ picked.t() * scale
        lg = torch.logsumexp(s, dim=-1)
        out[t] = torch.exp(s - lg.unsqueeze(-1)) @ picked[:, :kv_lora_rank]
        lse[t] = lg
    return out, lse


class _SparseKit:
    """What the decode and prefill sparse cases share: a paged cache, selections, checks."""

    def __init__(self, device: torch.device, dtype: torch.dtype, heads: int, rank: int,
                 rope: int, block_size: int, seed: int) -> None:
        self.device, self.dtype, self.heads, self.rank, self.rope = (device, dtype, heads, rank,
                                                                     rope)
        self.dim, self.bs = rank + rope, block_size
        self.scale = 1.0 / math.sqrt(128 + rope)
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def paged(self, seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A cache with shuffled pages (unused rows huge: never to be read) and its table
        (unused entries -1)."""
        bs = self.bs
        needed = [-(-n // bs) for n in seq_lens]
        num_blocks = sum(needed) + 3
        perm = iter(torch.randperm(num_blocks, generator=self.gen).tolist())
        table = torch.full((len(seq_lens), max(needed, default=0) + 1), -1, dtype=torch.int32)
        cache = torch.randn(num_blocks, bs, self.dim, generator=self.gen)
        for b, n in enumerate(needed):
            for j in range(n):
                table[b, j] = next(perm)
            if seq_lens[b] % bs:
                cache[int(table[b, n - 1]), seq_lens[b] % bs:] = 1e4
        return cache.to(self.device, self.dtype), table.to(self.device)

    def positions(self, visible: Sequence[int], topk: int, mode: str = "distinct"
                  ) -> torch.Tensor:
        """Per row, ``topk`` positions among ``[0, visible[t])`` as an indexer picks them
        (distinct, -1 padding where fewer are visible); ``mode`` ``"repeats"`` names some
        twice and scatters -1 entries, ``"all_padding"`` empties every third row."""
        out = torch.full((len(visible), topk), -1, dtype=torch.int32)
        for t, n in enumerate(visible):
            chosen = torch.randperm(n, generator=self.gen)[:topk].to(torch.int32)
            out[t, :chosen.numel()] = chosen
            if mode == "repeats" and chosen.numel() > 1:
                slots = torch.randperm(topk, generator=self.gen)[:max(1, topk // 4)]
                row = out[t].clone()
                row[slots[::2]] = chosen[0]                          # named again
                row[slots[1::2]] = -1                                # padding in the middle
                out[t] = row
            if mode == "all_padding" and t % 3 == 1:
                out[t] = -1
        return out

    @staticmethod
    def to_slots(positions: torch.Tensor, table: torch.Tensor, request: Sequence[int],
                 bs: int) -> torch.Tensor:
        """Request-local positions as rows of the flat cache (-1 kept)."""
        pos = positions.to(torch.long)
        req = torch.tensor(request, dtype=torch.long).unsqueeze(1)
        blocks = table.cpu().to(torch.long)[req, pos.clamp(min=0) // bs]
        slots = blocks * bs + pos.clamp(min=0) % bs
        return torch.where(pos >= 0, slots, -1).to(torch.int32)

    def compare(self, what: str, out: object, lse: object,
                ref: tuple[torch.Tensor, torch.Tensor], errors: dict[str, float],
                out_shape: Sequence[int], lse_shape: Sequence[int] = ()) -> None:
        """Shapes and dtypes, ``-inf`` rows exactly, then the largest errors. ``ref`` is
        token-major (``[T, H, rank]``, ``[T, H]``); ``lse`` is in the kind's layout
        (``lse_shape``: decode ``[H, B, Q]``, prefill ``[H, T]``: head-major either way)."""
        ref_out = ref[0].reshape(*out_shape)
        if not isinstance(out, torch.Tensor) or list(out.shape) != list(out_shape) \
                or out.dtype != self.dtype:
            raise CaseFailure(f"{what}: output must be a {self.dtype} tensor of shape "
                              f"{list(out_shape)}, got {_describe(out)}")
        got = out.detach().to("cpu", torch.float64)
        if not torch.isfinite(got).all():
            raise CaseFailure(f"{what}: output has non-finite values")
        errors["out"] = max(errors.get("out", 0.0), _max_abs(got, ref_out))
        if lse is None:
            return
        if not isinstance(lse, torch.Tensor) or list(lse.shape) != list(lse_shape) \
                or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise CaseFailure(f"{what}: LSE must be contiguous float32 {list(lse_shape)} "
                              f"(head-major), got {_describe(lse)}")
        heads = int(lse.shape[0])
        got_lse = lse.detach().to("cpu", torch.float64).reshape(heads, -1).t()   # [T, H]
        want = ref[1]
        empty = torch.isneginf(want)
        if not torch.equal(torch.isneginf(got_lse), empty) or torch.isnan(got_lse).any():
            raise CaseFailure(f"{what}: the LSE must be -inf exactly where a row names no "
                              f"index (and finite elsewhere)")
        rows = got.reshape(want.shape[0], heads, -1)
        if bool(empty.any()) and rows[empty].abs().max().item() != 0.0:
            raise CaseFailure(f"{what}: rows that name no index must have output 0")
        if bool((~empty).any()):
            err = _max_abs(got_lse[~empty], want[~empty])
            if err > _FLOAT32_LSE_TOLERANCE:
                raise CaseFailure(f"{what}: the LSE is {err:.3g} off float64, more than "
                                  f"{_FLOAT32_LSE_TOLERANCE:g}: it must be the float32 one (the "
                                  f"log of the sum of the unrounded probabilities, whatever "
                                  f"p.v rounds p to)")
            errors["lse"] = max(errors.get("lse", 0.0), err)

    def dense(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
              request: Sequence[int], visible: Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention in float64 (token-major): row ``t`` of ``q [T, H, D]`` over every
        position ``[0, visible[t])`` of its request, read through the block table."""
        out = torch.zeros(len(visible), self.heads, self.rank, dtype=torch.float64)
        lse = torch.zeros(len(visible), self.heads, dtype=torch.float64)
        host, rows = cache.detach().to("cpu", torch.float64), table.cpu().to(torch.long)
        for t, (b, n) in enumerate(zip(request, visible, strict=True)):
            pos = torch.arange(n)
            seen = host[rows[b][pos // self.bs], pos % self.bs]
            s = q[t].detach().to("cpu", torch.float64) @ seen.t() * self.scale
            lg = torch.logsumexp(s, dim=-1)
            out[t] = torch.exp(s - lg.unsqueeze(-1)) @ seen[:, :self.rank]
            lse[t] = lg
        return out, lse

    def index_errors(self, call: object, good: torch.Tensor, rows: int) -> None:
        """``call(indices)`` must refuse an index out of range, int64 and a wrong shape."""
        bad_cases = {"an index equal to the number of kv rows": good.clone().fill_(rows),
                     "an index below -1": good.clone().fill_(-2),
                     "int64 indices": good.to(torch.int64),
                     "a missing topk dim": good[..., 0]}
        for what, bad in bad_cases.items():
            try:
                call(bad)  # type: ignore[operator]
            except ValueError:
                continue
            raise CaseFailure(f"{what} must be refused with ValueError before any kernel runs")


class _SparseDecodeKit(_SparseKit):
    """The sparse decode cases (``SPARSE_DECODE_CASES``)."""

    def __init__(self, cls: type[MLADecodeBackend], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.cls = cls

    def backend(self) -> MLADecodeBackend:
        return self.cls(num_heads=self.heads, scale=self.scale, kv_lora_rank=self.rank,
                        qk_rope_head_dim=self.rope, kv_cache_dtype=self.dtype,
                        device_capability=device_capability_of(self.device))

    def step(self, seq_lens: Sequence[int], qlen: int, topk: int, mode: str = "distinct"
             ) -> tuple[MLADecodeBackend, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache, table = self.paged(seq_lens)
        be = self.backend()
        be.prepare_metadata(MLADecodeMetadata.build(
            table, torch.tensor(seq_lens, dtype=torch.int32, device=self.device), qlen))
        visible = [n - qlen + i + 1 for n in seq_lens for i in range(qlen)]
        request = [b for b in range(len(seq_lens)) for _ in range(qlen)]
        slots = self.to_slots(self.positions(visible, topk, mode), table, request, self.bs)
        return be, cache, table, slots.view(len(seq_lens), qlen, topk).to(self.device)

    def run(self, seq_lens: Sequence[int], qlen: int, topk: int, errors: dict[str, float], *,
            mode: str = "distinct", strided_q: bool = False, out_buffer: bool = False,
            scales: Sequence[tuple[float | None, float | None]] = ((None, None),)) -> None:
        be, cache, table, idx = self.step(seq_lens, qlen, topk, mode)
        shape = (len(seq_lens), qlen, self.heads, self.dim)
        q = self.randn(shape[2], shape[0], shape[1], shape[3] + 8)[..., 3:3 + self.dim] \
            .permute(1, 2, 0, 3) if strided_q else self.randn(*shape)
        out_shape = (*shape[:3], self.rank)
        lse_shape = (self.heads, len(seq_lens), qlen)
        flat = cache.reshape(-1, self.dim)
        for softmax_scale, k_scale in scales:
            ref = reference_sparse_attention(q.reshape(-1, self.heads, self.dim), flat,
                                             idx.reshape(-1, topk), self.rank,
                                             softmax_scale or self.scale, k_scale or 1.0)
            buf = torch.full(out_shape, float("nan"), dtype=self.dtype,
                             device=self.device) if out_buffer else None
            result = be.run_sparse_decode(q, cache, idx, return_softmax_lse=True, out=buf,
                                          softmax_scale=softmax_scale, k_scale=k_scale)
            if not isinstance(result, tuple) or (buf is not None and result[0] is not buf):
                raise CaseFailure("run_sparse_decode(return_softmax_lse=True) must return "
                                  "(out, lse), out being out= when given")
            self.compare(f"scales {softmax_scale}, {k_scale}", result[0], result[1], ref,
                         errors, out_shape, lse_shape)
            plain = be.run_sparse_decode(q, cache, idx, softmax_scale=softmax_scale,
                                         k_scale=k_scale)
            self.compare("no LSE", plain, None, ref, errors, out_shape)
        if mode == "over_context":
            dense = self.dense(q.reshape(-1, self.heads, self.dim), cache, table,
                               [b for b in range(len(seq_lens)) for _ in range(qlen)],
                               [n - qlen + i + 1 for n in seq_lens for i in range(qlen)])
            got = be.run_sparse_decode(q, cache, idx, return_softmax_lse=True)
            self.compare("against dense attention", got[0], got[1], dense, errors, out_shape,
                         lse_shape)

    def sparse_paged(self, errors: dict[str, float]) -> None:
        bs = self.bs
        self.run([1, bs + 1, bs, 2 * bs + 7, 3 * bs, 6 * bs + 3], 1, 8, errors)

    def sparse_query_len_4(self, errors: dict[str, float]) -> None:
        self.run([4, 5, self.bs + 3, 4 * self.bs, 70], 4, 16, errors)

    def sparse_repeats_padding(self, errors: dict[str, float]) -> None:
        self.run([3, 2 * self.bs + 5, 90], 2, 24, errors, mode="repeats")

    def sparse_topk_over_context(self, errors: dict[str, float]) -> None:
        self.run([2, 9, self.bs + 1, 100], 2, 128, errors, mode="over_context")

    def sparse_all_padding(self, errors: dict[str, float]) -> None:
        self.run([5, 40, 2 * self.bs], 3, 8, errors, mode="all_padding")

    def sparse_long_context(self, errors: dict[str, float]) -> None:
        self.run([1500], 1, 64, errors)

    def sparse_out_buffer(self, errors: dict[str, float]) -> None:
        self.run([3, self.bs * 2 + 1, 40], 2, 16, errors, out_buffer=True)

    def sparse_noncontiguous_q(self, errors: dict[str, float]) -> None:
        self.run([7, self.bs + 9, 50], 3, 16, errors, strided_q=True)

    def sparse_scales_per_call(self, errors: dict[str, float]) -> None:
        self.run([9, 2 * self.bs + 1], 2, 8, errors,
                 scales=((0.01, None), (None, 2.0), (0.2, 0.5), (None, None)))

    def sparse_empty_batch(self, errors: dict[str, float]) -> None:
        be = self.backend()
        be.prepare_metadata(torch.zeros(0, 4, dtype=torch.int32, device=self.device),
                            torch.zeros(0, dtype=torch.int32, device=self.device), 2)
        q = self.randn(0, 2, self.heads, self.dim)
        idx = torch.zeros(0, 2, 8, dtype=torch.int32, device=self.device)
        result = be.run_sparse_decode(q, self.randn(3, self.bs, self.dim), idx,
                                      return_softmax_lse=True)
        if not isinstance(result, tuple) or list(result[0].shape) != [0, 2, self.heads,
                                                                       self.rank] \
                or list(result[1].shape) != [self.heads, 0, 2]:
            raise CaseFailure(f"empty batch: expected out [0, 2, H, rank] and lse [H, 0, 2], "
                              f"got {_describe(result)}")

    def sparse_index_checks(self, errors: dict[str, float]) -> None:
        be, cache, _, idx = self.step([5, 2 * self.bs], 1, 4)
        q = self.randn(2, 1, self.heads, self.dim)
        self.index_errors(lambda bad: be.run_sparse_decode(q, cache, bad), idx,
                          int(cache.shape[0]) * int(cache.shape[1]))


class _SparsePrefillKit(_SparseKit):
    """The sparse prefill cases (``SPARSE_PREFILL_CASES``): requests with context and new
    tokens in a paged cache, the new tokens' queries over it."""

    def __init__(self, cls: type[MLAPrefillBackend], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.cls = cls

    def backend(self) -> MLAPrefillBackend:
        return self.cls(num_heads=self.heads, scale=self.scale, kv_lora_rank=self.rank,
                        qk_nope_head_dim=128, qk_rope_head_dim=self.rope, v_head_dim=128,
                        device_capability=device_capability_of(self.device))

    def batch(self, context: Sequence[int], new: Sequence[int], topk: int, mode: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cache, table, positions [T, topk], slots [T, topk]) of a prefill step."""
        cache, table = self.paged([c + n for c, n in zip(context, new, strict=True)])
        visible = [c + j + 1 for c, n in zip(context, new, strict=True) for j in range(n)]
        request = [b for b, n in enumerate(new) for _ in range(n)]
        positions = self.positions(visible, topk, mode)
        return cache, table, positions, self.to_slots(positions, table, request, self.bs)

    def run(self, context: Sequence[int], new: Sequence[int], topk: int,
            errors: dict[str, float], *, mode: str = "distinct", strided_q: bool = False,
            out_buffer: bool = False,
            scales: Sequence[tuple[float | None, float | None]] = ((None, None),)) -> None:
        cache, table, _, slots = self.batch(context, new, topk, mode)
        tokens = sum(new)
        q = self.randn(self.heads, tokens, self.dim + 8)[..., 5:5 + self.dim].transpose(0, 1) \
            if strided_q else self.randn(tokens, self.heads, self.dim)
        kv, idx = cache.reshape(-1, self.dim), slots.to(self.device)
        be = self.backend()
        out_shape = (tokens, self.heads, self.rank)
        for softmax_scale, k_scale in scales:
            ref = reference_sparse_attention(q, kv, idx, self.rank, softmax_scale or self.scale,
                                             k_scale or 1.0)
            buf = torch.full(out_shape, float("nan"), dtype=self.dtype,
                             device=self.device) if out_buffer else None
            result = be.run_sparse_prefill(q, kv, idx, return_softmax_lse=True, out=buf,
                                           softmax_scale=softmax_scale, k_scale=k_scale)
            if not isinstance(result, tuple) or (buf is not None and result[0] is not buf):
                raise CaseFailure("run_sparse_prefill(return_softmax_lse=True) must return "
                                  "(out, lse), out being out= when given")
            self.compare(f"scales {softmax_scale}, {k_scale}", result[0], result[1], ref,
                         errors, out_shape, (self.heads, tokens))
            plain = be.run_sparse_prefill(q, kv, idx, softmax_scale=softmax_scale,
                                          k_scale=k_scale)
            self.compare("no LSE", plain, None, ref, errors, out_shape)
        if mode == "over_context":
            dense = self.dense(q, cache, table,
                               [b for b, n in enumerate(new) for _ in range(n)],
                               [c + j + 1 for c, n in zip(context, new, strict=True)
                                for j in range(n)])
            got = be.run_sparse_prefill(q, kv, idx, return_softmax_lse=True)
            self.compare("against dense causal attention", got[0], got[1], dense, errors,
                         out_shape, (self.heads, tokens))

    def sparse_paged(self, errors: dict[str, float]) -> None:
        self.run([0, 20, self.bs, 3], [9, 1, 2 * self.bs + 3, 30], 8, errors)

    def sparse_repeats_padding(self, errors: dict[str, float]) -> None:
        self.run([11, 0, 40], [7, 25, 3], 24, errors, mode="repeats")

    def sparse_topk_over_context(self, errors: dict[str, float]) -> None:
        self.run([0, 33, 5], [12, 4, 60], 128, errors, mode="over_context")

    def sparse_all_padding(self, errors: dict[str, float]) -> None:
        self.run([4, 0], [10, 17], 8, errors, mode="all_padding")

    def sparse_long_context(self, errors: dict[str, float]) -> None:
        self.run([1200], [64], 64, errors)

    def sparse_out_buffer(self, errors: dict[str, float]) -> None:
        self.run([5, 30], [16, 3], 16, errors, out_buffer=True)

    def sparse_noncontiguous_q(self, errors: dict[str, float]) -> None:
        self.run([8, 0], [20, 9], 16, errors, strided_q=True)

    def sparse_scales_per_call(self, errors: dict[str, float]) -> None:
        self.run([10], [12], 8, errors,
                 scales=((0.01, None), (None, 2.0), (0.2, 0.5), (None, None)))

    def sparse_empty_batch(self, errors: dict[str, float]) -> None:
        be = self.backend()
        q = self.randn(0, self.heads, self.dim)
        result = be.run_sparse_prefill(q, self.randn(10, self.dim),
                                       torch.zeros(0, 8, dtype=torch.int32, device=self.device),
                                       return_softmax_lse=True)
        if not isinstance(result, tuple) or list(result[0].shape) != [0, self.heads,
                                                                       self.rank] \
                or list(result[1].shape) != [self.heads, 0]:
            raise CaseFailure(f"empty batch: expected out [0, H, rank] and lse [H, 0], got "
                              f"{_describe(result)}")

    def sparse_context_chunks(self, errors: dict[str, float]) -> None:
        """Context gathered in two chunks plus the new tokens' rows, each call's indices into
        its own rows (-1 elsewhere), merged by LSE: equal to one call over the whole cache."""
        context, new, topk = [30, 0, 2 * self.bs + 1, 6], [7, 12, 20, 1], 16
        cache, table, positions, slots = self.batch(context, new, topk, "distinct")
        tokens = sum(new)
        q = self.randn(tokens, self.heads, self.dim)
        be = self.backend()
        flat = cache.reshape(-1, self.dim)
        ref = reference_sparse_attention(q, flat, slots, self.rank, self.scale)
        spans = [[(0, c // 2) for c in context], [(c // 2, c) for c in context],
                 [(c, c + n) for c, n in zip(context, new, strict=True)]]
        request = torch.tensor([b for b, n in enumerate(new) for _ in range(n)])
        merged: tuple[torch.Tensor, torch.Tensor] | None = None
        for i, span in enumerate(spans):
            rows: list[list[int]] = []
            offset: list[int] = []
            start: list[int] = []
            end: list[int] = []
            for b, (a, e) in enumerate(span):
                offset.append(sum(len(r) for r in rows))
                rows.append([int(s) for s in self.to_slots(
                    torch.arange(a, e, dtype=torch.int32).unsqueeze(0), table, [b],
                    self.bs)[0]])
                start.append(a)
                end.append(e)
            kv = flat[torch.tensor([s for r in rows for s in r], dtype=torch.long,
                                   device=self.device)] if any(map(len, rows)) else flat[:0]
            lo, hi = torch.tensor(start)[request], torch.tensor(end)[request]
            pos = positions.to(torch.long)
            inside = (pos >= lo.unsqueeze(1)) & (pos < hi.unsqueeze(1))
            local = pos - lo.unsqueeze(1) + torch.tensor(offset)[request].unsqueeze(1)
            idx = torch.where(inside, local, -1).to(torch.int32).to(self.device)
            out, lse = be.run_sparse_prefill(q, kv, idx, return_softmax_lse=True)
            part = reference_sparse_attention(q, kv, idx, self.rank, self.scale)
            self.compare(f"chunk {i}", out, lse, part, errors, (tokens, self.heads, self.rank),
                         (self.heads, tokens))
            merged = (out, lse) if merged is None else merge_attn_states(
                merged[0], merged[1], out, lse)
        if merged is None:  # pragma: no cover - three spans
            raise CaseFailure("no chunk ran")
        self.compare("merged", merged[0], merged[1], ref, errors,
                     (tokens, self.heads, self.rank), (self.heads, tokens))

    def sparse_index_checks(self, errors: dict[str, float]) -> None:
        cache, _, _, slots = self.batch([3], [5], 4, "distinct")
        q = self.randn(5, self.heads, self.dim)
        kv = cache.reshape(-1, self.dim)
        be = self.backend()
        self.index_errors(lambda bad: be.run_sparse_prefill(q, kv, bad), slots.to(self.device),
                          int(kv.shape[0]))
