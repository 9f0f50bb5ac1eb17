"""Issue 44, the contract's silent wrong results: a kernel hook that returns its result instead
of writing the ``out`` it was handed, a prefill backend's own verbs returning the wrong dtype or
device, and a decode subclass with its own ``run_decode`` / ``run_sparse_decode`` (which the
base now checks as the prefill base checks its own verbs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.backends.decode.base import MLADecodeBackend, MLASparseDecodeBackend
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.backends.decode.torch_sparse import TorchSparseDecodeBackend
from app.backends.prefill.base import MLAPrefillBackend
from app.backends.prefill.metadata import MLAPrefillMetadata
from app.backends.prefill.torch_sdpa import TorchSDPAPrefillBackend
from app.backends.prefill.torch_sparse import TorchSparsePrefillBackend
from app.backends.sparse.indexer import SparseIndexerMetadata, TorchSparseIndexer

H, RANK, ROPE = 2, 8, 4


def _decode_step(be: MLADecodeBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step of 2 requests (query_len 1) over a cache of 4 blocks of 4: q, cache, indices."""
    gen = torch.Generator().manual_seed(1)
    be.prepare_metadata(MLADecodeMetadata.build(
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([5, 7], dtype=torch.int32), 1))
    return (torch.randn(2, 1, H, RANK + ROPE, generator=gen),
            torch.randn(4, 4, RANK + ROPE, generator=gen),
            torch.tensor([[[0, 3, -1]], [[8, 9, 9]]], dtype=torch.int32))


def _decoder(cls: type[MLADecodeBackend]) -> MLADecodeBackend:
    return cls(H, 0.3, RANK, ROPE, torch.float32)


# -- 1. a hook returns its result instead of writing out ------------------------------------

class _ReturnsDecode(TorchSDPADecodeBackend):
    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> Any:
        mine = torch.empty_like(out)
        super()._run_decode(metadata, q, kv_cache, mine, lse, softmax_scale, k_scale)
        return mine


class _ReturnsSparseDecode(TorchSparseDecodeBackend):
    def _run_sparse_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                           kv_cache: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor | None, softmax_scale: float,
                           k_scale: float) -> Any:
        mine = torch.empty_like(out)
        super()._run_sparse_decode(metadata, q, kv_cache, indices, mine, lse, softmax_scale,
                                   k_scale)
        return mine


class _ReturnsOut(TorchSDPADecodeBackend):
    """Returns the very out it was handed: accepted."""

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor, kv_cache: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                    k_scale: float) -> Any:
        super()._run_decode(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)
        return out


class _ReturnsPrefill(TorchSDPAPrefillBackend):
    def _run_prefill(self, call: int, layout: Any, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, causal: bool, out: torch.Tensor,
                     lse: torch.Tensor | None) -> Any:
        mine = torch.empty_like(out)
        super()._run_prefill(call, layout, q, k, v, causal, mine, lse)
        return mine


class _ReturnsSparsePrefill(TorchSparsePrefillBackend):
    def _run_sparse_prefill(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor | None, softmax_scale: float,
                            k_scale: float) -> Any:
        mine = torch.empty_like(out)
        super()._run_sparse_prefill(q, kv, indices, mine, lse, softmax_scale, k_scale)
        return mine


class _ReturnsIndexer(TorchSparseIndexer):
    def _select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                metadata: SparseIndexerMetadata, out: torch.Tensor) -> Any:
        mine = out.clone()
        super()._select(q, weights, key_cache, metadata, mine)
        return mine


@pytest.mark.parametrize(("cls", "sparse"), [(_ReturnsDecode, False),
                                             (_ReturnsSparseDecode, True)])
@pytest.mark.parametrize("with_out", [False, True])
def test_a_decode_hook_that_returns_its_result_is_a_type_error(cls: type, sparse: bool,
                                                               with_out: bool) -> None:
    be = _decoder(cls)
    q, cache, idx = _decode_step(be)
    out = torch.full((2, 1, H, RANK), float("nan")) if with_out else None
    hook = "_run_sparse_decode" if sparse else "_run_decode"
    with pytest.raises(TypeError, match=rf"{cls.__name__}\.{hook} returned a torch.float32"):
        if sparse:
            be.run_sparse_decode(q, cache, idx, out=out)  # type: ignore[attr-defined]
        else:
            be.run_decode(q, cache, out=out)


def test_a_decode_hook_that_returns_the_out_it_was_handed_is_accepted() -> None:
    be, plain = _decoder(_ReturnsOut), _decoder(TorchSDPADecodeBackend)
    q, cache, _ = _decode_step(be)
    _decode_step(plain)
    torch.testing.assert_close(be.run_decode(q, cache), plain.run_decode(q, cache))


