"""The engine on a sparse model (DeepSeek Sparse Attention): the indexer's key caches share the
latent layers' block table, so every block operation reaches both. Speculative decoding,
preemption and a prefix-cache hit give exactly the plain run's tokens, the float64 check holds
at float32 rounding, the key cache's spec is bound through the container's registry, and every
block is back in the pool at the end."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.containers import create_container
from app.kvcache import FullAttentionManager, FullAttentionSpec
from app.mla import MLAEngine, Request
from app.mla.checks import check_generations
from app.model import (
    IndexerKeyCacheSpec,
    ModelWeights,
    ReferenceModel,
    random_config,
    random_weights,
)
from app.model.sparse.config import IndexerConfig

#: runs the sparse engine end to end (about a minute of CPU): outside the quick subset
#: (-m "not slow").
pytestmark = pytest.mark.slow

TINY_SPARSE = ModelConfig(dtype=torch.float32, num_heads=2, hidden_size=64, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          index_topk=8, index_head_dim=16, index_n_heads=16)
LENGTHS = (37, 61, 12, 90)
NEW = 7


def _model(shared: bool) -> tuple[EngineConfig, ModelWeights]:
    arch = random_config(TINY_SPARSE, num_layers=3, vocab_size=97)
    if shared:     # GLM-5: layer 1 reuses layer 0's selection
        indexer = arch.indexer
        assert indexer is not None
        arch = attrs.evolve(arch, architecture="GlmMoeDsaForCausalLM", indexer=attrs.evolve(
            indexer, rope_interleave=True, layer_has_indexer=(True, False, True)))
    weights = random_weights(arch, torch.float32, seed=3)
    return EngineConfig(model=arch.model_config(torch.float32)), weights


def _run(config: EngineConfig, weights: ModelWeights, *, num_blocks: int = 512,
         prefix_caching: bool = True, spec: int = 0, step_tokens: int = 48,
         prompts: list[list[int]] | None = None) -> tuple[MLAEngine, dict[str, Any]]:
    config = attrs.evolve(config, cache=CacheConfig(block_size=4, num_blocks=num_blocks,
                                                    enable_prefix_caching=prefix_caching))
    engine = MLAEngine(create_container(config), weights=weights, step_tokens=step_tokens,
                       num_speculative_tokens=spec)
    batch = prompts if prompts is not None else _prompts()
    outputs = engine.run(Request(f"r{i}", p, max_new_tokens=NEW) for i, p in enumerate(batch))
    return engine, {o.request_id: o for o in outputs}


def _prompts(seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 97, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=["v32", "shared"])
def sparse_model(request: pytest.FixtureRequest) -> tuple[EngineConfig, ModelWeights,
                                                         dict[str, tuple[int, ...]]]:
    config, weights = _model(request.param == "shared")
    engine, outputs = _run(config, weights)
    assert engine.kv_manager.num_free_blocks == engine.initial_free_blocks
    return config, weights, {rid: o.output_token_ids for rid, o in outputs.items()}


def test_one_group_one_block_table_and_the_spec_bound_as_a_plugin_binds_it(
        sparse_model: tuple[EngineConfig, ModelWeights, dict[str, Any]]) -> None:
    config, weights, _ = sparse_model
    container = create_container(attrs.evolve(config, cache=CacheConfig(num_blocks=64)))
    assert IndexerKeyCacheSpec not in container.kv_cache_spec_bindings().registered_specs()
    engine = MLAEngine(container, weights=weights)
    binding = container.kv_cache_spec_bindings().registered_specs()[IndexerKeyCacheSpec]
    assert binding.manager_class is FullAttentionManager
    assert binding.uniform_type_base_spec is FullAttentionSpec
    [group] = engine.kv_cache_groups
    indexer = weights.config.indexer
    assert indexer is not None
    own = [i for i in range(3) if indexer.has_indexer(i)]
    assert [n for n in group.layer_names if n.endswith(".indexer")] == [
        f"model.layers.{i}.self_attn.indexer" for i in own]
    per_block = 16 * (32 + 8) * 4 * 3 + 16 * 16 * 4 * len(own)   # latent + keys, float32
    assert group.page_size_bytes == per_block
    keys = sum(c.nbytes for c in engine.model.key_caches if c is not None)
    assert keys == 64 * 16 * 16 * 4 * len(own)
    assert engine.model.cache_bytes == keys + sum(c.nbytes for c in engine.model.caches)


def test_speculative_decoding_gives_the_plain_tokens(
        sparse_model: tuple[EngineConfig, ModelWeights, dict[str, Any]]) -> None:
    config, weights, plain = sparse_model
    engine, outputs = _run(config, weights, spec=2)
    assert {rid: o.output_token_ids for rid, o in outputs.items()} == plain
    assert engine.stats.draft_tokens > 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_gives_the_unpreempted_tokens(
        sparse_model: tuple[EngineConfig, ModelWeights, dict[str, Any]],
        prefix_caching: bool) -> None:
    """29 usable blocks of 4 tokens: the three prompts fit (24 blocks), their answers do not;
    recomputed through the prefix cache or from scratch."""
    config, weights, _ = sparse_model
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 97, (n,), generator=gen).tolist() for n in (30, 34, 28)]
    new = 14

    def run(blocks: int) -> tuple[MLAEngine, dict[str, tuple[int, ...]]]:
        cfg = attrs.evolve(config, cache=CacheConfig(block_size=4, num_blocks=blocks,
                                                     enable_prefix_caching=prefix_caching))
        engine = MLAEngine(create_container(cfg), weights=weights, step_tokens=48)
        out = engine.run(Request(f"p{i}", p, max_new_tokens=new)
                         for i, p in enumerate(prompts))
        return engine, {o.request_id: o.output_token_ids for o in out}

    roomy, expected = run(256)
    tight, got = run(30)
    assert roomy.stats.preemptions == 0 and tight.stats.preemptions >= 1
    assert got == expected
    assert tight.kv_manager.num_free_blocks == tight.initial_free_blocks


def test_a_prefix_cache_hit_gives_a_fresh_engine_s_tokens(
        sparse_model: tuple[EngineConfig, ModelWeights, dict[str, Any]]) -> None:
    """The second turn reuses the first turn's blocks: its latent rows and its keys alike."""
    config, weights, plain = sparse_model
    first = _prompts()[3]
    follow_up = [*first, *plain["r3"], 5, 6, 7, 8, 9, 10, 11]
    engine, _ = _run(config, weights, prompts=[first])
    cached = engine.run([Request("again", follow_up, max_new_tokens=NEW)])[0]
    assert cached.num_cached_tokens >= 80
    _, fresh = _run(config, weights, prefix_caching=False, prompts=[follow_up])
    assert cached.output_token_ids == fresh["r0"].output_token_ids


def test_the_float64_check_holds(
        sparse_model: tuple[EngineConfig, ModelWeights, dict[str, Any]]) -> None:
    config, weights, _ = sparse_model
    _, outputs = _run(config, weights, step_tokens=16)
    results = check_generations(ReferenceModel(weights), list(outputs.values()), None, None)
    compared = 0
    for result in results:
        assert result.token_mismatches == 0, result
        assert max(result.prefill_relative_error, result.decode_relative_error) < 2e-5, result
        compared += result.prefill_rows_checked + result.decode_rows_checked
    assert compared > 150


def test_a_sparse_model_config_and_weights_that_disagree_are_refused() -> None:
    config, weights = _model(False)
    wrong = attrs.evolve(config, model=attrs.evolve(config.model, index_topk=None))
    with pytest.raises(ValueError, match="index_topk: config None, weights 8"):
        MLAEngine(create_container(wrong), weights=weights)
    other = attrs.evolve(weights.config, indexer=IndexerConfig(
        index_topk=8, index_head_dim=16, index_n_heads=16))
    assert other.indexer is not None and other.indexer.has_indexer(2)
