"""The float64 check of a sparse model (DeepSeek-V3.2) attends to the engine's own selection.

A tiny bf16 V3.2 checkpoint (``app.testing``'s writer): the check feeds the engine's top-k to
the float64 reference and to the dense model in bf16 that sets the tolerance, so every sampled
row is compared (none left out as a selection near-tie) at a tolerance far below the output
scale, and the selections are compared apart. A planted error in one row of a sparse layer's
attention, or one key dropped from one row's selection, fails it. The selections kept are
bitmasks: the same bytes for ``index_topk`` 8 and 4096 (every key of these sequences), and a
step records ``ceil(its most visible keys / 8)`` bytes per row, never ``index_topk`` positions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from app.config import EngineConfig
from app.containers import create_container
from app.mla import MLAEngine, Request
from app.mla.checks import (
    GenerationCheck,
    check_generations,
    derived_tolerance,
    selection_limit,
)
from app.model import ReferenceModel, load_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

DTYPE = torch.bfloat16
LENGTHS = (30, 70)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec, write_deepseek_checkpoint

    spec = DeepseekCheckpointSpec(
        family="v32", num_heads=4, hidden_size=128, intermediate_size=128, vocab_size=256,
        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        q_lora_rank=64, moe_intermediate_size=64, index_topk=8, index_head_dim=32,
        index_n_heads=4)
    return write_deepseek_checkpoint(tmp_path_factory.mktemp("v32") / "ckpt", spec)


@pytest.fixture(scope="module")
def v32(v32_dir: Path) -> Any:
    return load_checkpoint(v32_dir, DTYPE)


def _engine(loaded: Any, keep_selections: bool = True) -> MLAEngine:
    config = EngineConfig.from_dict({"cache": {"block_size": 16, "num_blocks": 64}})
    config = EngineConfig(model=loaded.config.model_config(DTYPE), cache=config.cache)
    return MLAEngine(create_container(config), weights=loaded.weights, step_tokens=64,
                     keep_selections=keep_selections)


def _generate(engine: MLAEngine) -> list[Any]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]
    outputs = engine.run(Request(f"p{i}", p, max_new_tokens=NEW_TOKENS)
                         for i, p in enumerate(prompts))
    return sorted(outputs, key=lambda o: o.token_ids)


def _check(loaded: Any, outputs: list[Any]) -> tuple[list[GenerationCheck], float, bool]:
    """Every row checked; the results, the derived tolerance and the run command's verdict."""
    results = check_generations(ReferenceModel(loaded.weights), outputs, None, None,
                                dtype_reference=ReferenceModel(loaded.weights, DTYPE))
    tolerance = derived_tolerance(DTYPE, max(r.dtype_relative_error for r in results))
    limit = selection_limit(DTYPE, tolerance)
    passed = all(r.prefill_relative_error <= tolerance and r.decode_relative_error <= tolerance
                 and r.token_mismatches == 0 and r.selection_mismatches(limit) == 0
                 for r in results)
    return results, tolerance, passed


@pytest.fixture(scope="module")
def honest(v32: Any) -> list[Any]:
    return _generate(_engine(v32))


def test_a_bf16_v32_check_compares_every_row_at_the_dense_tolerance(
        v32: Any, honest: list[Any]) -> None:
    results, tolerance, passed = _check(v32, honest)
    assert passed
    # a tolerance at the output's own size checks nothing: the dense rule's few percent
    assert tolerance < 0.15
    for out, result in zip(honest, results, strict=True):
        assert out.selections is not None and out.selections.shape[0] == 2  # both layers
        assert result.selection_near_ties == 0                 # nothing left out for it
        checked = result.prefill_rows_checked + result.decode_rows_checked
        # every row compared but those routed within rounding (experts, not selections)
        assert checked + result.routing_near_ties == (result.prefill_rows_computed
                                                      + result.decode_rows_computed)
        assert result.selection_rows_compared == checked
        assert result.selection_overlap > 0.9
        assert max(result.prefill_relative_error, result.decode_relative_error) < tolerance


