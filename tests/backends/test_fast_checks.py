"""The checks' fast paths (issue 35: the wrapper's own time per call) accept only what the full
checks accept: for each input, if the one-expression test says it passes, the full checks,
run without it, raise nothing; and the good inputs do take the fast path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from app.backends.decode import checks as decode_checks
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.prefill import checks as prefill_checks

H, QK, V, T, KV = 2, 6, 4, 5, 7


def _prefill_variants() -> list[tuple[str, Any, Any, Any]]:
    q = torch.randn(T, H, QK)
    k = torch.randn(KV, H, QK)
    v = torch.randn(KV, H, QK + V)[..., QK:]
    variants: list[tuple[str, Any, Any, Any]] = [("good", q, k, v)]
    for name, bad in (("q rank", q[0]), ("q tokens", q[:-1]), ("q heads", q[:, :1]),
                      ("q dim", q[..., :-1]), ("q fp64", q.double()),
                      ("q meta", q.to("meta")), ("q sparse", q.to_sparse()),
                      ("q list", q.tolist())):
        variants.append((name, bad, k, v))
    for name, bad in (("k tokens", k[:-1]), ("k dtype", k.half()), ("k dim", k[..., 1:])):
        variants.append((name, q, bad, v))
    for name, bad in (("v dim", v[..., 1:]), ("v dtype", v.bfloat16()), ("v tokens", v[1:])):
        variants.append((name, q, k, bad))
    return variants


def _verdict(run: Callable[[], None]) -> bool:
    try:
        run()
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize(("name", "q", "k", "v"), _prefill_variants())
def test_prefill_fast_path_accepts_only_what_the_checks_accept(
        monkeypatch: pytest.MonkeyPatch, name: str, q: Any, k: Any, v: Any) -> None:
    dtypes = (torch.float32, torch.bfloat16)

    def check() -> None:
        prefill_checks.check_attention_inputs(
            "X", q, k, v, num_heads=H, qk_head_dim=QK, v_head_dim=V, total_q=T, total_kv=KV,
            dtypes=dtypes, device=torch.device("cpu"))

    fast = prefill_checks._inputs_pass(q, k, v, (T, H, QK), (KV, H, QK), (KV, H, V), dtypes,
                                       torch.device("cpu"))
    with monkeypatch.context() as m:
        m.setattr(prefill_checks, "_inputs_pass", lambda *a: False)
        full = _verdict(check)
    assert full == (name == "good")
    assert fast == full          # the fast path takes exactly the inputs the checks accept
    assert _verdict(check) == full


def _decode_variants() -> list[tuple[str, Any, Any]]:
    q = torch.randn(2, 1, H, QK)
    cache = torch.randn(6, 4, QK)
    return [("good", q, cache), ("q shape", q[:1], cache), ("q fp64", q.double(), cache),
            ("q int", q.int(), cache), ("q meta", q.to("meta"), cache),
            ("cache width", q, cache[..., 1:]), ("cache dtype", q, cache.half()),
            ("cache rank", q, cache[0]), ("cache stride", q, cache.transpose(0, 2)),
            ("cache meta", q, cache.to("meta")), ("cache list", q, cache.tolist()),
            ("cache blocks", q, cache[:1])]


@pytest.mark.parametrize(("name", "q", "cache"), _decode_variants())
def test_decode_fast_path_accepts_only_what_the_checks_accept(
        monkeypatch: pytest.MonkeyPatch, name: str, q: Any, cache: Any) -> None:
    meta = MLADecodeMetadata.build(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                                   torch.tensor([5, 8], dtype=torch.int32), 1)

    def check() -> None:
        decode_checks.check_decode_inputs("X", meta, q, cache, None, num_heads=H,
                                          kv_lora_rank=QK - 2, qk_rope_head_dim=2,
                                          kv_cache_dtype=torch.float32)

    good_geometry = _verdict(lambda: decode_checks.check_decode_inputs(
        "X", meta, torch.randn(2, 1, H, QK), torch.randn(6, 4, QK), None, num_heads=H,
        kv_lora_rank=QK - 2, qk_rope_head_dim=2, kv_cache_dtype=torch.float32))
    assert good_geometry     # the step's geometry is now checked: the fast path may apply
    fast = decode_checks._inputs_pass(meta, q, cache, (2, 1, H, QK), torch.float32)
    with monkeypatch.context() as m:
        m.setattr(decode_checks, "_inputs_pass", lambda *a: False)
        full = _verdict(check)
    assert full == (name == "good")
    assert fast == full


def test_the_decode_fast_path_waits_for_the_step_geometry_check() -> None:
    """A new step's first call goes through every check (its cache geometry included)."""
    meta = MLADecodeMetadata.build(torch.tensor([[0, 9]], dtype=torch.int32),
                                   torch.tensor([5], dtype=torch.int32), 1)
    q, cache = torch.randn(1, 1, H, QK), torch.randn(6, 4, QK)   # block 9 of 6: out of range
    assert not decode_checks._inputs_pass(meta, q, cache, (1, 1, H, QK), torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        decode_checks.check_decode_inputs("X", meta, q, cache, None, num_heads=H,
                                          kv_lora_rank=QK - 2, qk_rope_head_dim=2,
                                          kv_cache_dtype=torch.float32)
