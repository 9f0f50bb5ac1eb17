"""Testing helpers for users of the library and for third-party backends.

- ``run_conformance`` / ``assert_conformance``: the conformance kit every prefill backend (ours
  and third parties') is checked with against a float64 reference; see
  ``app.testing.conformance`` for the cases and how to run it on your backend.
- ``run_decode_conformance`` / ``assert_decode_conformance``: the same for MLA decode backends
  (paged cache, random page tables, query_len 1..16); see ``app.testing.decode_conformance``.
  Both kits run their cases through one runner, ``run_cases``, and every one of the four
  functions returns the ``ConformanceReport`` (``assert_*`` once it passed); a kit's case
  raises ``CaseFailure`` to say what the backend got wrong.
- The sparse cases (``SPARSE_DECODE_CASES``, ``SPARSE_PREFILL_CASES``,
  ``app.testing.sparse_conformance``): both kits run them on a backend that declares
  ``supports_sparse`` (DeepSeek Sparse Attention), against ``reference_sparse_attention``.
- ``SelectionOnlyBackend``: a backend to register and select in tests; it runs nothing.
- ``reference_attention``: the float64 ragged attention the kit compares with.
- ``fp8_cache_decode_bounds``: error bounds of a decode kernel reading an FP8 cache against
  ``reference_decode``, derived from how the kernel dequantises (``app.testing.fp8_bounds``),
  or (``original=``) against the latent before the cache quantised it, with
  ``quantization_error``: what e4m3 with the cache's scales allows per value.
- The pytest fixtures (``app_container``, ``override_prefill_backend``, ``fake_platform``) live
  in ``app.testing.pytest_plugin`` and are registered automatically through the ``pytest11``
  entry point.
"""

from app.testing.conformance import (
    CASES,
    DEFAULT_TOLERANCES,
    CaseFailure,
    CaseResult,
    ConformanceReport,
    assert_conformance,
    reference_attention,
    run_cases,
    run_conformance,
)
from app.testing.decode_conformance import (
    DECODE_CASES,
    assert_decode_conformance,
    reference_decode,
    run_decode_conformance,
)
from app.testing.fp8_bounds import (
    DecodeErrorBounds,
    fp8_cache_decode_bounds,
    quantization_error,
)
from app.testing.sparse_conformance import (
    SPARSE_DECODE_CASES,
    SPARSE_PREFILL_CASES,
    reference_sparse_attention,
)
from app.testing.stubs import SelectionOnlyBackend

__all__ = [
    "CASES",
    "DECODE_CASES",
    "DEFAULT_TOLERANCES",
    "SPARSE_DECODE_CASES",
    "SPARSE_PREFILL_CASES",
    "CaseFailure",
    "CaseResult",
    "ConformanceReport",
    "DecodeErrorBounds",
    "SelectionOnlyBackend",
    "assert_conformance",
    "assert_decode_conformance",
    "fp8_cache_decode_bounds",
    "quantization_error",
    "reference_attention",
    "reference_decode",
    "reference_sparse_attention",
    "run_cases",
    "run_conformance",
    "run_decode_conformance",
]
