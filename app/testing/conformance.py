"""A conformance kit for MLA prefill backends: built-in or third party.

It builds a backend from its class, feeds it random ragged batches and compares every output and
LSE with a float64 reference (``reference_attention``) computed from the same inputs. The cases:

=========================  ==================================================================
``causal_new_tokens``      ragged causal prefill (incl. 1-token requests); LSE and no-LSE calls
``context_chunks``         two non-causal context chunks with some empty per-request contexts
``empty_context_chunk``    a chunk with no context at all: out 0, LSE ``-inf`` everywhere
``kv_longer_than_q``       causal with more keys than queries (``new_kv_lens``, bottom-right)
``q_longer_than_kv``       causal with fewer keys than queries: leading rows see no key
``noncontiguous_v``        ``k``/``v`` as views of one fused ``[T, H, nope + v]`` projection
``out_buffer``             ``out=`` is written in place (only when ``supports_out``)
``merged_prefill``         chunks and new tokens merged with ``merge_attn_states`` equal
                           attention over all keys
``long_causal``            (``long_case=True``) one 1100-token causal request
=========================  ==================================================================

A backend that declares ``supports_sparse`` also runs ``SPARSE_PREFILL_CASES``
(``app.testing.sparse_conformance``: the absorbed form over selected latent rows, with repeats,
-1 padding, fewer candidates than k, k larger than the context, context chunks merged by LSE);
one that does not declare ``supports_dense`` runs only those.

Run it on your backend (any ``MLAPrefillBackend`` subclass)::

    from app.testing import assert_conformance, run_conformance

    report = run_conformance(MyBackend, device="cuda", dtype=torch.bfloat16)
    text = report.format()                 # one line per case: max errors vs tolerances

    def test_my_backend_conforms():          # in pytest
        assert_conformance(MyBackend, device="cuda", dtype=torch.bfloat16)

One runner serves this kit and the decode kit (``app.testing.decode_conformance``):
``run_cases`` runs a kit's cases and returns a ``ConformanceReport``, which both
``run_conformance`` and ``run_decode_conformance`` return and both ``assert_*`` functions return
once it passed.

``assert_conformance`` raises ``AssertionError`` with the readable report when a case fails or
when the backend's ``validate_configuration`` rejects the device/dtype (pass
``allow_unsupported=True`` to get a skipped report instead). Tolerances are absolute, per input
dtype (``DEFAULT_TOLERANCES``); pass ``tolerances={"out": ..., "lse": ...}`` to override.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from app._types import DeviceCapability, MLADimensions
from app._validation import check_seed
from app.backends.merge import merge_attn_states
from app.backends.prefill.base import (
    MLAPrefillBackend,
    MLAPrefillMetadata,
    MLAPrefillSelectorConfig,
)
from app.testing._kit import CaseFailure, device_capability_of
from app.testing._kit import max_abs_error as _max_abs
from app.testing.sparse_conformance import (
    SPARSE_KIT_TOPK,
    SPARSE_PREFILL_CASES,
    _SparsePrefillKit,
)

__all__ = [
    "CASES",
    "DEFAULT_TOLERANCES",
    "CaseFailure",
    "CaseResult",
    "ConformanceReport",
    "assert_conformance",
    "device_capability_of",
    "kit_device",
    "reference_attention",
    "run_cases",
    "run_conformance",
]

#: Absolute tolerances on the output and on the LSE, per input dtype.
DEFAULT_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"out": 5e-4, "lse": 5e-4},
    torch.float16: {"out": 1e-2, "lse": 1e-2},
    torch.bfloat16: {"out": 4e-2, "lse": 2e-2},
}

#: Every case name, in the order they run.
CASES: tuple[str, ...] = (
    "causal_new_tokens", "context_chunks", "empty_context_chunk", "kv_longer_than_q",
    "q_longer_than_kv", "noncontiguous_v", "out_buffer", "merged_prefill", "long_causal")

_DEEPSEEK = MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_q: Sequence[int], cu_kv: Sequence[int], causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention in float64: ``out [T, H, Dv]`` and ``lse [H, T]`` (natural log).

    Causal masks are bottom-right aligned (query i of a request sees key j iff
    ``j <= i + kv_len - q_len``); rows that see no key get out 0 and LSE ``-inf``.
    """
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads, tokens), float("-inf"), dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_kv[b]), int(cu_kv[b + 1])
        q_len, kv_len = qe - qs, ke - ks
        if q_len == 0 or kv_len == 0:
            continue
        qb = q[qs:qe].detach().to("cpu", torch.float64).transpose(0, 1)
        kb = k[ks:ke].detach().to("cpu", torch.float64).transpose(0, 1)
        vb = v[ks:ke].detach().to("cpu", torch.float64).transpose(0, 1)
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale
        if causal:
            hidden = torch.ones(q_len, kv_len, dtype=torch.bool).triu(kv_len - q_len + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        lg = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lg.unsqueeze(-1)).nan_to_num(nan=0.0)
        out[qs:qe] = torch.matmul(probs, vb).transpose(0, 1)
        lse[:, qs:qe] = lg
    return out, lse


