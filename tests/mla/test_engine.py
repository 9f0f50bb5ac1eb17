"""The generating engine: scheduling (decode first, chunked prefill in the budget), prefix reuse
of prompt and generated tokens, preemption and recompute, abort, refusal, speculative decoding,
no leaks, outputs against float64, and resolution through the container once at start-up."""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import pytest
import torch
from dependency_injector import providers

from app.config import EngineConfig
from app.mla.checks import check_generation
from app.mla.engine import MLAEngine, RequestTooLargeError
from app.mla.requests import FinishReason, Request, RequestOutput, RowKind
from app.model import ReferenceModel
from tests.mla.conftest import TOL, VOCAB, tiny_config, tiny_container, tiny_engine

_engine = tiny_engine


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests(lengths: tuple[int, ...], new: int = 12, seed: int = 0) -> list[Request]:
    return [Request(f"r{i}", _tokens(n, seed + i), max_new_tokens=new)
            for i, n in enumerate(lengths)]


def _check(engine: MLAEngine, outputs: list[RequestOutput], dtype: torch.dtype = torch.float32
           ) -> None:
    reference = ReferenceModel(engine.weights)
    for out in sorted(outputs, key=lambda o: o.token_ids):
        result = check_generation(reference, out, max_prefill_rows=None,
                                  max_decode_rows=None)
        # every computed row, but the (rare, in float32) routing near-ties
        assert result.routing_near_ties <= 2
        assert result.prefill_rows_checked + result.decode_rows_checked \
            + result.routing_near_ties == result.prefill_rows_computed \
            + result.decode_rows_computed
        assert result.prefill_relative_error < TOL[dtype]
        assert result.decode_relative_error < TOL[dtype]
        assert result.token_mismatches == 0


