"""The engine under several callers and on a broken model (issue 33): concurrent ``run`` calls
each get exactly their own requests' outputs, and logits that are not finite end a request
with an error naming the step and the first stage that produced them, never a token."""

from __future__ import annotations

import threading

import pytest
import torch

from app.mla.engine import MLAEngine
from app.mla.requests import FinishReason, Request, RequestOutput
from tests.mla.conftest import VOCAB, tiny_config, tiny_container, tiny_engine


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests(prefix: str, count: int, seed: int) -> list[Request]:
    return [Request(f"{prefix}{i}", _tokens(5 + 7 * i, seed + i), max_new_tokens=4 + 3 * i)
            for i in range(count)]


def _by_id(outputs: list[RequestOutput]) -> dict[str, tuple[int, ...]]:
    return {o.request_id: o.output_token_ids for o in outputs}


def _run_in_threads(engine: MLAEngine, batches: list[list[Request]]
                    ) -> list[list[RequestOutput]]:
    results: list[list[RequestOutput]] = [[] for _ in batches]
    errors: list[BaseException] = []
    start = threading.Barrier(len(batches))

    def call(i: int) -> None:
        try:
            start.wait(5)
            results[i] = engine.run(batches[i])
        except BaseException as exc:  # collected, re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return results


@pytest.mark.parametrize("trial", range(3))
def test_concurrent_runs_each_get_exactly_their_own_outputs(trial: int) -> None:
    batches = [_requests(f"t{k}-", 3, seed=100 * k + trial) for k in range(3)]
    expected = _by_id(tiny_engine(step_tokens=16).run([r for b in batches for r in b]))
    engine = tiny_engine(step_tokens=16)    # small steps: the calls interleave many times
    results = _run_in_threads(engine, batches)
    for batch, outputs in zip(batches, results, strict=True):
        assert sorted(o.request_id for o in outputs) == sorted(r.request_id for r in batch)
        assert _by_id(outputs) == {r.request_id: expected[r.request_id] for r in batch}
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks


def test_a_run_also_gets_its_request_aborted_by_another_thread() -> None:
    engine = tiny_engine(step_tokens=8)
    original_step = engine._step
    calls = 0

    def step_then_abort() -> object:
        nonlocal calls
        calls += 1
        if calls == 2:   # between two steps, as a handler thread's abort lands
            aborted = engine.abort("b")
            assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
        return original_step()

    engine._step = step_then_abort  # type: ignore[method-assign]
    outputs = engine.run([Request("a", _tokens(6, 1), max_new_tokens=5),
                          Request("b", _tokens(9, 2), max_new_tokens=30)])
    reasons = {o.request_id: o.finish_reason for o in outputs}
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.ABORT}


def test_requests_queued_with_add_request_are_not_a_run_calls_own() -> None:
    engine = tiny_engine()
    engine.add_request(Request("free", _tokens(4, 3), max_new_tokens=3))
    mine = engine.run([Request("mine", _tokens(4, 4), max_new_tokens=6)])
    assert [o.request_id for o in mine] == ["mine"]
    # "free" finished inside that call's steps: handed to the next step(), not lost.
    step = engine.step()
    assert [o.request_id for o in step.finished] == ["free"]
    # run() with no requests serves the add_request ones, as before.
    engine.add_request(Request("later", _tokens(4, 5), max_new_tokens=2))
    assert [o.request_id for o in engine.run()] == ["later"]
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks


def _broken_engine(layer: int, what: str) -> MLAEngine:
    cfg, weights = tiny_config(layers=2)
    part = weights.layers[layer].attention.kv_b_proj if what == "attention" \
        else weights.layers[layer].input_layernorm
    part.fill_(float("nan"))
    return MLAEngine(tiny_container(cfg), weights=weights, step_tokens=64)


def test_nan_weights_end_requests_with_an_error_naming_the_step_and_the_layer() -> None:
    engine = _broken_engine(1, "attention")
    outputs = engine.run([Request("a", _tokens(7, 1), max_new_tokens=4),
                          Request("b", _tokens(3, 2), max_new_tokens=4)])
    for out in outputs:
        assert out.finish_reason is FinishReason.ERROR and out.output_token_ids == ()
        assert out.error is not None and out.error.startswith(f"request {out.request_id!r}: ")
        assert "logits are not finite (NaN or infinite) in step 1" in out.error
        assert "layer 1's attention (model.layers.1.self_attn)" in out.error
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks
    # Layer 0's first norm broken instead: the first stage is layer 0's attention.
    first = _broken_engine(0, "norm").run([Request("c", _tokens(4, 3), max_new_tokens=2)])[0]
    assert first.error is not None and "layer 0's attention" in first.error


def test_a_non_finite_decode_step_is_an_error_too() -> None:
    engine = tiny_engine()
    engine.add_request(Request("a", _tokens(6, 1), max_new_tokens=6))
    engine.step()                                   # the prefill: finite, one token
    engine.model._final_norm.fill_(float("inf"))    # the decode step's final norm breaks
    out = engine.run()[0]
    assert out.finish_reason is FinishReason.ERROR and len(out.output_token_ids) == 1
    assert out.error is not None and "in step 2" in out.error
    assert "the final norm (model.norm)" in out.error