@attrs.frozen
class CaseResult:
    """One case: the largest absolute errors against the reference, and the verdict."""

    name: str
    passed: bool
    out_error: float | None = None
    lse_error: float | None = None
    out_tolerance: float | None = None
    lse_tolerance: float | None = None
    skipped: str | None = None
    message: str | None = None

    def format(self) -> str:
        """One readable line."""
        if self.skipped is not None:
            return f"SKIP  {self.name:22s} {self.skipped}"
        verdict = "PASS" if self.passed else "FAIL"
        parts = [f"{verdict}  {self.name:22s}"]
        if self.out_error is not None:
            parts.append(f"out {self.out_error:.2e} (tol {self.out_tolerance:.0e})")
        if self.lse_error is not None:
            parts.append(f"lse {self.lse_error:.2e} (tol {self.lse_tolerance:.0e})")
        if self.message:
            parts.append(self.message)
        return "  ".join(parts)


@attrs.frozen
class ConformanceReport:
    """The results of one backend on one device and dtype."""

    backend: str
    device: str
    dtype: str
    cases: tuple[CaseResult, ...]
    unsupported: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when every case that ran passed and the backend could run here."""
        return not self.unsupported and all(c.passed or c.skipped is not None
                                            for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        """The cases that ran and failed."""
        return [c for c in self.cases if not c.passed and c.skipped is None]

    def format(self) -> str:
        """A readable multi-line report."""
        head = f"conformance of {self.backend} on {self.device} ({self.dtype}): "
        if self.unsupported:
            return head + "not supported here: " + "; ".join(self.unsupported)
        lines = [head + ("PASS" if self.passed else f"FAIL ({len(self.failures)} case(s))")]
        lines += ["  " + c.format() for c in self.cases]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form."""
        return {"backend": self.backend, "device": self.device, "dtype": self.dtype,
                "passed": self.passed, "unsupported": list(self.unsupported),
                "cases": [attrs.asdict(c) for c in self.cases]}

    def __str__(self) -> str:
        return self.format()


_CaseFailure = CaseFailure


def run_cases(kit: object, names: Sequence[str], *, backend: str, device: torch.device,
              dtype: torch.dtype, tolerances: Mapping[str, float],
              skipped: Mapping[str, str] | None = None) -> ConformanceReport:
    """Run each case ``name`` of ``kit`` (a method taking the dict it records its largest
    ``"out"`` / ``"lse"`` errors in) and return the report: the runner of both kits. A case
    in ``skipped`` is reported skipped with its reason; one that raises ``CaseFailure`` or
    anything else fails with the message (a failing case never raises)."""
    results = []
    for case in names:
        if skipped and case in skipped:
            results.append(CaseResult(case, True, skipped=skipped[case]))
            continue
        errors: dict[str, float] = {}
        runner: Callable[[dict[str, float]], None] = getattr(kit, case)
        try:
            runner(errors)
        except CaseFailure as exc:
            results.append(CaseResult(case, False, message=str(exc)))
            continue
        except Exception as exc:  # a crashing backend is a failed case
            tail = traceback.format_exception_only(type(exc), exc)[-1].strip()
            results.append(CaseResult(case, False, message=f"raised {tail}\n"
                                      f"{traceback.format_exc(limit=3)}"))
            continue
        out_err, lse_err = errors.get("out"), errors.get("lse")
        ok = ((out_err is None or out_err <= tolerances["out"])
              and (lse_err is None or lse_err <= tolerances["lse"]))
        results.append(CaseResult(case, ok, out_err, lse_err, tolerances["out"],
                                  tolerances["lse"]))
    return ConformanceReport(backend=backend, device=str(device), dtype=str(dtype),
                             cases=tuple(results))