class _DropsOneKey:
    """A selector that drops the last key of the first row of the first decode step (a
    dropped key: a bug the selection check must catch)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.done = inner, False

    def select(self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
               metadata: Any, topk: int) -> torch.Tensor:
        chosen = self.inner.select(q, weights, key_cache, metadata, topk)
        if not self.done and metadata.num_rows <= len(LENGTHS):     # a decode step
            self.done = True
            chosen = chosen.clone()
            last = int((chosen[0] >= 0).sum()) - 1
            chosen[0, last] = -1
        return chosen


def _plant(engine: MLAEngine, what: str) -> Any:
    """Plant ``what`` in the last sparse layer of ``engine`` (its own instance only):
    ``"output"`` moves one row's attention output in the first decode step by half its
    largest value, ``"selection"`` drops one key (``_DropsOneKey``)."""
    executor = engine.model.sparse_executors[-1]
    if what == "selection":
        executor.selector = _DropsOneKey(executor.selector)
        return executor.selector
    run_decode, state = executor.run_decode, _DropsOneKey(None)

    def decode(x: torch.Tensor, plan: Any, selection: Any) -> torch.Tensor:
        out = run_decode(x, plan, selection)
        if not state.done:
            state.done = True
            out = out.clone()
            out[0] += 0.5 * out[0].abs().max()
        return out

    executor.run_decode = decode  # type: ignore[method-assign]
    return state


@pytest.mark.parametrize("what", ["output", "selection"])
def test_a_planted_error_in_a_sparse_row_fails(v32: Any, what: str) -> None:
    engine = _engine(v32)
    planted = _plant(engine, what)
    outputs = _generate(engine)
    assert planted.done
    results, tolerance, passed = _check(v32, outputs)
    assert not passed
    assert tolerance < 0.15
    if what == "selection":
        limit = selection_limit(DTYPE, tolerance)
        assert sum(r.selection_mismatches(limit) for r in results) == 1
        assert max(r.selection_max_violation for r in results) == float("inf")
    else:
        assert max(max(r.prefill_relative_error, r.decode_relative_error)
                   for r in results) > tolerance


def test_keep_selections_is_refused_without_outputs_or_on_a_dense_model(v32: Any) -> None:
    config = EngineConfig(model=v32.config.model_config(DTYPE),
                          cache=EngineConfig.from_dict({"cache": {"num_blocks": 16}}).cache)
    with pytest.raises(ValueError, match="keep_outputs"):
        MLAEngine(create_container(config), weights=v32.weights, keep_outputs=False,
                  keep_selections=True)
    with pytest.raises(TypeError, match="keep_selections"):
        MLAEngine(create_container(config), weights=v32.weights,
                  keep_selections=1)  # type: ignore[arg-type]


def _with_index_topk(source: Path, target: Path, index_topk: int) -> Any:
    """``source``'s checkpoint, loaded with ``index_topk`` in its ``config.json``."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "index_topk": index_topk}))
    return load_checkpoint(target, DTYPE)


def _watched(engine: MLAEngine) -> tuple[list[Any], int, int]:
    """``_generate``'s outputs, the most bytes of selections the requests held at a step's
    end, and the widest selection (bytes per row) a step recorded."""
    real, widest = engine.model.take_selections, [0]

    def spy() -> torch.Tensor | None:
        chosen = real()
        assert chosen is None or chosen.dtype == torch.uint8
        widest[0] = max(widest[0], 0 if chosen is None else int(chosen.shape[2]))
        return chosen

    engine.model.take_selections = spy  # type: ignore[method-assign]
    step, peak = engine._step, [0]

    def watched_step() -> Any:
        out = step()
        held = [part for st in engine._states.values() for _, part in st.kept_selections or ()]
        peak[0] = max(peak[0], sum(part.nbytes for part in held))
        return out

    engine._step = watched_step  # type: ignore[method-assign]
    return _generate(engine), peak[0], widest[0]


def test_the_kept_selections_do_not_grow_with_index_topk(v32_dir: Path, tmp_path: Path) -> None:
    most = max(LENGTHS) + NEW_TOKENS
    runs = {k: _watched(_engine(_with_index_topk(v32_dir, tmp_path / str(k), k)))
            for k in (8, 4096)}
    (narrow, narrow_peak, narrow_widest), (wide, wide_peak, wide_widest) = runs.values()
    assert 0 < narrow_peak == wide_peak
    assert narrow_widest == wide_widest == math.ceil(most / 8)
    for out in (*narrow, *wide):
        s = len(out.token_ids)
        assert out.selections.dtype == torch.uint8
        assert out.selections.shape == (2, s, math.ceil(s / 8))     # S / 8 bytes per row
    # int32 positions min(index_topk, S) wide would have been 4 * S bytes per row and layer
    positions = sum(2 * len(out.token_ids) * min(4096, len(out.token_ids)) * 4 for out in wide)
    assert 8 * wide_peak < positions
    # every key selected by both (index_topk past the sequence): the check passes, all compared
    results, _, passed = _check(_with_index_topk(v32_dir, tmp_path / "again", 4096), wide)
    assert passed and all(r.selection_rows_compared > 0 for r in results)
