"""The engine's greedy tokens on DeepSeek-V3.2 and GLM-MoE-DSA checkpoints are transformers'.

Tiny random checkpoints made with transformers (``tests/model/sparse_checkpoints.py``), with
``index_topk`` 8 against prompts of 40-120 tokens:

- float32: the engine's greedy tokens equal transformers' ``generate`` exactly (V3.2, and GLM-5
  with a shared layer), through chunked prefill (context chunks over several steps) and mixed
  decode batches;
- the indexer matters: the same prompts with ``index_topk`` above the context give other tokens
  (so the test above proves the sparse path, not a dense one);
- ``index_topk`` above the context reduces to dense DeepSeek-V3 exactly: the engine's tokens are
  transformers' V3 on the same weights, and its hidden states the dense engine's within float32
  rounding;
- the float64 check follows the sparse model: every row within float32 rounding, no token
  mismatch;
- an FP8 block-quantized copy (the indexer's projections too) dequantizes exactly and gives
  transformers' tokens on the dequantized weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from app.mla.checks import check_generations
from app.model import ReferenceModel, load_checkpoint
from tests.model.hf_checkpoints import engine_generate, hf_greedy, prompts
from tests.model.sparse_checkpoints import (
    LENGTHS,
    SPARSE_MODELS,
    SPARSE_SMALL,
    as_dense_v3,
    hf_sparse_model,
    with_index_topk,
)

#: checks the model against transformers token by token: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

NEW_TOKENS = 8
#: float32 rounding moves these logits by ~1e-5; every token's top-2 gap is far above.
MIN_MARGIN = 1e-3
SPARSE_MODELS_TOPK = SPARSE_SMALL["index_topk"]


@pytest.fixture(scope="module")
def sparse_checkpoints(tmp_path_factory: pytest.TempPathFactory
                       ) -> dict[str, tuple[Any, Path]]:
    """Every ``SPARSE_MODELS`` entry: the transformers model and its saved directory."""
    root = tmp_path_factory.mktemp("sparse")
    made = {}
    for name in SPARSE_MODELS:
        model = hf_sparse_model(name)
        model.save_pretrained(root / name)
        made[name] = (model, root / name)
    return made


@pytest.fixture(scope="module")
def batch() -> list[list[int]]:
    return prompts(256, LENGTHS, seed=2)


@pytest.mark.parametrize("name", list(SPARSE_MODELS))
def test_float32_greedy_tokens_are_transformers(sparse_checkpoints: dict[str, tuple[Any, Path]],
                                                batch: list[list[int]], name: str) -> None:
    model, directory = sparse_checkpoints[name]
    outputs = engine_generate(directory, batch, NEW_TOKENS)
    for prompt, out in zip(batch, outputs, strict=True):
        assert list(out.output_token_ids) == hf_greedy(model, prompt, NEW_TOKENS), len(prompt)
    assert min(m for out in outputs for m in out.logit_margins) > MIN_MARGIN


@pytest.mark.parametrize("name", list(SPARSE_MODELS))
def test_the_indexer_selects_what_the_tokens_depend_on(
        sparse_checkpoints: dict[str, tuple[Any, Path]], batch: list[list[int]], name: str,
        tmp_path: Path) -> None:
    """Without the top-k (index_topk above every context) the same weights give other
    tokens: the parity above is the sparse model's."""
    model, directory = sparse_checkpoints[name]
    sparse = [hf_greedy(model, p, NEW_TOKENS) for p in batch]
    dense_model = hf_sparse_model(name, index_topk=4096)
    dense = [hf_greedy(dense_model, p, NEW_TOKENS) for p in batch]
    long_prompts = [i for i, p in enumerate(batch) if len(p) > SPARSE_MODELS_TOPK]
    assert any(sparse[i] != dense[i] for i in long_prompts)
    short = [i for i, p in enumerate(batch) if len(p) + NEW_TOKENS <= SPARSE_MODELS_TOPK]
    assert all(sparse[i] == dense[i] for i in short)
    engine_dense = engine_generate(with_index_topk(directory, tmp_path / "dense", 4096),
                                   batch, NEW_TOKENS)
    assert [list(o.output_token_ids) for o in engine_dense] == dense