class _Kit:
    """State shared by the cases of one run."""

    def __init__(self, backend_cls: type[MLAPrefillBackend], device: torch.device,
                 dtype: torch.dtype, dims: MLADimensions, num_heads: int, seed: int,
                 tolerances: dict[str, float], capability: DeviceCapability | None) -> None:
        self.backend_cls, self.device, self.dtype = backend_cls, device, dtype
        self.capability = capability
        self.dims, self.heads, self.tol = dims, num_heads, tolerances
        self.scale = 1.0 / math.sqrt(dims.qk_head_dim)
        self.gen = torch.Generator().manual_seed(seed)

    def backend(self) -> MLAPrefillBackend:
        d = self.dims
        return self.backend_cls(num_heads=self.heads, scale=self.scale, kv_lora_rank=512,
                                qk_nope_head_dim=d.qk_nope_head_dim,
                                qk_rope_head_dim=d.qk_rope_head_dim, v_head_dim=d.v_head_dim,
                                device_capability=self.capability)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def qkv(self, tokens: int, kv_tokens: int) -> tuple[torch.Tensor, ...]:
        return (self.randn(tokens, self.heads, self.dims.qk_head_dim),
                self.randn(kv_tokens, self.heads, self.dims.qk_head_dim),
                self.randn(kv_tokens, self.heads, self.dims.v_head_dim))

    def metadata(self, query_lens: Sequence[int], chunks: Sequence[Sequence[int]] = (),
                 new_kv_lens: Sequence[int] | None = None) -> MLAPrefillMetadata:
        return MLAPrefillMetadata.build(query_lens, chunks, device=self.device,
                                        new_kv_lens=new_kv_lens)

    def compare(self, what: str, out: object, lse: object, ref_out: torch.Tensor,
                ref_lse: torch.Tensor | None, errors: dict[str, float]) -> None:
        """Check shapes/dtypes, then accumulate the max abs errors of ``what``."""
        if not isinstance(out, torch.Tensor):
            raise _CaseFailure(f"{what}: output is {type(out).__name__}, not a tensor")
        if list(out.shape) != list(ref_out.shape):
            raise _CaseFailure(f"{what}: output shape {list(out.shape)}, expected "
                               f"{list(ref_out.shape)}")
        got = out.detach().to("cpu", torch.float64)
        if torch.isnan(got).any():
            raise _CaseFailure(f"{what}: output has NaN")
        errors["out"] = max(errors.get("out", 0.0), _max_abs(got, ref_out))
        if ref_lse is None:
            return
        if not isinstance(lse, torch.Tensor):
            raise _CaseFailure(f"{what}: LSE is {type(lse).__name__}, not a tensor")
        if list(lse.shape) != list(ref_lse.shape) or lse.dtype != torch.float32:
            raise _CaseFailure(f"{what}: LSE is {list(lse.shape)} {lse.dtype}, expected "
                               f"{list(ref_lse.shape)} torch.float32 [H, T]")
        if not lse.is_contiguous():
            raise _CaseFailure(f"{what}: LSE is not contiguous")
        got_lse = lse.detach().to("cpu", torch.float64)
        if torch.isnan(got_lse).any():
            raise _CaseFailure(f"{what}: LSE has NaN")
        empty = torch.isneginf(ref_lse)
        if not torch.equal(torch.isneginf(got_lse), empty):
            bad = int((torch.isneginf(got_lse) != empty).sum())
            raise _CaseFailure(f"{what}: {bad} LSE entries disagree on -inf (rows that see "
                               f"no key must have LSE -inf, and only those)")
        if empty.any() and got[empty.t()].abs().max().item() != 0.0:
            raise _CaseFailure(f"{what}: rows that see no key must have output 0")
        finite = ~empty
        if finite.any():
            errors["lse"] = max(errors.get("lse", 0.0), _max_abs(got_lse[finite],
                                                                  ref_lse[finite]))

    # -- the cases -------------------------------------------------------------------------

    def _causal(self, query_lens: Sequence[int], new_kv_lens: Sequence[int] | None,
                errors: dict[str, float]) -> None:
        md = self.metadata(query_lens, new_kv_lens=new_kv_lens)
        be = self.backend()
        be.prepare_metadata(md)
        q, k, v = self.qkv(md.total_q, md.total_new_kv)
        ref = reference_attention(q, k, v, md.cu_seqlens_q_cpu.tolist(),
                                  md.cu_seqlens_kv_new_cpu.tolist(), True, self.scale)
        result = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
        if not isinstance(result, tuple) or len(result) != 2:
            raise _CaseFailure("run_prefill_new_tokens(return_softmax_lse=True) must return "
                               "(out, lse)")
        self.compare("new tokens", result[0], result[1], *ref, errors)
        plain = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
        if isinstance(plain, tuple):
            raise _CaseFailure("run_prefill_new_tokens(return_softmax_lse=False) must return "
                               "a tensor")
        self.compare("new tokens (no LSE)", plain, None, ref[0], None, errors)

    def causal_new_tokens(self, errors: dict[str, float]) -> None:
        self._causal([37, 1, 150, 64, 5, 90], None, errors)

    def kv_longer_than_q(self, errors: dict[str, float]) -> None:
        self._causal([16, 5, 40, 70], [40, 5, 100, 150], errors)

    def q_longer_than_kv(self, errors: dict[str, float]) -> None:
        self._causal([16, 9, 30], [10, 9, 0], errors)

    def long_causal(self, errors: dict[str, float]) -> None:
        self._causal([1100], None, errors)

    def _chunks(self, query_lens: Sequence[int], chunk_lens: Sequence[Sequence[int]],
                errors: dict[str, float], fused_v: bool = False) -> None:
        md = self.metadata(query_lens, chunk_lens)
        be = self.backend()
        be.prepare_metadata(md)
        q = self.randn(md.total_q, self.heads, self.dims.qk_head_dim)
        for i, chunk in enumerate(md.context_chunks):
            if fused_v:
                nope, dv = self.dims.qk_nope_head_dim, self.dims.v_head_dim
                kv = self.randn(chunk.total_kv, self.heads, nope + dv)
                rope = self.randn(chunk.total_kv, 1, self.dims.qk_rope_head_dim)
                k = torch.cat([kv[..., :nope], rope.expand(-1, self.heads, -1)], dim=-1)
                v = kv[..., nope:]
                if v.is_contiguous() and v.numel():
                    raise _CaseFailure("internal: v should be a non-contiguous view")
            else:
                _, k, v = self.qkv(0, chunk.total_kv)
            ref = reference_attention(q, k, v, md.cu_seqlens_q_cpu.tolist(),
                                      chunk.cu_seqlens_kv_cpu.tolist(), False, self.scale)
            result = be.run_prefill_context_chunk(i, q, k, v)
            if not isinstance(result, tuple) or len(result) != 2:
                raise _CaseFailure("run_prefill_context_chunk must return (out, lse)")
            self.compare(f"chunk {i}", result[0], result[1], *ref, errors)

    def context_chunks(self, errors: dict[str, float]) -> None:
        self._chunks([37, 1, 150, 64, 5], [[50, 0, 20, 7, 100], [10, 30, 0, 0, 64]], errors)

    def empty_context_chunk(self, errors: dict[str, float]) -> None:
        self._chunks([12, 3, 40], [[0, 0, 0]], errors)

    def noncontiguous_v(self, errors: dict[str, float]) -> None:
        self._chunks([24, 7, 66], [[33, 0, 70]], errors, fused_v=True)

    def out_buffer(self, errors: dict[str, float]) -> None:
        md = self.metadata([20, 3, 70], [[15, 0, 40]])
        be = self.backend()
        be.prepare_metadata(md)
        q, k, v = self.qkv(md.total_q, md.total_new_kv)
        ck, cv = self.qkv(0, md.context_chunks[0].total_kv)[1:]
        ref_new = reference_attention(q, k, v, md.cu_seqlens_q_cpu.tolist(),
                                      md.cu_seqlens_kv_new_cpu.tolist(), True, self.scale)
        ref_ctx = reference_attention(q, ck, cv, md.cu_seqlens_q_cpu.tolist(),
                                      md.context_chunks[0].cu_seqlens_kv_cpu.tolist(), False,
                                      self.scale)
        for what, ref in (("new tokens", ref_new), ("chunk 0", ref_ctx)):
            buf = torch.full((md.total_q, self.heads, self.dims.v_head_dim), float("nan"),
                             dtype=self.dtype, device=self.device)
            result: object = (be.run_prefill_new_tokens(q, k, v, True, out=buf)
                              if what == "new tokens"
                              else be.run_prefill_context_chunk(0, q, ck, cv, out=buf))
            if not isinstance(result, tuple) or result[0].data_ptr() != buf.data_ptr():
                raise _CaseFailure(f"{what}: out= was not returned as the output")
            self.compare(f"{what} (out=)", buf, result[1], *ref, errors)

    def merged_prefill(self, errors: dict[str, float]) -> None:
        query_lens, chunk_lens = [30, 4, 90], [[25, 0, 60], [40, 8, 0]]
        md = self.metadata(query_lens, chunk_lens)
        be = self.backend()
        be.prepare_metadata(md)
        q, k, v = self.qkv(md.total_q, md.total_new_kv)
        parts = [self.qkv(0, c.total_kv)[1:] for c in md.context_chunks]
        result = be.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
        if not isinstance(result, tuple):
            raise _CaseFailure("run_prefill_new_tokens(return_softmax_lse=True) returned no LSE")
        out, lse = result
        for i, (ck, cv) in enumerate(parts):
            c_out, c_lse = be.run_prefill_context_chunk(i, q, ck, cv)
            out, lse = merge_attn_states(c_out, c_lse, out, lse)
        # Reference: every request attends [chunk 0; chunk 1; new tokens], causal bottom-right.
        keys, values, cu_all = [], [], [0]
        cu_chunks = [c.cu_seqlens_kv_cpu.tolist() for c in md.context_chunks]
        cu_new = md.cu_seqlens_kv_new_cpu.tolist()
        for b in range(len(query_lens)):
            for (ck, cv), cu in zip(parts, cu_chunks, strict=True):
                keys.append(ck[cu[b]:cu[b + 1]])
                values.append(cv[cu[b]:cu[b + 1]])
            keys.append(k[cu_new[b]:cu_new[b + 1]])
            values.append(v[cu_new[b]:cu_new[b + 1]])
            cu_all.append(cu_all[-1] + sum(c[b + 1] - c[b] for c in cu_chunks)
                          + cu_new[b + 1] - cu_new[b])
        ref = reference_attention(q, torch.cat(keys), torch.cat(values),
                                  md.cu_seqlens_q_cpu.tolist(), cu_all, True, self.scale)
        self.compare("merged", out, lse, *ref, errors)


