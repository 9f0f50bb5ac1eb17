"""NaN and inf on both CPU paths of TORCH_SDPA (issue 12 item 3), by the rule of
``app.backends.prefill._dense``: a non-finite key a row sees makes the whole row (and its
LSE) NaN, a
non-finite value column a row sees makes that column non-finite, keys a row does not see
never contribute, and every other element equals the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from app.backends.cpu import prefill_kernel as native
from app.backends.prefill.base import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPABackend
from app.testing import reference_attention

H, NOPE, ROPE, DV = 2, 128, 64, 128
NAN, INF = float("nan"), float("inf")


def backend(path: str) -> TorchSDPABackend:
    be = TorchSDPABackend(num_heads=H, scale=1 / math.sqrt(NOPE + ROPE), kv_lora_rank=512,
                          qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV)
    be.cpu_native_kernel = path == "native"  # type: ignore[misc]
    if path == "native" and be._native_kernel(torch.float32) is None:
        pytest.skip(f"native CPU kernel unavailable: {native.native_kernel_status().reasons}")
    return be


Poison = tuple[str, int, int, int, float]  # (tensor, token, head, column, value)


def run(path: str, q_lens: list[int], kv_lens: list[int], causal: bool,
        poison: list[Poison], dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(kv_lens)
    t = {"q": torch.randn(tq, H, NOPE + ROPE, generator=gen).to(dtype),
         "k": torch.randn(tk, H, NOPE + ROPE, generator=gen).to(dtype),
         "v": torch.randn(tk, H, DV, generator=gen).to(dtype)}
    clean = {name: x.clone() for name, x in t.items()}
    for name, token, head, col, value in poison:
        t[name][token, head, col] = value
    be = backend(path)
    if causal:
        be.prepare_metadata(MLAPrefillMetadata.build(q_lens, new_kv_lens=kv_lens))
        out, lse = be.run_prefill_new_tokens(t["q"], t["k"], t["v"], return_softmax_lse=True)
    else:
        be.prepare_metadata(MLAPrefillMetadata.build(q_lens, [kv_lens]))
        out, lse = be.run_prefill_context_chunk(0, t["q"], t["k"], t["v"])

    # Which (row, head) see which key, and where the rule says non-finite.
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_kv = [0, *torch.tensor(kv_lens).cumsum(0).tolist()]
    sees = torch.zeros(tq, tk, dtype=torch.bool)
    for b in range(len(q_lens)):
        for r in range(q_lens[b]):
            last = r + kv_lens[b] - q_lens[b] if causal else kv_lens[b] - 1
            sees[cu_q[b] + r, cu_kv[b]:cu_kv[b] + last + 1] = True
    bad_key = ~torch.isfinite(t["k"].float()).all(-1)            # [tk, H]
    bad_row = (sees.unsqueeze(-1) & bad_key.unsqueeze(0)).any(1)  # [tq, H]
    bad_row |= ~torch.isfinite(t["q"].float()).all(-1)
    bad_v = ~torch.isfinite(t["v"].float())                      # [tk, H, DV]
    want_bad = bad_row.unsqueeze(-1) | torch.einsum(
        "qk,khc->qhc", sees.float(), bad_v.float()).gt(0)

    got_bad = ~torch.isfinite(out.float())
    assert torch.equal(got_bad, want_bad), (
        f"non-finite rows {got_bad.any(-1).nonzero().tolist()}, "
        f"expected {want_bad.any(-1).nonzero().tolist()}")
    assert torch.equal(lse.isnan(), bad_row.t()), "LSE NaN exactly on rows with a bad score"
    assert out.float()[bad_row].isnan().all(), "a row with a bad score is NaN throughout"
    ref_out, ref_lse = reference_attention(clean["q"], clean["k"], clean["v"], cu_q, cu_kv,
                                           causal, be.scale)
    # Every other element is what the clean inputs give (poisoned keys unseen there).
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double()[~want_bad], ref_out[~want_bad], atol=tol,
                               rtol=tol)
    fine = ~bad_row.t()
    torch.testing.assert_close(lse.double()[fine], ref_lse[fine], atol=tol, rtol=tol)


PATHS = pytest.mark.parametrize("path", ["native", "aten"])


@pytest.mark.slow
@PATHS
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_the_issue_case_a_bad_key_reaches_exactly_the_rows_that_see_it(path: str,
                                                                       value: float) -> None:
    """One causal request of 30 tokens, one element of key 10: rows 10..29 NaN (in that
    head), rows 0..9 finite; the aten path made every row NaN, the native one none."""
    run(path, [30], [30], True, [("k", 10, 0, 7, value)])


@PATHS
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_a_bad_value_reaches_exactly_the_rows_that_see_it(path: str, value: float) -> None:
    run(path, [30], [30], True, [("v", 10, 1, 5, value)])


@PATHS
def test_bad_values_on_the_causal_diagonal_of_every_tile(path: str) -> None:
    """Keys inside q.k (14-row) and p.v (6-row) tiles and 126-row query blocks, where a row
    shares a tile with rows that see keys it must not."""
    poison = [("v", j, j % H, j % DV, NAN if j % 2 else INF) for j in (0, 5, 13, 14, 20, 125,
                                                                     126, 200, 299)]
    run(path, [300], [300], True, poison)


@PATHS
def test_bad_keys_past_the_first_key_block_and_with_leading_keys(path: str) -> None:
    run(path, [40, 600], [90, 600], True, [("k", 60, 0, 1, NAN), ("k", 90 + 530, 1, 100, INF)])


@PATHS
def test_a_bad_query_row_is_that_row_only(path: str) -> None:
    run(path, [30], [30], True, [("q", 12, 1, 3, NAN)])


@PATHS
def test_context_chunk_bad_key_reaches_only_its_request(path: str) -> None:
    """A context chunk is not causal: every row of the request sees the key, no other
    request does."""
    run(path, [7, 9, 5], [20, 16, 11], False,
        [("k", 20 + 3, 0, 0, NAN), ("v", 36 + 4, 1, 64, INF)])


@PATHS
def test_bf16_inputs(path: str) -> None:
    run(path, [30], [30], True, [("k", 10, 0, 7, NAN), ("v", 20, 1, 3, INF)],
        dtype=torch.bfloat16)


def test_native_bf16_output_keeps_nan_whatever_its_payload() -> None:
    """Rounding a NaN with a full payload to bf16 must not carry into the sign bit (-0)."""
    kernel = native.load_native_kernel()
    if kernel is None:
        pytest.skip("native CPU kernel unavailable")
    q, k = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    v = torch.randn(4, 1, 64)
    v.view(torch.int32)[2, 0, 9] = 0x7FFFFFFF  # a NaN whose payload bits are all ones
    out = torch.empty(4, 1, 64, dtype=torch.bfloat16)
    kernel.attend(q, k, v, [0], [4], [0], [4], True, 0.1, out, torch.empty(1, 4))
    assert out[2:, 0, 9].float().isnan().all() and out[:2].float().isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_sees_every_nan_and_inf_and_nothing_else(dtype: torch.dtype) -> None:
    from app.backends.prefill._dense import all_finite

    big = torch.full((4096, 4), 60000.0).to(dtype)  # a float16 sum would overflow
    assert all_finite(big, big[:, :2])
    for value in (NAN, INF, -INF):
        x = big.clone()
        x[4000, 3] = value
        assert not all_finite(big, x[:, 2:])