def test_topk_above_the_context_is_dense_v3(sparse_checkpoints: dict[str, tuple[Any, Path]],
                                            batch: list[list[int]], tmp_path: Path) -> None:
    model, directory = sparse_checkpoints["v32"]
    dense_v3 = as_dense_v3(model)
    v3_dir = tmp_path / "v3"
    dense_v3.save_pretrained(v3_dir)
    wide = engine_generate(with_index_topk(directory, tmp_path / "wide", 4096), batch,
                           NEW_TOKENS)
    plain = engine_generate(v3_dir, batch, NEW_TOKENS)
    for prompt, a, b in zip(batch, wide, plain, strict=True):
        assert list(a.output_token_ids) == hf_greedy(dense_v3, prompt, NEW_TOKENS)
        assert a.output_token_ids == b.output_token_ids
        assert a.hidden is not None and b.hidden is not None
        scale = float(b.hidden.abs().max())
        assert float((a.hidden - b.hidden).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("name", list(SPARSE_MODELS))
def test_the_float64_check_follows_the_sparse_model(
        sparse_checkpoints: dict[str, tuple[Any, Path]], batch: list[list[int]],
        name: str) -> None:
    _, directory = sparse_checkpoints[name]
    outputs = engine_generate(directory, batch, NEW_TOKENS)
    weights = load_checkpoint(directory, torch.float32).weights
    results = check_generations(ReferenceModel(weights), outputs, None, None)
    for result in results:
        assert result.token_mismatches == 0
        assert result.prefill_relative_error < 1e-5 and result.decode_relative_error < 1e-5
        assert result.selection_near_ties <= 2     # float32: near-ties are rare
    assert sum(r.prefill_rows_checked + r.decode_rows_checked for r in results) > 200


def test_an_fp8_copy_gives_transformers_tokens_on_its_dequantized_weights(
        sparse_checkpoints: dict[str, tuple[Any, Path]], batch: list[list[int]],
        tmp_path: Path) -> None:
    """FP8 as DeepSeek ships V3.2: every projection, the indexer's ``wq_b``, ``wk`` and
    ``weights_proj`` too, block-quantized (with an MTP layer, skipped)."""
    from safetensors.torch import load_file, save_file

    from app.model import dequantize_fp8_block
    from tests.model.hf_checkpoints import write_fp8_copy

    model, directory = sparse_checkpoints["v32"]
    write_fp8_copy(directory, tmp_path / "fp8", block=(16, 16))
    loaded = load_checkpoint(tmp_path / "fp8", torch.float32)
    raw = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    key = "model.layers.2.self_attn.indexer.wq_b.weight"
    assert raw[key].dtype == torch.float8_e4m3fn
    indexer = loaded.weights.layers[2].attention.indexer
    assert indexer is not None
    want = dequantize_fp8_block(raw[key], raw[f"{key}_scale_inv"], (16, 16),
                                torch.empty(raw[key].shape))
    assert torch.equal(indexer.wq_b, want)
    twin = {k: (dequantize_fp8_block(v, raw[f"{k}_scale_inv"], (16, 16), torch.empty(v.shape))
                if v.dtype == torch.float8_e4m3fn else v) for k, v in raw.items()
            if not k.endswith("_scale_inv") and not k.startswith("model.layers.3.")}
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(twin_dir)
    reference = type(model).from_pretrained(twin_dir).eval()
    outputs = engine_generate(tmp_path / "fp8", batch[:2], NEW_TOKENS)
    for prompt, out in zip(batch[:2], outputs, strict=True):
        assert list(out.output_token_ids) == hf_greedy(reference, prompt, NEW_TOKENS)
