"""A checkpoint's ``index_topk`` never sizes memory past what a step can use (issue 44).

``index_topk`` in ``config.json`` above ``max_position_embeddings`` (no query of the model's
context sees more keys) is refused at load, naming the file and the key. A large but valid one
(``max_position_embeddings`` itself) runs a 20-token prompt with every selection ``min(index_topk,
the step's most visible keys)`` wide, the same widths and tokens as an ``index_topk`` just above
the context; the float64 reference's selections are bounded the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from app.config import CacheConfig, EngineConfig
from app.containers import create_container
from app.mla import MLAEngine, Request
from app.mla.checks import check_generations
from app.model import DeepseekConfig, ReferenceModel, load_checkpoint
from app.model.sparse import executors
from app.model.sparse import reference as sparse_reference
from app.model.sparse.config import IndexerConfig

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec, write_deepseek_checkpoint

#: The spec's ``max_position_embeddings`` (its yarn rope: the Hub's V3 value).
MAX_POSITIONS = 163840
SMALL = {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
         "num_heads": 2, "vocab_size": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": 32, "index_head_dim": 32,
         "index_n_heads": 4}
PROMPT_LEN, NEW = 20, 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3.2 checkpoint (index_topk 16)."""
    return write_deepseek_checkpoint(tmp_path_factory.mktemp("v32") / "ckpt",
                                     DeepseekCheckpointSpec(family="v32", **SMALL))


def _with_index_topk(source: Path, target: Path, index_topk: int) -> Path:
    """A copy of ``source`` whose ``config.json`` says ``index_topk``."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    assert config["max_position_embeddings"] == MAX_POSITIONS
    config["index_topk"] = index_topk
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("index_topk", [10**7, 2**31 - 1, MAX_POSITIONS + 1])
def test_an_index_topk_past_max_position_embeddings_is_refused_naming_the_key(
        checkpoint: Path, tmp_path: Path, index_topk: int) -> None:
    directory = _with_index_topk(checkpoint, tmp_path / "big", index_topk)
    want = (f"config.json: index_topk = {index_topk}: expected an int in \\[1, "
            f"max_position_embeddings = {MAX_POSITIONS}\\]")
    with pytest.raises(ValueError, match=want) as caught:
        load_checkpoint(directory, torch.float32)
    assert str(directory / "config.json") in str(caught.value)
    with pytest.raises(ValueError, match=want):
        DeepseekConfig.from_json_file(directory / "config.json")


def test_a_deepseek_config_built_in_code_is_held_to_the_same_bound(checkpoint: Path) -> None:
    config = DeepseekConfig.from_json_file(checkpoint / "config.json")
    assert config.indexer is not None
    wide = IndexerConfig(index_topk=MAX_POSITIONS + 1, index_head_dim=32, index_n_heads=4)
    with pytest.raises(ValueError, match="index_topk must be at most max_position_embeddings"):
        DeepseekConfig(**{**_fields(config), "indexer": wide})


def _fields(config: DeepseekConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in attrs.fields(DeepseekConfig)}


def _generate(directory: Path, monkeypatch: pytest.MonkeyPatch
              ) -> tuple[list[int], list[tuple[int, int]], Any]:
    """Greedy tokens of one 20-token prompt, each selection's (width, the step's most visible
    keys), and the loaded weights."""
    seen: list[tuple[int, int]] = []
    real = executors.SparseMLAExecutor._select

    def spy(self: Any, *args: Any) -> torch.Tensor:
        slots = real(self, *args)
        seen.append((int(slots.shape[1]), max(args[5].seq_lens)))
        return slots

    loaded = load_checkpoint(directory, torch.float32)
    config = EngineConfig(model=loaded.config.model_config(torch.float32),
                          cache=CacheConfig(block_size=4, num_blocks=64))
    engine = MLAEngine(create_container(config), weights=loaded.weights, step_tokens=8)
    prompt = torch.randint(2, 64, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as patch:
        patch.setattr(executors.SparseMLAExecutor, "_select", spy)
        (out,) = engine.run([Request("r", prompt.tolist(), max_new_tokens=NEW)])
    return list(out.output_token_ids), seen, (loaded.weights, out)


def test_a_large_valid_index_topk_sizes_each_step_by_its_context(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    context = PROMPT_LEN + NEW
    tokens, widths, _ = _generate(
        _with_index_topk(checkpoint, tmp_path / "huge", MAX_POSITIONS), monkeypatch)
    just, just_widths, _ = _generate(
        _with_index_topk(checkpoint, tmp_path / "just", context + 1), monkeypatch)
    assert widths and all(width == keys <= context for width, keys in widths), widths
    assert widths == just_widths and tokens == just     # top-k of fewer keys: all of them


def test_the_float64_reference_bounds_its_selections_too(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, (weights, out) = _generate(
        _with_index_topk(checkpoint, tmp_path / "huge", MAX_POSITIONS), monkeypatch)
    picked: list[int] = []
    real = sparse_reference.SparseReference.select

    def spy(self: Any, i: int, h: torch.Tensor, rows: torch.Tensor, *rest: Any) -> Any:
        sel, margins, compared = real(self, i, h, rows, *rest)
        assert sel.shape[1] <= int(rows.max()) + 1
        picked.append(int(sel.shape[1]))
        return sel, margins, compared

    monkeypatch.setattr(sparse_reference.SparseReference, "select", spy)
    (check,) = check_generations(ReferenceModel(weights), [out], None, None)
    assert picked and max(picked) <= PROMPT_LEN + NEW and check.token_mismatches == 0