def _pick_dims(backend_cls: type[MLAPrefillBackend], dims: MLADimensions | None
               ) -> MLADimensions:
    if dims is not None:
        return dims
    supported = list(backend_cls.supported_mla_dimensions)
    return _DEEPSEEK if not supported or _DEEPSEEK in supported else supported[0]


def kit_device(who: str, device: object) -> torch.device:
    """``device`` as a ``torch.device`` a kit can run on; ``ValueError`` naming ``who`` for a
    name torch does not know (``"tpu"``) or a CUDA device on a machine without CUDA."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{who}: device must be a name ('cpu', 'cuda:0') or a torch.device, "
                        f"got {device!r} ({type(device).__name__})")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{who}: device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{who}: device {device!r}: CUDA is not available here "
                         f"(torch {torch.__version__})")
    return dev


def run_conformance(backend_cls: type[MLAPrefillBackend], *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, dims: MLADimensions | None = None,
                    num_heads: int = 8, seed: int = 0, cases: Sequence[str] | None = None,
                    long_case: bool = False, tolerances: dict[str, float] | None = None,
                    device_capability: DeviceCapability | None = None) -> ConformanceReport:
    """Run the kit on ``backend_cls`` and return the report (never raises for a failing case).

    ``device_capability`` is handed to every backend the kit builds (as the container does);
    default: the capability of ``device`` (None on a CPU).

    ``dims`` defaults to DeepSeek's (128, 64, 128), or the backend's first supported dims;
    ``cases`` picks a subset of ``CASES`` and ``SPARSE_PREFILL_CASES`` (default: the dense
    cases for a backend that ``supports_dense``, then the sparse ones, in the absorbed form
    with ``kv_lora_rank`` 512, for one that ``supports_sparse``); ``long_case`` adds the
    1100-token causal case.
    """
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, MLAPrefillBackend)):
        raise TypeError(f"run_conformance: expected an MLAPrefillBackend subclass, "
                        f"got {backend_cls!r}")
    device = kit_device("run_conformance", device)
    check_seed("run_conformance: seed", seed)
    if dtype not in DEFAULT_TOLERANCES and tolerances is None:
        raise ValueError(f"run_conformance: no default tolerances for {dtype}; pass tolerances")
    known = (*CASES, *SPARSE_PREFILL_CASES)
    names = list(cases) if cases is not None else [
        *(c for c in CASES if backend_cls.supports_dense and (c != "long_causal" or long_case)),
        *(SPARSE_PREFILL_CASES if backend_cls.supports_sparse else ())]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"run_conformance: unknown case(s) {unknown}; known: {list(known)}")
    chosen = _pick_dims(backend_cls, dims)
    name = backend_cls.get_name()
    capability = device_capability_of(device) if device_capability is None \
        else device_capability
    reasons = {pattern: backend_cls.validate_configuration(capability, MLAPrefillSelectorConfig(
        dtype=dtype, mla_dimensions=chosen, index_topk=topk))
        for pattern, topk in (("dense", None), ("sparse", SPARSE_KIT_TOPK))}
    if reasons["dense"] and reasons["sparse"]:
        return ConformanceReport(backend=name, device=str(device), dtype=str(dtype), cases=(),
                                 unsupported=tuple(reasons["dense" if backend_cls.supports_dense
                                                           else "sparse"]))
    tol = dict(DEFAULT_TOLERANCES.get(dtype, {}))
    tol.update(tolerances or {})
    kit = _Kit(backend_cls, device, dtype, chosen, num_heads, seed, tol, capability)
    skipped = {} if backend_cls.supports_out else {"out_buffer": "supports_out is False"}
    for pattern, pattern_cases in (("dense", CASES), ("sparse", SPARSE_PREFILL_CASES)):
        if reasons[pattern]:
            skipped.update(dict.fromkeys(pattern_cases, "; ".join(reasons[pattern])))
    dense = run_cases(kit, [n for n in names if n in CASES], backend=name, device=device,
                      dtype=dtype, tolerances=tol, skipped=skipped)
    sparse_kit = _SparsePrefillKit(backend_cls, device=device, dtype=dtype, heads=num_heads,
                                   rank=512, rope=chosen.qk_rope_head_dim, block_size=16,
                                   seed=seed)
    sparse = run_cases(sparse_kit, [n for n in names if n in SPARSE_PREFILL_CASES],
                       backend=name, device=device, dtype=dtype, tolerances=tol,
                       skipped=skipped)
    by_name = {c.name: c for c in (*dense.cases, *sparse.cases)}
    return attrs.evolve(dense, cases=tuple(by_name[n] for n in names))


def assert_conformance(backend_cls: type[MLAPrefillBackend], *, allow_unsupported: bool = False,
                       **kwargs: Any) -> ConformanceReport:
    """``run_conformance`` for tests: raises ``AssertionError`` with the report when a case
    fails, or when the backend cannot run here (unless ``allow_unsupported``)."""
    report = run_conformance(backend_cls, **kwargs)
    if report.unsupported and allow_unsupported:
        return report
    if not report.passed:
        raise AssertionError(report.format())
    return report
