"""The engine: chunked prefill under a token budget, prefix sharing, waiting, rejection,
preemption, no leaks, and resolution through the container once at start-up."""

from __future__ import annotations

import pytest
import torch
from dependency_injector import providers

from app.mla.engine import MLAPrefillEngine, RequestOutput, RequestTooLargeError
from app.mla.reference import check_against_reference
from tests.mla.conftest import TOL, VOCAB, tiny_config, tiny_container


def _engine(step_tokens: int = 64, **config: object) -> MLAPrefillEngine:
    cfg = tiny_config(**config)  # type: ignore[arg-type]
    return MLAPrefillEngine(cfg, container=tiny_container(cfg), step_tokens=step_tokens,
                            vocab_size=VOCAB, seed=0)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(engine: MLAPrefillEngine, out: RequestOutput) -> float:
    assert out.output is not None
    result = check_against_reference(engine.weights, engine.embedding, out.request_id,
                                     out.token_ids, out.output, out.computed_rows)
    assert result.rows_checked == int(out.computed_rows.sum())
    return result.relative_error


def _no_leak(engine: MLAPrefillEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks
    assert engine.kv_manager.block_pool.num_used_blocks == 0
    engine.kv_manager.block_pool.check_consistency()


def test_chunked_prefill_respects_the_budget_and_matches_the_reference() -> None:
    engine = _engine(step_tokens=16)
    for i, n in enumerate((37, 1, 20, 5)):
        engine.add_request(f"r{i}", _tokens(n, i))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        step = engine.step()
        assert 0 < step.num_new_tokens <= 16
        outputs.extend(step.finished)
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2", "r3"]
    for out in outputs:
        assert bool(out.computed_rows.all())
        assert _check(engine, out) < TOL[torch.float32]
    assert engine.stats.steps >= 4 and engine.stats.computed_tokens == 63
    _no_leak(engine)


def test_prefix_cache_hit_skips_recomputation() -> None:
    engine = _engine(step_tokens=64)
    prefix = _tokens(24, 1)
    first = engine.run([("a", prefix + _tokens(7, 2))])[0]
    assert first.num_cached_tokens == 0
    second, third = engine.run([("b", prefix + _tokens(10, 3)), ("c", prefix[:13])])
    assert second.num_cached_tokens == 24      # 6 full blocks of a's prefix
    assert not bool(second.computed_rows[:24].any()) and bool(second.computed_rows[24:].all())
    assert third.num_cached_tokens == 12       # at most len - 1, whole blocks
    assert engine.stats.computed_tokens == 31 + 10 + 1
    for out in (first, second, third):
        assert _check(engine, out) < TOL[torch.float32]
    assert engine.stats.prefix_cache_hit_rate == pytest.approx(36 / (31 + 34 + 13))
    _no_leak(engine)


def test_a_request_that_does_not_fit_waits() -> None:
    # 10 usable blocks of 4 tokens; each request needs 6 blocks: one at a time.
    engine = _engine(step_tokens=64, num_blocks=11, prefix_caching=False)
    for i in range(3):
        engine.add_request(f"r{i}", _tokens(24, 10 + i))
    first = engine.step()
    assert [s[0] for s in first.scheduled] == ["r0"]
    assert engine.num_waiting == 2
    outputs = list(first.finished)
    while engine.has_unfinished():
        step = engine.step()
        assert len(step.scheduled) == 1
        outputs.extend(step.finished)
    assert [o.request_id for o in outputs] == ["r0", "r1", "r2"]
    for out in outputs:
        assert _check(engine, out) < TOL[torch.float32]
    _no_leak(engine)


def test_a_request_that_can_never_fit_is_refused_clearly() -> None:
    engine = _engine(num_blocks=11)           # 10 usable blocks of 4 tokens = 40 tokens
    engine.add_request("ok", _tokens(40, 0))
    with pytest.raises(RequestTooLargeError, match=r"needs 11 KV-cache blocks.*only 10 usable"
                                                    r".*can never run") as info:
        engine.add_request("big", _tokens(41, 1))
    assert isinstance(info.value, ValueError)
    assert "cache.num_blocks to at least 12" in str(info.value)
    assert engine.num_waiting == 1            # the refused request left nothing behind
    engine.run()
    _no_leak(engine)


def test_bad_requests_are_refused() -> None:
    engine = _engine()
    with pytest.raises(ValueError, match="no tokens"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        engine.add_request("oov", [1, 97])
    engine.add_request("dup", [1, 2])
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request("dup", [3])
    with pytest.raises(ValueError, match="step_tokens"):
        MLAPrefillEngine(tiny_config(), step_tokens=0)


def test_a_stuck_request_is_preempted_and_recomputed() -> None:
    """A running request that cannot grow while nothing else can run is preempted (its blocks
    freed); it is recomputed later, with a correct output."""
    engine = _engine(step_tokens=12, num_blocks=13, prefix_caching=False)  # 12 usable blocks
    engine.add_request("a", _tokens(20, 20))
    engine.add_request("b", _tokens(20, 21))
    engine.step()                               # a: 12 tokens (3 blocks)
    step = engine.step()                        # a: 8 more -> done; b: 4 tokens (1 block)
    assert [s[0] for s in step.scheduled] == ["a", "b"]
    outputs = list(step.finished)
    pool = engine.kv_manager.block_pool
    held = pool.get_new_blocks(pool.num_free_blocks)   # someone else holds every free block
    engine.add_request("c", _tokens(20, 22))
    step = engine.step()
    assert step.scheduled == () and step.num_preempted == 1
    assert engine.num_running == 0 and engine.num_waiting == 2   # b is back in the queue
    pool.free_blocks(held)
    while engine.has_unfinished():
        outputs.extend(engine.step().finished)
    by_id = {o.request_id: o for o in outputs}
    assert sorted(by_id) == ["a", "b", "c"] and by_id["b"].num_preemptions == 1
    for out in outputs:
        assert bool(out.computed_rows.all())
        assert _check(engine, out) < TOL[torch.float32]
    assert engine.stats.preemptions == 1
    _no_leak(engine)


def test_run_stops_when_blocks_held_elsewhere_never_come_back() -> None:
    engine = _engine(num_blocks=11)
    pool = engine.kv_manager.block_pool
    held = pool.get_new_blocks(pool.num_free_blocks)
    with pytest.raises(RuntimeError, match="no progress"):
        engine.run([("r", _tokens(8, 0))])
    pool.free_blocks(held)
    assert len(engine.run()) == 1
    _no_leak(engine)


def test_the_engine_resolves_through_the_container_only_at_start_up() -> None:
    cfg = tiny_config()
    container = tiny_container(cfg)
    engine = MLAPrefillEngine(cfg, container=container, vocab_size=VOCAB)

    def boom() -> None:
        raise AssertionError("resolved through the container after start-up")

    with container.platform.override(providers.Callable(boom)), \
            container.mla_prefill_backends.TORCH_SDPA.override(providers.Callable(boom)), \
            container.kv_cache_spec_bindings.override(providers.Callable(boom)), \
            container.config.override(providers.Callable(boom)):
        outputs = engine.run([("r", _tokens(30, 5)), ("s", _tokens(3, 6))])
    assert len(outputs) == 2
    assert engine.backend_class.get_name() == "TORCH_SDPA"
    assert [g["spec"] for g in engine.describe_kv_cache_groups()] == ["MLAAttentionSpec"]
    assert engine.describe_kv_cache_groups()[0]["manager"] == "FullAttentionManager"