def test_a_prefill_hook_that_returns_its_result_is_a_type_error() -> None:
    be = _ReturnsPrefill(num_heads=H, scale=0.3, kv_lora_rank=16, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8)
    be.prepare_metadata(MLAPrefillMetadata.build([3], [[2]]))
    q, k, v = torch.randn(3, H, 12), torch.randn(3, H, 12), torch.randn(3, H, 8)
    with pytest.raises(TypeError, match=r"_ReturnsPrefill\._run_prefill returned"):
        be.run_prefill_new_tokens(q, k, v, True)
    with pytest.raises(TypeError, match=r"_ReturnsPrefill\._run_prefill returned"):
        be.run_prefill_context_chunk(0, q, k[:2], v[:2], out=torch.empty(3, H, 8))


def test_a_sparse_prefill_hook_that_returns_its_result_is_a_type_error() -> None:
    be = _ReturnsSparsePrefill(num_heads=H, scale=0.3, kv_lora_rank=RANK, qk_nope_head_dim=8,
                               qk_rope_head_dim=ROPE, v_head_dim=8)
    q, kv = torch.randn(2, H, RANK + ROPE), torch.randn(5, RANK + ROPE)
    idx = torch.tensor([[0, 4], [-1, 2]], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"_ReturnsSparsePrefill\._run_sparse_prefill returned"):
        be.run_sparse_prefill(q, kv, idx, return_softmax_lse=True)


def test_an_indexer_hook_that_returns_its_result_is_a_type_error() -> None:
    meta = SparseIndexerMetadata.build(torch.tensor([[0, 1]], dtype=torch.int32), [2], [5, 6])
    with pytest.raises(TypeError, match=r"_ReturnsIndexer\._select returned a torch.int32"):
        _ReturnsIndexer().select(torch.randn(2, 2, 8), torch.rand(2, 2), torch.randn(2, 4, 8),
                                 meta, 3)


# -- 2. a prefill backend's own verbs: the output's dtype and device -------------------------

class _OwnPrefillVerbs(MLAPrefillBackend):
    """Its own run verbs, returning ``make(shape)`` as the output."""

    name = "TEST_OWN_PREFILL_VERBS"
    supported_dtypes = (torch.float32,)
    make: Any = staticmethod(torch.zeros)
    lse_device = "cpu"

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> Any:
        o = type(self).make(q.shape[0], self.num_heads, self.v_head_dim)
        lse = torch.zeros(self.num_heads, q.shape[0], device=self.lse_device)
        return (o, lse) if return_softmax_lse else o

    def run_prefill_context_chunk(self, chunk: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None) -> Any:
        return (type(self).make(q.shape[0], self.num_heads, self.v_head_dim),
                torch.zeros(self.num_heads, q.shape[0], device=self.lse_device))


_WRONG_OUTPUTS = {
    "int64": lambda *shape: torch.zeros(*shape, dtype=torch.int64),
    "float64": lambda *shape: torch.zeros(*shape, dtype=torch.float64),
    "meta": lambda *shape: torch.empty(*shape, device="meta"),
    "sparse layout": lambda *shape: torch.zeros(*shape).to_sparse(),
}


@pytest.mark.parametrize("wrong", list(_WRONG_OUTPUTS))
@pytest.mark.parametrize("verb", ["run_prefill_new_tokens", "run_prefill_context_chunk"])
def test_a_prefill_backends_own_verb_returning_a_wrong_dtype_or_device_is_refused(
        wrong: str, verb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_OwnPrefillVerbs, "make", staticmethod(_WRONG_OUTPUTS[wrong]))
    be = _OwnPrefillVerbs(num_heads=H, scale=0.3, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8)
    be.prepare_metadata(MLAPrefillMetadata.build([3], [[2]]))
    q, k, v = torch.randn(3, H, 12), torch.randn(3, H, 12), torch.randn(3, H, 8)
    with pytest.raises(TypeError, match=rf"{verb} returned out as .*expected a dense "
                                        rf"torch.float32 tensor on cpu"):
        if verb == "run_prefill_new_tokens":
            be.run_prefill_new_tokens(q, k, v, False)
        else:
            be.run_prefill_context_chunk(0, q, k[:2], v[:2])


def test_a_prefill_backends_own_verb_returning_its_lse_on_another_device_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_OwnPrefillVerbs, "lse_device", "meta")
    be = _OwnPrefillVerbs(num_heads=H, scale=0.3, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8)
    be.prepare_metadata(MLAPrefillMetadata.build([3]))
    q, k, v = torch.randn(3, H, 12), torch.randn(3, H, 12), torch.randn(3, H, 8)
    with pytest.raises(TypeError, match=r"run_prefill_new_tokens returned .*float32 on cpu"):
        be.run_prefill_new_tokens(q, k, v, True)


