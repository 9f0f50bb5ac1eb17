"""A conformance kit for MLA decode backends: built-in or third party.

It builds a decode backend from its class, writes random latents into a paged cache, builds
random page tables and compares every output and LSE with ``reference_decode`` (float64, from
the same inputs). The cases:

=======================  ====================================================================
``paged``                pages out of order and shared between requests, seq_len 1, seq_lens
                         that are and are not multiples of the block size, unused table
                         entries -1, huge values in the unused rows of last blocks
``causal_query_len_4``   query_len 4: row i sees keys ``[0, seq_len - 4 + i]``
``max_query_len``        the backend's ``max_query_len`` (16 by default)
``batch_1``              one request with a long context
``batch_33``             33 requests of random lengths
``empty_batch``          B = 0: empty outputs, no error
``out_buffer``           ``out=`` (pre-filled with NaN) is written in place and returned
``noncontiguous_q``      q as a strided view of a larger tensor
``scales_per_call``      ``softmax_scale``/``k_scale`` change between calls; nothing is cached
``other_block_size``     a second block size (5 when any is accepted)
``nonfinite_keys``       NaN in a step's last new token: the rows that see it are
                         non-finite, and exactly those when the backend declares
                         ``isolates_nonfinite_keys`` (else the request's other rows of the
                         step may be non-finite too); every finite row is right; NaN in
                         unused rows of a block changes nothing
``reused_step_buffers``  the caller rewrites its block table and seq_lens between two layers
                         (to other valid values): the second layer gives the step's result
``fp8_cache``            an ``fp8`` (e4m3, one scale per layer) cache, two scales per call,
                         query_len 1 and 4; NaN (e4m3's 0x7F) in a step's last new token
``fp8_ds_mla_cache``     DeepSeek's ``fp8_ds_mla`` rows, written by this package (power-of-two
                         scales) and as vLLM writes them (``amax / 448``); the same NaN
=======================  ====================================================================

The two FP8 cases run where the backend declares that cache dtype
(``supported_kv_cache_dtypes``; skipped otherwise, saying so) and compare with the float64
decode over the values the cache holds, each element against the bounds a kernel that
dequantises into bf16 (the scale rounded too), rounds its probabilities to bf16 and writes
q's dtype stays within (``app.testing.fp8_bounds``), not against the fixed tolerances: an
FP8 cache has no dtype of its own to take them from.

Every case checks the LSE (``return_softmax_lse=True``) and the plain call. A backend that
declares ``supports_sparse`` also runs ``SPARSE_DECODE_CASES`` (``app.testing.sparse_conformance``:
indices with repeats, -1 padding, fewer candidates than k, k larger than the context); one that
does not declare ``supports_dense`` runs only those. Run it on your backend::

    from app.testing import assert_decode_conformance
    assert_decode_conformance(MyDecodeBackend, device="cuda", dtype=torch.bfloat16)

``run_decode_conformance`` returns the report instead of raising (``assert_decode_conformance``
returns it once it passed); both kits run their cases through one runner (``run_cases`` of
``app.testing.conformance``). Tolerances are absolute, per dtype (``DEFAULT_TOLERANCES`` of the
prefill kit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from app._validation import check_seed
from app.backends.contract import describe_value as _describe
from app.backends.decode.base import MLADecodeBackend, MLADecodeSelectorConfig
from app.backends.decode.metadata import MLADecodeMetadata
from app.kvcache.cache_dtypes import (
    dequantize_fp8_ds_mla,
    fp8_power_of_two_scale,
    quantize_fp8_ds_mla,
    quantize_fp8_per_layer,
)
from app.testing._kit import max_abs_error as _max_abs
from app.testing.conformance import (
    DEFAULT_TOLERANCES,
    CaseFailure,
    ConformanceReport,
    device_capability_of,
    kit_device,
    run_cases,
)
from app.testing.fp8_bounds import DecodeErrorBounds, fp8_cache_decode_bounds
from app.testing.sparse_conformance import (
    SPARSE_DECODE_CASES,
    SPARSE_KIT_TOPK,
    _SparseDecodeKit,
)

__all__ = [
    "DECODE_CASES",
    "assert_decode_conformance",
    "reference_decode",
    "run_decode_conformance",
]

#: Every decode case name, in the order they run.
DECODE_CASES: tuple[str, ...] = (
    "paged", "causal_query_len_4", "max_query_len", "batch_1", "batch_33", "empty_batch",
    "out_buffer", "noncontiguous_q", "scales_per_call", "other_block_size", "nonfinite_keys",
    "reused_step_buffers", "fp8_cache", "fp8_ds_mla_cache")


def reference_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: Sequence[int], kv_lora_rank: int, scale: float,
                     k_scale: float = 1.0, *, kv_cache_format: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed paged decode in float64 on the host.

    ``q [B, Q, H, D]``, ``kv_cache [num_blocks, block_size, D]`` (any float dtype, float8
    included; with ``kv_cache_format="fp8_ds_mla"``, uint8 FlashMLA rows, dequantised by their
    own scales), ``block_table [B, *]``.
    Returns ``out [B, Q, H, kv_lora_rank]`` and ``lse [H, B, Q]`` (float64, natural log;
    head-major, as ``MLADecodeBackend.run_decode`` returns it); row i of request b sees keys
    ``[0, seq_lens[b] - Q + i]``."""
    batch, qlen, heads, dim = q.shape
    bs = int(kv_cache.shape[1])
    out = torch.zeros(batch, qlen, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.zeros(batch, qlen, heads, dtype=torch.float64)
    cache = dequantize_fp8_ds_mla(kv_cache.detach().cpu(), kv_lora_rank, dim - kv_lora_rank,
                                  torch.float64) if kv_cache_format == "fp8_ds_mla" else \
        kv_cache.detach().to("cpu", torch.float64)
    table = block_table.detach().to("cpu", torch.long)
    for b, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        kv = cache[table[b][pos // bs], pos % bs] * k_scale           # [L, D]
        for i in range(qlen):
            seen = kv[:seq_len - qlen + i + 1]
            qi = q[b, i].detach().to("cpu", torch.float64)            # [H, D]
            s = qi @ seen.t() * scale
            lg = torch.logsumexp(s, dim=-1)
            out[b, i] = torch.exp(s - lg.unsqueeze(-1)) @ seen[:, :kv_lora_rank]
            lse[b, i] = lg
    return out, lse.permute(2, 0, 1).contiguous()


_CaseFailure = CaseFailure


class _DecodeKit:
    """State shared by the cases of one run."""

    def __init__(self, backend_cls: type[MLADecodeBackend], device: torch.device,
                 dtype: torch.dtype, heads: int, rank: int, rope: int, block_size: int,
                 seed: int, tol: dict[str, float]) -> None:
        self.cls, self.device, self.dtype = backend_cls, device, dtype
        self.heads, self.rank, self.rope, self.bs, self.tol = heads, rank, rope, block_size, tol
        self.dim = rank + rope
        self.scale = 1.0 / math.sqrt(128 + rope)
        self.gen = torch.Generator().manual_seed(seed)

    def backend(self) -> MLADecodeBackend:
        return self.cls(num_heads=self.heads, scale=self.scale, kv_lora_rank=self.rank,
                        qk_rope_head_dim=self.rope, kv_cache_dtype=self.dtype,
                        device_capability=device_capability_of(self.device))

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def layout(self, seq_lens: Sequence[int], bs: int, share: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A random paged cache and block table: pages shuffled, odd requests share their
        first (full) page with the previous request, unused table entries -1, unused rows huge."""
        needed = [(n + bs - 1) // bs for n in seq_lens]
        width = max(needed, default=0) + 2
        num_blocks = sum(needed) + 3
        perm = torch.randperm(num_blocks, generator=self.gen).tolist()
        table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
        nxt = 0
        for b, n in enumerate(needed):
            for j in range(n):
                if share and b % 2 == 1 and j == 0 and min(seq_lens[b - 1], seq_lens[b]) >= bs:
                    table[b, j] = table[b - 1, 0]
                    continue
                table[b, j] = perm[nxt]
                nxt += 1
        cache = torch.randn(num_blocks, bs, self.dim, generator=self.gen)
        for b, n in enumerate(seq_lens):
            if n % bs and needed[b]:
                cache[int(table[b, needed[b] - 1]), n % bs:] = 1e4
        return cache.to(self.device, self.dtype), table.to(self.device)

    def run(self, seq_lens: Sequence[int], qlen: int, errors: dict[str, float], *,
            bs: int | None = None, strided_q: bool = False, out_buffer: bool = False,
            scales: Sequence[tuple[float | None, float | None]] = ((None, None),)) -> None:
        bs = self.bs if bs is None else bs
        cache, table = self.layout(seq_lens, bs)
        be = self.backend()
        be.prepare_metadata(MLADecodeMetadata.build(
            table, torch.tensor(seq_lens, dtype=torch.int32, device=self.device), qlen))
        shape = (len(seq_lens), qlen, self.heads, self.dim)
        q = self.randn(shape[2], shape[0], shape[1], shape[3] + 8)[..., 3:3 + self.dim] \
            .permute(1, 2, 0, 3) if strided_q else self.randn(*shape)
        if strided_q and q.is_contiguous() and q.numel():
            raise _CaseFailure("internal: q should be a non-contiguous view")
        for softmax_scale, k_scale in scales:
            ref = reference_decode(q, cache, table, seq_lens, self.rank,
                                   softmax_scale or self.scale, k_scale or 1.0)
            buf = torch.full((*shape[:3], self.rank), float("nan"), dtype=self.dtype,
                             device=self.device) if out_buffer else None
            result = be.run_decode(q, cache, out=buf, return_softmax_lse=True,
                                       softmax_scale=softmax_scale, k_scale=k_scale)
            if not isinstance(result, tuple) or len(result) != 2:
                raise _CaseFailure("run_decode(return_softmax_lse=True) must return (out, lse)")
            if buf is not None and result[0] is not buf:
                raise _CaseFailure("out= was not returned as the output")
            self.compare(f"scales {softmax_scale}, {k_scale}", result[0], result[1], ref,
                         errors)
            plain = be.run_decode(q, cache, softmax_scale=softmax_scale, k_scale=k_scale)
            if isinstance(plain, tuple):
                raise _CaseFailure("run_decode(return_softmax_lse=False) must return a tensor")
            self.compare("no LSE", plain, None, ref, errors)

    def compare(self, what: str, out: object, lse: object,
                ref: tuple[torch.Tensor, torch.Tensor], errors: dict[str, float]) -> None:
        ref_out, ref_lse = ref
        if not isinstance(out, torch.Tensor) or list(out.shape) != list(ref_out.shape) \
                or out.dtype != self.dtype:
            raise _CaseFailure(f"{what}: output must be a {self.dtype} tensor of shape "
                               f"{list(ref_out.shape)}, got {_describe(out)}")
        got = out.detach().to("cpu", torch.float64)
        if not torch.isfinite(got).all():
            raise _CaseFailure(f"{what}: output has non-finite values")
        errors["out"] = max(errors.get("out", 0.0), _max_abs(got, ref_out))
        if lse is None:
            return
        if not isinstance(lse, torch.Tensor) or list(lse.shape) != list(ref_lse.shape) \
                or lse.dtype != torch.float32:
            raise _CaseFailure(f"{what}: LSE must be float32 {list(ref_lse.shape)} [H, B, Q], "
                               f"got {_describe(lse)}")
        got_lse = lse.detach().to("cpu", torch.float64)
        if not torch.isfinite(got_lse).all():
            raise _CaseFailure(f"{what}: LSE has non-finite values")
        errors["lse"] = max(errors.get("lse", 0.0), _max_abs(got_lse, ref_lse))

    # -- the cases -------------------------------------------------------------------------

    def paged(self, errors: dict[str, float]) -> None:
        bs = self.bs
        self.run([1, bs + 1, bs, 2 * bs + 7, 3 * bs, 6 * bs + 3], 1, errors)

    def causal_query_len_4(self, errors: dict[str, float]) -> None:
        self.run([4, 5, self.bs + 3, 4 * self.bs, 70], 4, errors)

    def max_query_len(self, errors: dict[str, float]) -> None:
        n = self.cls.max_query_len
        self.run([n, n + 1, 3 * n + 5], n, errors)

    def batch_1(self, errors: dict[str, float]) -> None:
        self.run([1500], 1, errors)

    def batch_33(self, errors: dict[str, float]) -> None:
        lens = torch.randint(1, 120, (33,), generator=self.gen).tolist()
        self.run(lens, 1, errors)

    def empty_batch(self, errors: dict[str, float]) -> None:
        be = self.backend()
        be.prepare_metadata(torch.zeros(0, 4, dtype=torch.int32, device=self.device),
                            torch.zeros(0, dtype=torch.int32, device=self.device), 2)
        q = self.randn(0, 2, self.heads, self.dim)
        result = be.run_decode(q, self.randn(3, self.bs, self.dim), return_softmax_lse=True)
        if not isinstance(result, tuple) or list(result[0].shape) != [0, 2, self.heads,
                                                                       self.rank] \
                or list(result[1].shape) != [self.heads, 0, 2]:
            raise _CaseFailure(f"empty batch: expected out [0, 2, H, rank] and lse [H, 0, 2], "
                               f"got {_describe(result)}")

    def out_buffer(self, errors: dict[str, float]) -> None:
        self.run([3, self.bs * 2 + 1, 40], 2, errors, out_buffer=True)

    def noncontiguous_q(self, errors: dict[str, float]) -> None:
        self.run([7, self.bs + 9, 50], 3, errors, strided_q=True)

    def scales_per_call(self, errors: dict[str, float]) -> None:
        self.run([9, 2 * self.bs + 1], 2, errors,
                 scales=((0.01, None), (None, 2.0), (0.2, 0.5), (None, None)))

    def other_block_size(self, errors: dict[str, float]) -> None:
        sizes = [s for s in self.cls.supported_block_sizes if s != self.bs]
        bs = 5 if not self.cls.supported_block_sizes else sizes[0]
        self.run([2, bs, bs + 2, 9 * bs + 4], 2, errors, bs=bs)

    def nonfinite_keys(self, errors: dict[str, float]) -> None:
        seq_lens, qlen, bs = [3 * self.bs + 2, 9], 4, self.bs
        cache, table = self.layout(seq_lens, bs, share=False)
        for b, n in enumerate(seq_lens):                 # NaN in the unused rows: invisible
            if n % bs:
                cache[int(table[b, (n - 1) // bs]), n % bs:] = float("nan")
        last = seq_lens[0] - 1                           # request 0's last new token
        cache[int(table[0, last // bs]), last % bs, 5] = float("nan")
        be = self.backend()
        be.prepare_metadata(table, torch.tensor(seq_lens, dtype=torch.int32,
                                                device=self.device), qlen)
        q = self.randn(len(seq_lens), qlen, self.heads, self.dim)
        result = be.run_decode(q, cache, return_softmax_lse=True)
        out, lse = result[0].cpu(), result[1].cpu()
        finite = torch.isfinite(out.float()).all(dim=-1).cpu()          # [B, Q, H]
        expected = self._nonfinite_rows_allowed(finite, qlen)
        clean = cache.clone()
        clean[int(table[0, last // bs]), last % bs] = 0
        for b, n in enumerate(seq_lens):
            if n % bs:
                clean[int(table[b, (n - 1) // bs]), n % bs:] = 0
        ref = reference_decode(q, clean, table, seq_lens, self.rank, self.scale)
        keep = expected.unsqueeze(-1)
        hidden = ~expected.permute(2, 0, 1)                             # [H, B, Q], as the LSE
        self.compare("visible rows", torch.where(keep, out, 0), lse.masked_fill(hidden, 0),
                     (torch.where(keep, ref[0], 0), ref[1].masked_fill(hidden, 0)), errors)

    def _nonfinite_rows_allowed(self, finite: torch.Tensor, qlen: int) -> torch.Tensor:
        """The rows (``[B, Q, H]``) held to the reference after a NaN in the last new token
        of request 0: every row but its last when the backend declares
        ``isolates_nonfinite_keys``; else the rows that came out finite, where the last row
        of request 0 must not be one and only request 0's rows may be missing."""
        expected = torch.ones_like(finite)
        expected[0, qlen - 1] = False
        if self.cls.isolates_nonfinite_keys:
            if not torch.equal(finite, expected):
                raise _CaseFailure(
                    "NaN in the last new token of request 0 must make exactly its last query "
                    "row non-finite (the backend declares isolates_nonfinite_keys = True; a "
                    "kernel that cannot keep other rows of the step finite declares False); "
                    f"finite rows: {finite.tolist()}")
            return expected
        if bool(finite[0, qlen - 1].any()) or not bool(finite[1:].all()):
            raise _CaseFailure(
                "NaN in the last new token of request 0 must make its last query row "
                "non-finite, and no row of another request (isolates_nonfinite_keys = False "
                "lets only request 0's other rows of the step turn non-finite); finite rows: "
                f"{finite.tolist()}")
        return finite

    def reused_step_buffers(self, errors: dict[str, float]) -> None:
        """The caller rewrites the tensors it gave ``prepare_metadata`` between two layers (an
        engine reusing its buffers): the step must not change. Every rewritten value stays
        valid (other blocks, shorter requests), so a backend that reads the caller's tensors
        gives another step's answer here rather than reading out of bounds."""
        seq_lens, qlen = [2 * self.bs + 3, self.bs + 1, 9], 2
        cache, table = self.layout(seq_lens, self.bs)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        be = self.backend()
        be.prepare_metadata(table, lens, qlen)
        q = self.randn(len(seq_lens), qlen, self.heads, self.dim)
        ref = reference_decode(q, cache, table, seq_lens, self.rank, self.scale)
        first = be.run_decode(q, cache, return_softmax_lse=True)
        self.compare("layer 0", first[0], first[1], ref, errors)
        num_blocks = int(cache.shape[0])
        table.copy_(torch.where(table >= 0, (table + 1) % num_blocks, table))
        lens.fill_(qlen)
        second = be.run_decode(q, cache, return_softmax_lse=True)
        self.compare("layer 1, after the caller rewrote its block table and seq_lens",
                     second[0], second[1], ref, errors)


    # -- FP8 caches (issue 36) ----------------------------------------------------------------

    def fp8_cache(self, errors: dict[str, float]) -> None:
        """e4m3 with one scale per layer, passed per call (two scales: nothing is cached)."""
        for seq_lens, qlen in (([1, self.bs + 1, 2 * self.bs + 7, 70], 1),
                               ([4, self.bs + 3, 70], 4)):
            latent, table = self.layout(seq_lens, self.bs)
            used = latent.float().abs()
            layer_scale = float(fp8_power_of_two_scale(used[used < 1e3].amax()))  # not 1e4s
            cache, _ = quantize_fp8_per_layer(latent.cpu(), layer_scale)
            for k_scale in (layer_scale, 2 * layer_scale):
                self._fp8_run("fp8", cache.to(self.device), table, seq_lens, qlen, k_scale)
        self._fp8_nan("fp8")

    def fp8_ds_mla_cache(self, errors: dict[str, float]) -> None:
        """FlashMLA rows as this package writes them and as vLLM does (``amax / 448``)."""
        for seq_lens, qlen in (([1, self.bs + 1, 2 * self.bs + 7, 70], 1),
                               ([4, self.bs + 3, 70], 4)):
            latent, table = self.layout(seq_lens, self.bs)
            latent = latent.float().cpu()
            latent[..., :self.rank] *= torch.tensor([0.02, 1.0, 9.0, 0.5]).repeat_interleave(
                128).repeat(self.rank // 512 + 1)[:self.rank]      # tiles of other sizes
            for rows in (quantize_fp8_ds_mla(latent, self.rank), _vllm_ds_mla(latent, self.rank)):
                self._fp8_run("fp8_ds_mla", rows.to(self.device), table, seq_lens, qlen, 1.0)
        self._fp8_nan("fp8_ds_mla")

    def _fp8_backend(self, fmt: str) -> MLADecodeBackend:
        return self.cls(num_heads=self.heads, scale=self.scale, kv_lora_rank=self.rank,
                        qk_rope_head_dim=self.rope, kv_cache_dtype=fmt,
                        device_capability=device_capability_of(self.device))

    def _fp8_run(self, fmt: str, cache: torch.Tensor, table: torch.Tensor,
                 seq_lens: Sequence[int], qlen: int, k_scale: float) -> None:
        ds = fmt == "fp8_ds_mla"
        for b, n in enumerate(seq_lens):      # unused rows of last blocks: NaN, never read
            needed = (n + self.bs - 1) // self.bs
            if n % self.bs and needed:
                view = cache.view(torch.uint8)
                view[int(table[b, needed - 1]), n % self.bs:] = 0xFF
        be = self._fp8_backend(fmt)
        be.prepare_metadata(table, torch.tensor(seq_lens, dtype=torch.int32,
                                                device=self.device), qlen)
        q = self.randn(len(seq_lens), qlen, self.heads, self.dim)
        result = be.run_decode(q, cache, return_softmax_lse=True,
                               k_scale=None if ds else k_scale)
        out, lse = result[0], result[1]
        seen_q = q.float()          # the query as the kernel sees it
        if be.fp8_query():
            q_scale = float(seen_q.abs().amax()) / 448.0 or 1.0
            seen_q = quantize_fp8_per_layer(seen_q.cpu(), q_scale)[0].float() * q_scale
        bounds = [fp8_cache_decode_bounds(
            seen_q, cache, table, seq_lens, self.rank, self.scale, k_scale,
            output_dtype=self.dtype, kv_cache_format="fp8_ds_mla" if ds else "auto",
            rounded_normaliser=normaliser) for normaliser in (False, True)]
        # whichever way the kernel normalises its rounded probabilities
        widest = DecodeErrorBounds(out=torch.maximum(bounds[0].out, bounds[1].out),
                                   lse=torch.maximum(bounds[0].lse, bounds[1].lse),
                                   reference_out=bounds[0].reference_out,
                                   reference_lse=bounds[0].reference_lse)
        out_ratio, lse_ratio = widest.worst_ratios(out, lse)
        if not (out_ratio <= 1.0 and lse_ratio <= 1.0):
            raise _CaseFailure(f"{fmt} cache (k_scale {k_scale:g}, query_len {qlen}): an error "
                               f"beyond the FP8 bounds (largest error / bound: output "
                               f"{out_ratio:.3g}, LSE {lse_ratio:.3g})")

    def _fp8_nan(self, fmt: str) -> None:
        """A NaN in the stored latent of request 0's last new token: its last query row is
        non-finite (e4m3 has no infinity; the cache keeps the NaN), and the other rows follow
        the backend's ``isolates_nonfinite_keys`` as in ``nonfinite_keys``."""
        seq_lens, qlen = [2 * self.bs + 3, 9], 4
        latent, table = self.layout(seq_lens, self.bs, share=False)
        latent = latent.float().cpu()
        last = seq_lens[0] - 1
        latent[int(table[0, last // self.bs]), last % self.bs, 7] = float("nan")
        if fmt == "fp8_ds_mla":
            cache = quantize_fp8_ds_mla(latent, self.rank)
        else:
            cache, _ = quantize_fp8_per_layer(latent, float(fp8_power_of_two_scale(
                latent.nan_to_num().abs().amax())))
        be = self._fp8_backend(fmt)
        be.prepare_metadata(table, torch.tensor(seq_lens, dtype=torch.int32,
                                                device=self.device), qlen)
        q = self.randn(len(seq_lens), qlen, self.heads, self.dim)
        out = be.run_decode(q, cache.to(self.device))
        if not isinstance(out, torch.Tensor):
            raise _CaseFailure("run_decode(return_softmax_lse=False) must return a tensor")
        finite = torch.isfinite(out.float()).all(dim=-1).cpu()          # [B, Q, H]
        try:
            self._nonfinite_rows_allowed(finite, qlen)
        except _CaseFailure as failure:
            raise _CaseFailure(f"{fmt} cache: {failure}") from None


def _vllm_ds_mla(latent: torch.Tensor, rank: int) -> torch.Tensor:
    """``fp8_ds_mla`` rows with vLLM's scales (``max(amax / 448, FLT_MIN)`` per tile, not a
    power of two): what a reader of a vLLM-written cache meets."""
    lead = latent.shape[:-1]
    nope = latent[..., :rank].reshape(*lead, rank // 128, 128)
    scales = (nope.abs().amax(-1) / 448).clamp_min(torch.finfo(torch.float32).tiny)
    q8 = (nope / scales.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch.cat([q8.reshape(*lead, rank).view(torch.uint8),
                      scales.contiguous().view(torch.uint8).reshape(*lead, -1),
                      latent[..., rank:].bfloat16().contiguous().view(torch.uint8)
                      .reshape(*lead, -1)], dim=-1)


def run_decode_conformance(backend_cls: type[MLADecodeBackend], *,
                           device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.bfloat16, num_heads: int = 16,
                           kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                           block_size: int | None = None, seed: int = 0,
                           cases: Sequence[str] | None = None,
                           tolerances: dict[str, float] | None = None) -> ConformanceReport:
    """Run the decode kit on ``backend_cls``; return the report (a failing case never raises).

    ``block_size`` defaults to 16, or the backend's first supported block size; ``cases``
    picks a subset of ``DECODE_CASES`` and ``SPARSE_DECODE_CASES`` (default: the dense cases
    for a backend that ``supports_dense``, then the sparse ones for one that
    ``supports_sparse``)."""
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, MLADecodeBackend)):
        raise TypeError(f"run_decode_conformance: expected an MLADecodeBackend subclass, "
                        f"got {backend_cls!r}")
    device = kit_device("run_decode_conformance", device)
    check_seed("run_decode_conformance: seed", seed)
    if dtype not in DEFAULT_TOLERANCES and tolerances is None:
        raise ValueError(f"run_decode_conformance: no default tolerances for {dtype}; "
                         f"pass tolerances")
    known = (*DECODE_CASES, *SPARSE_DECODE_CASES)
    names = list(cases) if cases is not None else [
        *(DECODE_CASES if backend_cls.supports_dense else ()),
        *(SPARSE_DECODE_CASES if backend_cls.supports_sparse else ())]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"run_decode_conformance: unknown case(s) {unknown}; known: "
                         f"{list(known)}")
    sizes = list(backend_cls.supported_block_sizes)
    bs = block_size if block_size is not None else (sizes[0] if sizes else 16)
    capability = device_capability_of(device)
    reasons = {pattern: backend_cls.validate_configuration(capability, MLADecodeSelectorConfig(
        dtype=dtype, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        num_heads=num_heads, block_size=bs, query_len=1, index_topk=topk))
        for pattern, topk in (("dense", None), ("sparse", SPARSE_KIT_TOPK))}
    name = backend_cls.get_name()
    if reasons["dense"] and reasons["sparse"]:
        return ConformanceReport(backend=name, device=str(device), dtype=str(dtype), cases=(),
                                 unsupported=tuple(reasons["dense" if backend_cls.supports_dense
                                                           else "sparse"]))
    tol = dict(DEFAULT_TOLERANCES.get(dtype, {}))
    tol.update(tolerances or {})
    kit = _DecodeKit(backend_cls, device, dtype, num_heads, kv_lora_rank, qk_rope_head_dim,
                     bs, seed, tol)
    skipped = {"other_block_size": "one block size supported"} if len(sizes) == 1 else {}
    for pattern, pattern_cases in (("dense", DECODE_CASES), ("sparse", SPARSE_DECODE_CASES)):
        if reasons[pattern]:
            skipped.update(dict.fromkeys(pattern_cases, "; ".join(reasons[pattern])))
    skipped.update(_fp8_skips(backend_cls, device, dtype, num_heads, kv_lora_rank,
                              qk_rope_head_dim, bs))
    dense = run_cases(kit, [n for n in names if n in DECODE_CASES], backend=name,
                      device=device, dtype=dtype, tolerances=tol, skipped=skipped)
    sparse_kit = _SparseDecodeKit(backend_cls, device=device, dtype=dtype, heads=num_heads,
                                  rank=kv_lora_rank, rope=qk_rope_head_dim, block_size=bs,
                                  seed=seed)
    sparse = run_cases(sparse_kit, [n for n in names if n in SPARSE_DECODE_CASES],
                       backend=name, device=device, dtype=dtype, tolerances=tol,
                       skipped=skipped)
    by_name = {c.name: c for c in (*dense.cases, *sparse.cases)}
    return attrs.evolve(dense, cases=tuple(by_name[n] for n in names))


def _fp8_skips(backend_cls: type[MLADecodeBackend], device: torch.device, dtype: torch.dtype,
               heads: int, rank: int, rope: int, block_size: int) -> dict[str, str]:
    """The FP8 cases the backend cannot run here, with the selection's reasons."""
    skips = {}
    for case, name in (("fp8_cache", "fp8"), ("fp8_ds_mla_cache", "fp8_ds_mla")):
        reasons = backend_cls.validate_configuration(
            device_capability_of(device), MLADecodeSelectorConfig(
                dtype=dtype, kv_lora_rank=rank, qk_rope_head_dim=rope, num_heads=heads,
                block_size=block_size, query_len=4, kv_cache_dtype=name))
        if name == "fp8_ds_mla" and rank % 128:
            reasons = [*reasons, f"kv_lora_rank {rank} is not a multiple of 128"]
        if not reasons:     # declared, but the kernel for this device may still refuse it
            try:
                backend_cls(num_heads=heads, scale=0.1, kv_lora_rank=rank,
                            qk_rope_head_dim=rope, kv_cache_dtype=name,
                            device_capability=device_capability_of(device))
            except (TypeError, ValueError) as exc:
                reasons = [f"the backend refuses to be built for it: {exc}"]
        if reasons:
            skips[case] = f"{name} cache: " + "; ".join(reasons)
    return skips


def assert_decode_conformance(backend_cls: type[MLADecodeBackend], *,
                              device: torch.device | str = "cpu",
                              dtype: torch.dtype = torch.bfloat16, **kwargs: object
                              ) -> ConformanceReport:
    """``run_decode_conformance`` that raises ``AssertionError`` with the report when a case
    fails or the backend cannot run on this device/dtype (keyword arguments are passed on);
    returns the report otherwise, as ``assert_conformance`` does."""
    report = run_decode_conformance(backend_cls, device=device, dtype=dtype,
                                    **kwargs)  # type: ignore[arg-type]
    if not report.passed:
        raise AssertionError(report.format())
    return report
