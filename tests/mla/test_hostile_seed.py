"""A seed out of range names ``seed`` and the allowed range (issue 21): torch alone said
"Overflow when unpacking long long"."""

from __future__ import annotations

import pytest
import torch

from app._validation import MAX_GENERATOR_SEED, MAX_SEED, check_seed
from app.config import ModelConfig
from app.model import random_config, random_weights
from tests.model.conftest import TINY


@pytest.mark.parametrize("seed, error, message", [
    (2**70, ValueError, "got 1180591620717411303424"),
    (2**64, ValueError, "got 18446744073709551616"),
    (-1, ValueError, "got -1"),
    (True, TypeError, "got True (bool)"),
    (1.0, TypeError, "got 1.0 (float)"),
    ("7", TypeError, "got '7' (str)"),
])
def test_random_weights_refuse_a_bad_seed_first(seed: object, error: type[Exception],
                                                message: str) -> None:
    arch = random_config(ModelConfig(dtype=torch.float32, **TINY), vocab_size=8)
    with pytest.raises(error) as info:
        random_weights(arch, torch.float32, seed)  # type: ignore[arg-type]
    text = str(info.value)
    assert text.startswith("random_weights: seed: expected an int in [0, 18446744073709551615]")
    assert message in text


def test_the_largest_seed_works() -> None:
    arch = random_config(ModelConfig(dtype=torch.float32, **TINY), vocab_size=8)
    weights = random_weights(arch, torch.float32, MAX_GENERATOR_SEED)
    assert weights.embed_tokens.shape == (8, 64)


def test_check_seed() -> None:
    assert check_seed("seed", 0) == 0 and check_seed("seed", MAX_SEED) == MAX_SEED
    with pytest.raises(ValueError, match="x: expected an int in"):
        check_seed("x", MAX_SEED + 1)
