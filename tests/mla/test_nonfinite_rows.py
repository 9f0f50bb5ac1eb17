"""A speculative step with non-finite rows emits what the plain greedy run emits (issue 35).

A token whose embedding is NaN poisons the KV of the row it is fed to. Drafted, it makes that
row, and every later row of the step, non-finite; a decode backend that does not isolate
non-finite keys (``isolates_nonfinite_keys = False``, as flashinfer's fa3 MLA kernel on the
H100) makes every row of the request non-finite. Either way the speculative engine must emit
exactly the plain run's tokens: no token of a row at or after a poisoned key, an error where
(and only where) the plain run stops with one, and a rejected poisoned draft changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from dependency_injector import providers

from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from app.mla.engine import MLAEngine
from app.mla.nonfinite import verify_rows
from app.mla.requests import FinishReason, Request, RequestOutput
from app.mla.speculative import NgramDrafter, NgramIndex
from tests.mla.conftest import tiny_config, tiny_container

SPEC = 3
PROMPTS = [[(5 * i + 3 * j) % 40 for j in range(9 + 4 * i)] for i in range(3)]


class TileWideNonFinite(TorchSDPADecodeBackend):
    """TORCH_SDPA decode, but a non-finite value in a key of the step that some row does not
    see poisons every row of the request, as flashinfer's fa2/fa3 MLA kernels do."""

    isolates_nonfinite_keys = False

    def _run_decode(self, metadata: MLADecodeMetadata, q: torch.Tensor,
                    kv_cache: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                    softmax_scale: float, k_scale: float) -> None:
        super()._run_decode(metadata, q, kv_cache, out, lse, softmax_scale, k_scale)
        n, bs = metadata.query_len, kv_cache.shape[1]
        for b, seq_len in enumerate(metadata.seq_lens_list):
            pos = torch.arange(seq_len - n + 1, seq_len)
            keys = kv_cache[metadata.block_table_cpu[b][pos // bs].long(), pos % bs,
                            :self.kv_lora_rank]
            if not bool(torch.isfinite(keys).all()):
                out[b] = float("nan")


class Oracle(NgramDrafter):
    """Drafts the plain run's next tokens (``futures``: prompt -> its outputs), with
    ``rewrite(drafts)`` applied."""

    def __init__(self, futures: dict[tuple[int, ...], Sequence[int]],
                 rewrite: Any = None) -> None:
        super().__init__(SPEC)
        self.futures = futures
        self.rewrite = rewrite or (lambda drafts: drafts)

    def propose(self, index: NgramIndex) -> list[int]:
        for prompt, future in self.futures.items():
            if tuple(index.tokens[:len(prompt)]) == prompt:
                ahead = list(future[len(index.tokens) - len(prompt):][:SPEC])
                ahead += [index.tokens[-1]] * (SPEC - len(ahead))
                return list(self.rewrite(ahead))
        raise AssertionError("unknown history")


def _engine(poison: int | None, spec: int, isolating: bool = True,
            rewrite: Any = None, futures: dict[tuple[int, ...], Sequence[int]] | None = None
            ) -> MLAEngine:
    cfg, weights = tiny_config()
    if poison is not None:
        weights.embed_tokens[poison] = float("nan")
    container = tiny_container(cfg)
    cls = TorchSDPADecodeBackend if isolating else TileWideNonFinite
    with container.mla_decode_backend_class.override(providers.Callable(lambda **_: cls)):
        engine = MLAEngine(container, weights=weights, step_tokens=64,
                           num_speculative_tokens=spec)
    if spec:
        engine.drafter = Oracle(futures or {}, rewrite)
    return engine


def _run(engine: MLAEngine) -> dict[str, RequestOutput]:
    outputs = engine.run([Request(f"r{i}", p, max_new_tokens=12)
                          for i, p in enumerate(PROMPTS)])
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks
    return {o.request_id: o for o in outputs}


def _stage(error: str | None) -> str | None:
    return None if error is None else error.split("first stage that produced a non-finite "
                                                  "value: ")[1]


@pytest.fixture(scope="module")
def plain() -> dict[str, RequestOutput]:
    return _run(_engine(None, 0))


def _futures(plain: dict[str, RequestOutput]) -> dict[tuple[int, ...], Sequence[int]]:
    return {tuple(PROMPTS[int(rid[1:])]): out.output_token_ids for rid, out in plain.items()}


def _unused(plain: dict[str, RequestOutput], emitted: bool) -> int:
    """A token in no prompt: one the plain run emits mid-way (``emitted``), or never."""
    prompts = {t for p in PROMPTS for t in p}
    if emitted:
        found = [t for out in plain.values() for t in out.output_token_ids[1:-2]
                 if t not in prompts]
    else:
        outputs = {t for out in plain.values() for t in out.output_token_ids}
        found = [t for t in range(97) if t not in prompts | outputs]
    assert found, "the tiny model's outputs left no token to poison"
    return found[0]


@pytest.mark.parametrize("isolating", [True, False])
def test_a_rejected_poisoned_draft_changes_nothing(plain: dict[str, RequestOutput],
                                                  isolating: bool) -> None:
    """Drafts ``[wrong, poison, poison]``: the first is rejected, so the poisoned rows belong
    to a continuation that is thrown away; every output is the plain run's, with no error
    (the old engine ended every such request with an error)."""
    poison = _unused(plain, emitted=False)

    def rewrite(drafts: list[int]) -> list[int]:
        return [(drafts[0] + 1) % 97 if (drafts[0] + 1) % 97 != poison else
                (drafts[0] + 2) % 97, poison, poison]

    spec = _run(_engine(poison, SPEC, isolating, rewrite, _futures(plain)))
    for rid, out in plain.items():
        assert spec[rid].output_token_ids == out.output_token_ids
        assert spec[rid].finish_reason is out.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("isolating", [True, False])
def test_an_accepted_poisoned_draft_ends_the_request_where_the_plain_run_does(
        plain: dict[str, RequestOutput], isolating: bool) -> None:
    """A token the plain run emits, poisoned: the plain run emits it, then fails on the step
    that feeds it. Drafted and accepted, the speculative step emits the drafts up to and
    including it (each the greedy token of a finite row), and no token of a row that sees its
    key; the request ends with the same error, naming the same stage."""
    poison = _unused(plain, emitted=True)
    broken = _run(_engine(poison, 0))
    assert any(o.finish_reason is FinishReason.ERROR for o in broken.values())
    spec = _run(_engine(poison, SPEC, isolating, futures=_futures(plain)))
    for rid, out in broken.items():
        assert spec[rid].output_token_ids == out.output_token_ids, rid
        assert spec[rid].finish_reason is out.finish_reason
        assert _stage(spec[rid].error) == _stage(out.error)
        if out.finish_reason is FinishReason.ERROR:
            assert out.output_token_ids[-1] == poison
            assert _stage(out.error) == "the token embedding (model.embed_tokens)"


def test_verification_reads_no_row_at_or_after_the_first_non_finite_one() -> None:
    greedy = [7, 8, 9, 10]                       # row i's greedy token
    assert verify_rows([7, 8, 9], greedy, None).tokens == [7, 8, 9, 10]
    # rows 2 and 3 non-finite: drafts 0 and 1 accepted by rows 0 and 1, row 2 needed
    verdict = verify_rows([7, 8, 9], greedy, 2)
    assert (verdict.accepted, verdict.tokens, verdict.error) == (2, [7, 8], True)
    # draft 1 rejected by row 1: row 2 is never needed
    verdict = verify_rows([7, 5, 9], greedy, 2)
    assert (verdict.accepted, verdict.tokens, verdict.error) == (1, [7, 8], False)
    # row 0 non-finite: nothing to emit
    verdict = verify_rows([7, 8, 9], greedy, 0)
    assert (verdict.tokens, verdict.error) == ([], True)