def _no_leak(engine: MLAEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks
    assert engine.kv_manager.block_pool.num_used_blocks == 0
    engine.kv_manager.block_pool.check_consistency()


def _tokens_by_id(outputs: list[RequestOutput]) -> dict[str, tuple[int, ...]]:
    return {o.request_id: o.output_token_ids for o in outputs}


def test_generation_matches_the_float64_reference_on_prefill_and_decode_rows() -> None:
    engine = _engine(step_tokens=16, layers=2)
    outputs = engine.run(_requests((37, 1, 20, 5), new=9))
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2", "r3"]
    for out in outputs:
        assert len(out.output_token_ids) == 9 and out.finish_reason is FinishReason.LENGTH
        assert out.row_kinds is not None
        kinds = out.row_kinds.tolist()
        # every row but the last generated token's was computed; decode rows after the prompt
        assert all(k != RowKind.NOT_COMPUTED for k in kinds[:-1]) and kinds[-1] == 0
        assert kinds[len(out.prompt_token_ids):-1] == [RowKind.DECODE] * 8
        assert out.metrics.ttft_steps is not None and out.metrics.ttft_steps >= 1
    _check(engine, outputs)
    # (a chunked prompt whose last chunk is one token finishes through the decode path)
    assert engine.stats.emitted_tokens == 36 and engine.stats.decode_emitted_tokens >= 32
    _no_leak(engine)


def test_decode_comes_first_and_chunked_prefill_fills_the_budget() -> None:
    engine = _engine(step_tokens=16)
    for req in _requests((5, 6, 7), new=30):
        engine.add_request(req)
    engine.step()                                   # 18 prompt tokens > 16: r2 is chunked
    engine.step()
    engine.add_request(Request("long", _tokens(40, 9), max_new_tokens=2))
    step = engine.step()                            # 3 decodes first, then 13 prefill tokens
    assert step.num_decode_tokens == 3 and step.num_prefill_tokens == 13
    assert set(step.new_tokens) == {"r0", "r1", "r2"}
    engine.run()
    _no_leak(engine)


def test_stop_tokens_end_a_request() -> None:
    engine = _engine()
    plain = engine.run([Request("a", _tokens(10, 3), max_new_tokens=8)])[0]
    stop = plain.output_token_ids[3]
    first = plain.output_token_ids.index(stop)
    out = engine.run([Request("b", _tokens(10, 3), max_new_tokens=8,
                              stop_token_ids={stop})])[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.output_token_ids == plain.output_token_ids[:first + 1]
    _no_leak(engine)


def test_prefix_cache_hits_generated_tokens() -> None:
    engine = _engine()
    prompt = _tokens(10, 4)
    first = engine.run([Request("a", prompt, max_new_tokens=20)])[0]
    assert first.num_cached_tokens == 0
    # a follow-up turn: the first request's prompt and answer, then a new token
    follow = Request("b", (*first.token_ids[:27], 5), max_new_tokens=4)
    second = engine.run([follow])[0]
    # 7 full blocks of 4: 10 prompt tokens and 18 generated ones came from the prefix cache
    assert second.num_cached_tokens == 28 - 4 == 24 > len(prompt)
    assert second.row_kinds is not None
    assert not bool(second.row_kinds[:24].any())
    _check(engine, [first, second])
    _no_leak(engine)


def test_preemption_and_recompute_give_the_tokens_of_an_unpreempted_run() -> None:
    requests = _requests((20, 22, 18), new=24, seed=30)
    roomy = _engine(num_blocks=256, prefix_caching=False)
    expected = _tokens_by_id(roomy.run(requests))
    assert roomy.stats.preemptions == 0
    # 25 usable blocks of 4 tokens: three prompts fit (16 blocks), their answers do not.
    tight = _engine(num_blocks=26, prefix_caching=False)
    outputs = tight.run(requests)
    assert tight.stats.preemptions >= 1
    assert any(o.num_preemptions for o in outputs)
    assert _tokens_by_id(outputs) == expected
    _check(tight, outputs)
    _no_leak(tight)


def test_preempted_requests_recompute_through_the_prefix_cache() -> None:
    requests = _requests((20, 22, 18), new=24, seed=30)
    expected = _tokens_by_id(_engine(num_blocks=256).run(requests))
    tight = _engine(num_blocks=26)
    outputs = tight.run(requests)
    assert tight.stats.preemptions >= 1 and _tokens_by_id(outputs) == expected
    _no_leak(tight)


def test_abort_mid_decode_frees_everything() -> None:
    engine = _engine()
    for req in _requests((13, 9), new=50):
        engine.add_request(req)
    engine.add_request(Request("queued", _tokens(7, 8), max_new_tokens=3))
    while True:
        step = engine.step()
        if len(step.new_tokens.get("r0", ())) and step.num_decode_tokens:
            break
    assert engine.kv_manager.holds("r0")
    aborted = engine.abort("r0")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert len(aborted.output_token_ids) >= 2
    assert not engine.kv_manager.holds("r0")
    assert engine.abort("r0") is None and engine.abort("never-added") is None
    engine.abort("r1")
    engine.abort("queued")
    assert engine.stats.aborted_requests == 3
    _no_leak(engine)
    # the engine still serves after aborts
    assert engine.run(_requests((6,), new=3))[0].finish_reason is FinishReason.LENGTH
    _no_leak(engine)


def test_a_request_that_can_never_fit_is_refused_at_add_request() -> None:
    engine = _engine(num_blocks=11)           # 10 usable blocks of 4 tokens
    engine.add_request(Request("ok", _tokens(30, 0), max_new_tokens=11))   # 40 slots
    with pytest.raises(RequestTooLargeError, match=r"needs 11 KV-cache blocks.*only 10 usable"
                                                    r".*can never run") as info:
        engine.add_request(Request("big", _tokens(30, 1), max_new_tokens=12))
    assert isinstance(info.value, ValueError)
    assert "cache.num_blocks to at least 12" in str(info.value)
    assert engine.num_waiting == 1            # the refused request left nothing behind
    spec = _engine(num_blocks=11, spec=2)     # the draft lookahead needs room too
    with pytest.raises(RequestTooLargeError):
        spec.add_request(Request("ok", _tokens(30, 0), max_new_tokens=11))
    engine.run()
    _no_leak(engine)


def test_bad_requests_are_refused() -> None:
    engine = _engine()
    with pytest.raises(ValueError, match="no prompt tokens"):
        Request("empty", [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request("zero", [1], max_new_tokens=0)
    with pytest.raises(TypeError, match="token ids must be ints"):
        Request("str", [1, "2"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^Request\.prompt_token_ids: token ids must be an "
                                        r"iterable of ints, got None \(NoneType\)$"):
        Request("none", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Request\.stop_token_ids: token ids must be an "
                                        r"iterable of ints, got 7 \(int\)$"):
        Request("stop", [1], stop_token_ids=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        engine.add_request(Request("oov", [1, 97]))
    with pytest.raises(TypeError, match=r"expects an app\.mla\.Request"):
        engine.add_request(("r", [1]))  # type: ignore[arg-type]
    engine.add_request(Request("dup", [1, 2]))
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request(Request("dup", [3]))
    cfg, weights = tiny_config()
    with pytest.raises(ValueError, match="step_tokens"):
        MLAEngine(tiny_container(cfg), weights=weights, step_tokens=0)
    with pytest.raises(TypeError, match="takes its config from its container"):
        MLAEngine(cfg, weights=weights)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="weights must be"):
        MLAEngine(tiny_container(cfg), weights=None)  # type: ignore[arg-type]
    other, _ = tiny_config(layers=1)
    wrong = tiny_container(EngineConfig(model=attrs.evolve(other.model, num_heads=4)))
    with pytest.raises(ValueError, match="num_heads: config 4, weights 2"):
        MLAEngine(wrong, weights=weights)



def test_a_latent_cache_larger_than_the_memory_is_refused_before_anything_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Through the API the pool's size was only checked for its bookkeeping: a latent cache
    # larger than the host came out as torch's RuntimeError after the pool was built (or, as
    # calloc is lazy, as the OOM killer once its blocks were used). The host here "has" 1 MiB.
    import app.model.cache as cache_module

    monkeypatch.setattr(cache_module, "physical_memory_bytes", lambda: 1 << 20)
    cfg, weights = tiny_config(num_blocks=256)   # 256 x (640 + 256) B: fits
    assert MLAEngine(tiny_container(cfg), weights=weights).kv_manager.block_pool.num_blocks == 256
    cfg, weights = tiny_config(num_blocks=4096)  # 3.5 MiB
    with pytest.raises(ValueError, match=r"^cache\.num_blocks = 4096 needs 0\.0 GiB of cpu memory "
                                         r"\(896 B per block: 640 B of latent cache for 4 tokens "
                                         r"of 1 layer\(s\), and the pool's bookkeeping\); cpu has "
                                         r"0\.0 GiB: use at most 1170 blocks"):
        MLAEngine(tiny_container(cfg), weights=weights)

def test_run_queues_nothing_when_one_request_is_refused() -> None:
    engine = _engine()
    free = engine.kv_manager.num_free_blocks
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        engine.run([Request("ok", [1, 2], max_new_tokens=1), Request("oov", [97])])
    with pytest.raises(ValueError, match=r"request ids must be unique, got \['a'\]"):
        engine.run([Request("a", [1]), Request("b", [2]), Request("a", [3])])
    assert not engine.has_unfinished() and engine.num_waiting == 0
    assert engine.kv_manager.num_free_blocks == free
    assert [o.request_id for o in engine.run([Request("ok", [1, 2], max_new_tokens=1)])] == [
        "ok"]


def test_a_call_from_another_thread_waits_for_the_step_in_flight() -> None:
    engine = _engine()
    engine.add_request(Request("a", [1, 2, 3], max_new_tokens=4))
    inside, release = threading.Event(), threading.Event()
    schedule = engine.scheduler.schedule

    def held_schedule() -> object:   # the step stops here until released
        inside.set()
        release.wait(5)
        return schedule()

    engine.scheduler.schedule = held_schedule  # type: ignore[method-assign]
    order: list[str] = []
    stepper = threading.Thread(target=lambda: (engine.step(), order.append("step")))
    stepper.start()
    assert inside.wait(5)
    handlers = [threading.Thread(target=lambda: (engine.abort("a"), order.append("abort"))),
                threading.Thread(target=lambda: (engine.add_request(Request("b", [4])),
                                                 order.append("add")))]
    for t in handlers:
        t.start()
    time.sleep(0.05)
    order.append("released")
    release.set()
    for t in (stepper, *handlers):
        t.join(5)
    assert order[:2] == ["released", "step"] and sorted(order[2:]) == ["abort", "add"]
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert [o.request_id for o in engine.run()] == ["b"]
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"timer": 5}, TypeError, "timer must be an app.model.profiling.PhaseTimer or None"),
    ({"keep_outputs": "no"}, TypeError, "keep_outputs must be a bool, got 'no'"),
    ({"num_speculative_tokens": 16}, ValueError,
     r"num_speculative_tokens: expected an int in \[0, 15\], got 16"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be an int >= 1"),
])
def test_bad_engine_arguments_are_refused_up_front(kwargs: dict[str, object],
                                                   error: type[Exception], message: str) -> None:
    cfg, weights = tiny_config()
    with pytest.raises(error, match=message):
        MLAEngine(tiny_container(cfg), weights=weights, **kwargs)  # type: ignore[arg-type]


def _repetitive(n: int, seed: int) -> list[int]:
    motif = _tokens(7, seed)
    return (motif * (n // 7 + 1))[:n]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_decoding_gives_the_tokens_of_plain_decoding(k: int) -> None:
    requests = [Request(f"s{i}", _repetitive(n, i) + _tokens(3, 50 + i), max_new_tokens=24)
                for i, n in enumerate((30, 17, 44))] + _requests((12,), new=24, seed=60)
    plain = _engine()
    expected = _tokens_by_id(plain.run(requests))
    spec = _engine(spec=k)
    outputs = spec.run(requests)
    assert _tokens_by_id(outputs) == expected          # float32: exactly
    stats = spec.stats
    assert stats.draft_tokens > 0 and 0.0 < stats.acceptance_rate <= 1.0
    assert stats.steps < plain.stats.steps             # accepted drafts save steps
    assert sum(o.metrics.num_accepted_tokens for o in outputs) == stats.accepted_tokens
    _check(spec, outputs)
    _no_leak(spec)


def test_run_stops_when_blocks_held_elsewhere_never_come_back() -> None:
    engine = _engine(num_blocks=11)
    pool = engine.kv_manager.block_pool
    held = pool.get_new_blocks(pool.num_free_blocks)
    with pytest.raises(RuntimeError, match="no progress"):
        engine.run([Request("r", _tokens(8, 0), max_new_tokens=2)])
    pool.free_blocks(held)
    assert len(engine.run()) == 1
    _no_leak(engine)


def test_the_engine_resolves_through_the_container_only_at_start_up() -> None:
    cfg, weights = tiny_config(layers=2)
    container = tiny_container(cfg)
    engine = MLAEngine(container, weights=weights)

    def boom() -> None:
        raise AssertionError("resolved through the container after start-up")

    with container.platform.override(providers.Callable(boom)), \
            container.mla_prefill_backends.TORCH_SDPA.override(providers.Callable(boom)), \
            container.kv_cache_spec_bindings.override(providers.Callable(boom)), \
            container.config.override(providers.Callable(boom)):
        outputs = engine.run(_requests((30, 3), new=4))
    assert len(outputs) == 2
    assert engine.backend_class.get_name() == "TORCH_SDPA"
    assert engine.decode_backend_class.get_name() == "TORCH_SDPA"
    groups = engine.describe_kv_cache_groups()
    assert [g["spec"] for g in groups] == ["MLAAttentionSpec"]       # 2 layers, one group
    assert groups[0]["layers"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert groups[0]["manager"] == "FullAttentionManager"


def test_the_engine_takes_its_backends_from_the_container_providers() -> None:
    """One config (the container's); backend instances from the container's providers, the
    decode one selected for the step's query length; replacing one goes through overrides."""
    from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend

    class MyDecode(TorchSDPADecodeBackend):
        """A decode backend that counts its calls."""

        calls = 0

        def run_decode(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
            type(self).calls += 1
            return super().run_decode(*args, **kwargs)  # type: ignore[arg-type]

    cfg, weights = tiny_config()
    container = tiny_container(cfg)
    asked: list[int] = []
    real = container.mla_decode_backend_class

    def spy(query_len: int = 1) -> type:
        asked.append(query_len)
        return MyDecode

    with container.mla_decode_backend_class.override(providers.Callable(spy)):
        engine = MLAEngine(container, weights=weights, num_speculative_tokens=2)
    assert asked == [3] and engine.decode_backend_class is MyDecode
    assert engine.config is cfg and real is container.mla_decode_backend_class
    engine.run(_requests((6, 9), new=5))
    assert MyDecode.calls > 0


def test_the_feed_forward_in_chunks_gives_the_same_outputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import app.model.model as model_module

    prompts = [[(7 * i + 3 * j) % 90 + 2 for j in range(11 + i)] for i in range(3)]

    def generate() -> list[RequestOutput]:
        engine = tiny_engine(layers=2)
        return sorted(engine.run(Request(f"r{i}", p, max_new_tokens=4)
                                 for i, p in enumerate(prompts)),
                      key=lambda out: out.request_id)

    whole = generate()
    monkeypatch.setattr(model_module, "FEED_FORWARD_CHUNK", 5)   # 36 prompt rows: 8 chunks
    chunked = generate()
    for a, b in zip(whole, chunked, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.hidden is not None and b.hidden is not None
        # float32 matmuls of fewer rows may round differently (MKL's kernels depend on M)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)


def test_a_padded_decode_batch_gives_the_same_outputs() -> None:
    """Issue 35 (graph-ready decode): with ``decode_batch_sizes`` each decode step is padded
    to the smallest size that holds its batch (padding requests in the pool's reserved block
    0); the outputs are those of the unpadded engine, speculative steps included, and no
    block leaks."""
    requests = _requests((6, 9, 13), new=7)
    for spec in (0, 2):
        plain = tiny_engine(spec=spec).run(requests)
        cfg, weights = tiny_config()
        engine = MLAEngine(tiny_container(cfg), weights=weights, step_tokens=64,
                           num_speculative_tokens=spec, decode_batch_sizes=(4, 16))
        batches: list[int] = []
        real_plan = engine.model.plan_decode

        def plan(*args: object, real_plan: Any = real_plan, batches: list[int] = batches,
                 **kwargs: object) -> object:
            made = real_plan(*args, **kwargs)
            batches.append(made.batch)
            return made

        engine.model.plan_decode = plan  # type: ignore[method-assign]
        padded = engine.run(requests)
        assert set(batches) == {4}
        assert {o.request_id: o.output_token_ids for o in padded} == \
            {o.request_id: o.output_token_ids for o in plain}
        assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks
    with pytest.raises(ValueError, match="decode_batch_sizes"):
        MLAEngine(tiny_container(cfg), weights=weights, decode_batch_sizes=(0, 4))