# -- 3. a decode subclass's own run_decode / run_sparse_decode -------------------------------

class _OwnRunDecode(MLADecodeBackend):
    """A third party's decode backend with its own run_decode (no _run_decode)."""

    supported_dtypes = (torch.float32,)
    ran: list[str] = []
    make: Any = staticmethod(torch.ones)

    def run_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, *,
                   return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                   softmax_scale: float | None = None, k_scale: Any = None) -> Any:
        self.ran.append(f"out={out is not None}")
        b, n = int(q.shape[0]), int(q.shape[1])
        o = type(self).make(b, n, self.num_heads, self.kv_lora_rank)
        return (o, torch.zeros(self.num_heads, b, n)) if return_softmax_lse else o


class _OwnSparseDecode(MLASparseDecodeBackend):
    """A sparse-only backend with its own run_sparse_decode (no _run_sparse_decode)."""

    supported_dtypes = (torch.float32,)
    seen: list[torch.Tensor] = []

    def run_sparse_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                          **kwargs: Any) -> Any:
        self.seen.append(indices)
        return torch.zeros(int(q.shape[0]), int(q.shape[1]), self.num_heads, self.kv_lora_rank)


@pytest.fixture(autouse=True)
def _fresh_records() -> Any:
    _OwnRunDecode.ran, _OwnSparseDecode.seen = [], []
    yield


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda be, q, cache: be.run_decode(q, cache), ValueError, "call prepare_metadata"),
    (lambda be, q, cache: be.run_decode(q[:, :, :1], cache), ValueError, "q"),
    (lambda be, q, cache: be.run_decode(q, cache[..., :-1]), ValueError, "kv_cache"),
    (lambda be, q, cache: be.run_decode(q, cache, softmax_scale=float("nan")), ValueError,
     "softmax_scale"),
    (lambda be, q, cache: be.run_decode(q, cache, k_scale=-1.0), ValueError, "k_scale"),
    (lambda be, q, cache: be.run_decode(q, cache, return_softmax_lse=1), TypeError, "bool"),
    (lambda be, q, cache: be.run_decode(q, cache, out=torch.empty(2, 1, H, RANK + 1)),
     ValueError, "out"),
    (lambda be, q, cache: be.run_decode(q.double(), cache), ValueError, "dtype")])
def test_a_decode_subclasss_own_run_decode_gets_every_check_first(
        call: Any, error: type[Exception], message: str) -> None:
    be = _decoder(_OwnRunDecode)
    q, cache, _ = _decode_step(be)
    if message == "call prepare_metadata":
        be = _decoder(_OwnRunDecode)
    with pytest.raises(error, match=message):
        call(be, q, cache)
    assert _OwnRunDecode.ran == []


@pytest.mark.parametrize("wrong", list(_WRONG_OUTPUTS))
def test_a_decode_subclasss_own_run_decode_returning_a_wrong_output_is_refused(
        wrong: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_OwnRunDecode, "make", staticmethod(_WRONG_OUTPUTS[wrong]))
    be = _decoder(_OwnRunDecode)
    q, cache, _ = _decode_step(be)
    with pytest.raises(TypeError, match=r"_OwnRunDecode\.run_decode returned .*expected out"):
        be.run_decode(q, cache)


def test_a_decode_subclasss_own_run_decode_is_held_to_the_out_and_lse_rules() -> None:
    be = _decoder(_OwnRunDecode)
    q, cache, _ = _decode_step(be)
    out = torch.full((2, 1, H, RANK), float("nan"))
    got, lse = be.run_decode(q, cache, out=out, return_softmax_lse=True)
    assert got is out and bool((out == 1).all()) and lse.shape == (H, 2, 1)
    old, old_lse = be.forward_decode(q, cache, return_lse=True)   # through its run_decode
    assert bool((old == 1).all()) and old_lse.shape == (2, 1, H) and old_lse.is_contiguous()
    aliased = q.view(-1)[:2 * H * RANK].view(2, 1, H, RANK)        # out= over q: not in place
    be.run_decode(q, cache, out=aliased)
    assert _OwnRunDecode.ran == ["out=True", "out=False", "out=False"]


def test_a_sparse_subclasss_own_run_sparse_decode_gets_checked_private_indices() -> None:
    be = _decoder(_OwnSparseDecode)
    q, cache, idx = _decode_step(be)
    with pytest.raises(ValueError, match="out of range"):
        be.run_sparse_decode(q, cache, torch.full_like(idx, 16))  # type: ignore[attr-defined]
    assert _OwnSparseDecode.seen == []
    be.run_sparse_decode(q, cache, idx)  # type: ignore[attr-defined]
    (seen,) = _OwnSparseDecode.seen
    assert torch.equal(seen, idx) and seen.data_ptr() != idx.data_ptr()
