"""A seed out of range names ``seed`` and the allowed range (issue 21): torch alone said
"Overflow when unpacking long long"."""

from __future__ import annotations

import pytest
import torch

from app._validation import MAX_SEED, check_seed
from app.config import EngineConfig, ModelConfig
from app.mla import MLAEngine
from app.mla.layer import MLALayerWeights, TokenEmbedding


@pytest.mark.parametrize("seed, error, message", [
    (2**70, ValueError, "got 1180591620717411303424"),
    (2**63, ValueError, "got 9223372036854775808"),
    (-1, ValueError, "got -1"),
    (True, TypeError, "got True (bool)"),
    (1.0, TypeError, "got 1.0 (float)"),
    ("7", TypeError, "got '7' (str)"),
])
def test_the_engine_refuses_a_bad_seed_first(seed: object, error: type[Exception],
                                              message: str) -> None:
    with pytest.raises(error) as info:
        MLAEngine(seed=seed)  # type: ignore[arg-type]
    text = str(info.value)
    assert text.startswith("MLAEngine: seed: expected an int in [0, 9223372036854775807]")
    assert message in text


def test_the_largest_seed_works_with_every_derived_seed() -> None:
    # Layers draw from seed + l and the embedding from seed + 0x5EED: all within uint64.
    config = EngineConfig.from_dict({"model": {"num_heads": 2, "hidden_size": 32,
                                               "kv_lora_rank": 64, "qk_nope_head_dim": 16,
                                               "qk_rope_head_dim": 32, "v_head_dim": 16,
                                               "dtype": "float32"},
                                     "cache": {"num_blocks": 16}})
    engine = MLAEngine(config, seed=MAX_SEED, num_layers=2, vocab_size=64)
    assert engine.embedding.vocab_size == 64


def test_the_weight_generators_name_seed_too() -> None:
    with pytest.raises(ValueError, match=r"MLALayerWeights.generate: seed: expected an int in "
                                         r"\[0, 18446744073709551615\], got 18446744073709551616"):
        MLALayerWeights.generate(ModelConfig(), 2**64)
    with pytest.raises(ValueError, match=r"TokenEmbedding\.generate: seed: expected an int in"):
        TokenEmbedding.generate(8, 4, torch.float32, 2**64 - 1)


def test_check_seed() -> None:
    assert check_seed("seed", 0) == 0 and check_seed("seed", MAX_SEED) == MAX_SEED
    with pytest.raises(ValueError, match="x: expected an int in"):
        check_seed("x", MAX_SEED + 1)
