"""One int validator (``app._validation.check_int``) for every int field of the config and the
kv-plan file: a bool, a float, a string and an out-of-range value are refused with the same
message shape wherever they are written."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from app._imports import import_object
from app._validation import (
    check_int,
    check_positive_finite,
    may_overlap_itself,
    tensors_overlap,
)
from app.commands.kv_plan import load_plan_config
from app.config import AttentionConfig, CacheConfig, ModelConfig

BAD_TYPES = [True, 511.9, 512.0, "512", None, [512]]


@pytest.mark.parametrize("value", BAD_TYPES)
def test_check_int_refuses_non_ints(value: object) -> None:
    with pytest.raises(TypeError, match=r"^x: expected an int in \[1, 9\], got .* \(\w+\)$"):
        check_int("x", value, 1, 9)


@pytest.mark.parametrize("value", [0, 10, -(2**70), 2**70])
def test_check_int_refuses_out_of_range(value: int) -> None:
    with pytest.raises(ValueError, match=rf"^x: expected an int in \[1, 9\], got {value}$"):
        check_int("x", value, 1, 9)


def test_check_int_texts() -> None:
    assert check_int("x", 5) == 5
    with pytest.raises(ValueError, match=r"expected an int >= 6, got 5"):
        check_int("x", 5, 6)
    with pytest.raises(ValueError, match=r"expected an int <= 4, got 5"):
        check_int("x", 5, None, 4)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1.0, 10**400])
def test_check_positive_finite(value: object) -> None:
    with pytest.raises(ValueError, match="expected a positive, finite float"):
        check_positive_finite("s", value)
    with pytest.raises(TypeError):
        check_positive_finite("s", True)


@pytest.mark.parametrize("cls, field", [
    (ModelConfig, "num_heads"), (ModelConfig, "hidden_size"), (ModelConfig, "kv_lora_rank"),
    (ModelConfig, "qk_nope_head_dim"), (ModelConfig, "qk_rope_head_dim"),
    (ModelConfig, "v_head_dim"), (AttentionConfig, "context_chunk_tokens"),
    (CacheConfig, "block_size"), (CacheConfig, "num_blocks")])
@pytest.mark.parametrize("value", BAD_TYPES)
def test_every_config_int_field_refuses_non_ints_alike(cls: type, field: str,
                                                       value: object) -> None:
    with pytest.raises(TypeError, match=rf"^{cls.__name__}\.{field}: expected an int in "
                                        rf"\[\d+, \d+\], got .* \(\w+\)$"):
        cls(**{field: value})


@pytest.mark.parametrize("cls, field", [
    (ModelConfig, "num_heads"), (ModelConfig, "hidden_size"), (ModelConfig, "kv_lora_rank"),
    (ModelConfig, "v_head_dim"), (AttentionConfig, "context_chunk_tokens"),
    (CacheConfig, "num_blocks"), (CacheConfig, "block_size")])
def test_every_config_int_field_has_an_upper_bound(cls: type, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field}: expected an int in "
                                         rf"\[\d+, \d+\], got 9223372036854775807$"):
        cls(**{field: 2**63 - 1})


@pytest.mark.parametrize("field, value, shown", [
    ("kv_lora_rank", "true", "True (bool)"), ("kv_lora_rank", "511.9", "511.9 (float)"),
    ("kv_lora_rank", '"512"', "'512' (str)"), ("kv_lora_rank", "-512", "-512"),
    ("qk_rope_head_dim", "true", "True (bool)"), ("qk_rope_head_dim", "64.0", "64.0 (float)"),
])
def test_kv_plan_mla_dims_use_the_same_validator(tmp_path: Path, field: str, value: str,
                                                 shown: str) -> None:
    dims = {"kv_lora_rank": "512", "qk_rope_head_dim": "64", field: value}
    path = tmp_path / "plan.toml"
    path.write_text('[[layers]]\nname = "a"\nspec = "mla"\ndtype = "bf16"\n'
                    + "".join(f"{k} = {v}\n" for k, v in dims.items()))
    error = TypeError if shown.endswith(")") else ValueError
    with pytest.raises(error, match=rf"layers\[0\]\.{field}: expected an int in \[\d+, \d+\], "
                                    rf"got {shown.replace('(', '[(]').replace(')', '[)]')}$"):
        load_plan_config(path)


def test_kv_plan_head_size_and_count_use_the_same_validator(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    for key, text in (("head_size", "head_size = true"), ("count", "count = true\n"
                                                          "head_size = 576")):
        name = "a.{i}" if key == "count" else "a"
        path.write_text(f'[[layers]]\nname = "{name}"\nspec = "mla"\ndtype = "bf16"\n{text}\n')
        with pytest.raises(TypeError, match=rf"layers\[0\]\.{key}: expected an int in "
                                            r"\[1, \d+\], got True \(bool\)$"):
            load_plan_config(path)


def test_kv_plan_empty_indices_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "plan.toml"
    path.write_text('[[layers]]\nname = "a.{i}"\nindices = []\nspec = "mla"\nhead_size = 576\n'
                    'dtype = "bf16"\n')
    with pytest.raises(ValueError, match=r"layers\[0\]\.indices = \[\]: expected a non-empty"):
        load_plan_config(path)


@pytest.mark.parametrize("source, raised", [
    ('raise RuntimeError("planted")\n', "RuntimeError: planted"),
    ("def f(:\n", "SyntaxError: invalid syntax"),
    ('raise ValueError("planted value")\n', "ValueError: planted value"),
    ("import no_such_module_anywhere\n", "No module named 'no_such_module_anywhere'"),
])
def test_import_object_turns_any_import_failure_into_import_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, raised: str) -> None:
    (tmp_path / "planted_mod_for_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="planted_mod_for_import") as info:
        import_object("planted_mod_for_import.Thing")
    assert raised in str(info.value) and "\n" not in str(info.value)


def test_may_overlap_itself() -> None:
    base = torch.zeros(4, 6)
    assert not may_overlap_itself(base) and not may_overlap_itself(base.t())
    assert not may_overlap_itself(base[:, ::2]) and not may_overlap_itself(torch.zeros(0, 3))
    assert not may_overlap_itself(torch.zeros(1, 1, 5).expand(1, 1, 5))   # size-1 dims
    assert may_overlap_itself(torch.zeros(1, 6).expand(4, 6))
    assert may_overlap_itself(base.as_strided((3, 4), (2, 1)))            # rows overlap
    assert not may_overlap_itself(base.as_strided((3, 2), (4, 1)))


def test_tensors_overlap_compares_addresses_not_storages() -> None:
    buf = np.zeros(64, dtype=np.float32)
    a, b = torch.from_numpy(buf[:40]), torch.from_numpy(buf[32:])
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert tensors_overlap(a, b) and tensors_overlap(b, a)
    assert not tensors_overlap(a[:32], b) and not tensors_overlap(a, torch.zeros(0))
