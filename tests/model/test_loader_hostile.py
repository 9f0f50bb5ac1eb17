"""A checkpoint directory from anywhere (issue 33): it loads, or ``load_checkpoint`` (and
``check_checkpoint``) fails at once with one ``ValueError`` naming the file and the key, before
anything is built; nothing in it hangs the process, fills memory or reads outside it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.model import check_checkpoint, dequantize_fp8_block, load_checkpoint, quantize_fp8_block
from tests.model.tiny_checkpoint import HUGE_INT, Tensors, write_tiny_checkpoint
from tests.test_files import FifoWatch

pytest.importorskip("safetensors")

Edit = Callable[[dict[str, Any]], None]


def _set(**changes: Any) -> Edit:
    return lambda c: c.update(changes)


def _rope(**changes: Any) -> Edit:
    return lambda c: c["rope_scaling"].update(changes)


#: (case, config edit, what the error says after the file's path).
BAD_CONFIGS: list[tuple[str, Edit, str]] = [
    ("layers 10**9", _set(num_hidden_layers=10**9),
     "config.json: num_hidden_layers = 1000000000, but the checkpoint's tensors hold 2 decoder "
     "layer(s) (layers 0..1)"),
    ("experts 10**6", _set(n_routed_experts=10**6, n_group=1),
     "config.json: n_routed_experts = 1000000, but the checkpoint's tensors hold 4 routed "
     "expert(s) per MoE layer"),
    ("5000-digit layers", _set(num_hidden_layers=HUGE_INT),
     "config.json: num_hidden_layers = <an integer of 5000 digits>: expected an int >= 1"),
    ("huge int", _set(hidden_size=2**40),
     "config.json: hidden_size = 1099511627776: expected an int >= 1 (and at most 2147483647)"),
    ("yarn theta 1", _set(rope_theta=1.0),
     "config.json: rope_scaling: rope_theta = 1.0: expected a number > 1 (yarn divides by "
     "ln(rope_theta))"),
    ("beta_fast string", _rope(beta_fast="abc"),
     "config.json: rope_scaling: beta_fast = 'abc': expected a positive finite number"),
    ("beta_fast NaN", _rope(beta_fast=float("nan")),
     "config.json: rope_scaling: beta_fast = nan: expected a positive finite number"),
    ("beta_slow infinite", _rope(beta_slow=float("inf")),
     "config.json: rope_scaling: beta_slow = inf: expected a positive finite number"),
    ("beta_fast negative", _rope(beta_fast=-4),
     "config.json: rope_scaling: beta_fast = -4: expected a positive finite number"),
    ("attention_factor 0", _rope(attention_factor=0),
     "config.json: rope_scaling: attention_factor = 0: expected a positive finite number"),
    ("mscale negative", _rope(mscale=-1.0),
     "config.json: rope_scaling: mscale = -1.0: expected a finite number >= 0"),
    ("architectures nested", _set(architectures=[["DeepseekV3ForCausalLM"]]),
     "config.json: architectures = [['DeepseekV3ForCausalLM']]: expected a list of class names"),
    ("torch_dtype list", _set(torch_dtype=["bfloat16"]),
     "config.json: torch_dtype = ['bfloat16']: expected one of ['bfloat16', 'float16', "
     "'float32']"),
    ("eos booleans", _set(eos_token_id=[True, False]),
     "config.json: eos_token_id = [True, False]: expected a token id (an int in [0, "
     "2147483647]), a list of them, or null"),
    ("bos string", _set(bos_token_id="<s>"),
     "config.json: bos_token_id = '<s>': expected a token id"),
    ("norm_topk_prob string", _set(norm_topk_prob="false"),
     "config.json: norm_topk_prob = 'false': expected true or false"),
    ("fp8 block huge int", _set(quantization_config={"quant_method": "fp8",
                                                     "weight_block_size": [2**40, 128]}),
     "quantization_config: weight_block_size = [1099511627776, 128]: expected [rows, cols] of "
     "positive ints (at most 2147483647"),
]


@pytest.mark.parametrize(("edit", "message"), [(e, m) for _, e, m in BAD_CONFIGS],
                         ids=[c for c, _, _ in BAD_CONFIGS])
def test_a_bad_config_is_refused_naming_the_file_and_the_key(tmp_path: Path, edit: Edit,
                                                            message: str) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt", config=edit)
    for load in (check_checkpoint, load_checkpoint):
        with pytest.raises(ValueError) as info:
            load(path)
        assert f"{path / 'config.json'}: " in str(info.value) or "quantization" in message
        assert message in str(info.value), str(info.value)


def _hostile_file(tmp_path: Path, target: Path, kind: str) -> str:
    """Put a hostile ``kind`` of file at ``target``; what the error says about it."""
    if target.exists():
        target.unlink()
    if kind == "dev-zero":
        target.symlink_to("/dev/zero")
        return "is a character device, not a regular file"
    if kind == "huge":
        with open(target, "wb") as f:
            f.truncate(200 << 20)   # 200 MB, sparse
        return "bytes"
    if kind == "nested":
        target.write_text("[" * 100_000 + "]" * 100_000)
        return "nests arrays or objects too deeply to parse"
    target.mkdir()
    return "is a directory"


JSON_FILES = ["config.json", "model.safetensors.index.json", "generation_config.json"]


def _directory_with(tmp_path: Path, name: str) -> Path:
    """The tiny checkpoint; sharded-looking (with an index) when ``name`` is the index."""
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    if name == "model.safetensors.index.json":
        from safetensors import safe_open
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
        (path / name).write_text(json.dumps({"weight_map": dict.fromkeys(keys,
                                                                         "model.safetensors")}))
    return path


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
@pytest.mark.parametrize("kind", ["dev-zero", "huge", "nested", "directory"])
@pytest.mark.parametrize("name", JSON_FILES)
def test_json_files_are_read_only_when_regular_and_bounded(tmp_path: Path, name: str,
                                                           kind: str) -> None:
    path = _directory_with(tmp_path, name)
    load_checkpoint(path)                       # the directory as made loads
    expected = _hostile_file(tmp_path, path / name, kind)
    with pytest.raises(ValueError) as info:
        load_checkpoint(path)
    assert str(path / name) in str(info.value) and expected in str(info.value), info.value


@pytest.mark.parametrize("name", [*JSON_FILES, "model.safetensors", "only.safetensors",
                                  "tokenizer.json"])
def test_a_fifo_anywhere_is_refused_without_opening_it(tmp_path: Path, name: str) -> None:
    path = _directory_with(tmp_path, name)
    if name == "only.safetensors":              # the only *.safetensors file, not the usual name
        (path / "model.safetensors").unlink()
    elif (path / name).exists():
        (path / name).unlink()
    fifo = FifoWatch(path / name)
    if name == "tokenizer.json":                # a hint only: the loader never opens it
        assert load_checkpoint(path).tokenizer_path is None
    else:
        with pytest.raises(ValueError, match="is a FIFO"):
            load_checkpoint(path)
    assert not fifo.stop(), f"{name}: the FIFO was opened for reading"


def test_a_safetensors_file_that_is_a_device_is_refused(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"model.safetensors: the safetensors file is a "
                                         r"character device, not a regular file"):
        load_checkpoint(path)


def test_no_tensors_or_an_empty_index_is_a_value_error(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = write_tiny_checkpoint(tmp_path / "ckpt")
    save_file({}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the checkpoint holds no tensors \(files: "
                                         r"\['model.safetensors'\]\)"):
        load_checkpoint(path)
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match="weight_map is empty: the index lists no tensors"):
        load_checkpoint(path)


def test_an_index_that_omits_a_tensor_a_shard_holds_is_refused(tmp_path: Path) -> None:
    path = _directory_with(tmp_path, "model.safetensors.index.json")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: tensor 'model.norm.weight' is in "
                                         r"model.safetensors but not in the index's weight_map"):
        load_checkpoint(path)


@pytest.mark.parametrize(("value", "fine"), [([True, False], False), ("2", False),
                                              (-1, False), ([2, 3], True), (None, True)])
def test_generation_config_eos_is_strict(tmp_path: Path, value: object, fine: bool) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    if fine:
        expected = (1,) if value is None else tuple(value)  # type: ignore[arg-type]
        assert load_checkpoint(path).eos_token_ids == expected
        return
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id = .*: expected "
                                         r"a token id"):
        load_checkpoint(path)
    (path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"generation_config.json: expected a JSON object, got "
                                         r"list"):
        load_checkpoint(path)


def test_a_huge_fp8_block_dequantizes_in_bounded_memory(tmp_path: Path) -> None:
    """A 74 KB checkpoint with a huge ``weight_block_size`` peaked at 3.1 GiB: the scales were
    expanded to the block size before being cut to the weight."""
    block = (2**21, 2**21)
    weight = torch.randn(48, 32)
    fp8, scale = quantize_fp8_block(weight, block)       # one block: the whole weight
    assert scale.shape == (1, 1)
    out = dequantize_fp8_block(fp8, scale, block, torch.empty(48, 32))
    assert torch.equal(out, fp8.float() * scale[0, 0])
    loaded = load_checkpoint(write_tiny_checkpoint(tmp_path / "fp8", fp8_block=block))
    report = loaded.report
    assert report.fp8_tensors > 0
    if report.peak_rss_is_load_peak:     # the old code: hundreds of MiB for this block
        assert report.peak_rss - report.rss_before < 64 << 20
    small = load_checkpoint(write_tiny_checkpoint(tmp_path / "fp8-small", fp8_block=(8, 8)))
    assert small.report.fp8_tensors == report.fp8_tensors


def test_a_symlinked_file_in_the_hubs_cache_layout_still_loads(tmp_path: Path) -> None:
    """Hugging Face's cache links a snapshot's files to blobs elsewhere: a link to a regular
    file is followed (only what it names is read: the file the directory says it holds)."""
    path = write_tiny_checkpoint(tmp_path / "snapshot")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("config.json", "model.safetensors"):
        (path / name).rename(blobs / name)
        (path / name).symlink_to(blobs / name)
    assert load_checkpoint(path).report.tensors > 0


def test_shards_named_outside_the_directory_are_refused(tmp_path: Path) -> None:
    path = _directory_with(tmp_path, "model.safetensors.index.json")
    for shard in ("../model.safetensors", "/etc/passwd", "..", "."):
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": shard}}))
        with pytest.raises(ValueError, match=f"shard {shard!r} is not a file in"):
            load_checkpoint(path)


def _nan(tensors: Tensors) -> None:
    tensors["model.layers.0.self_attn.kv_b_proj.weight"].fill_(float("nan"))


def test_nan_weights_load_and_are_caught_where_they_act(tmp_path: Path) -> None:
    """Values are the model's business, not the loader's: NaN weights load (checking every
    value would read the whole checkpoint twice); the engine refuses their logits
    (tests/mla/test_engine_callers.py, tests/cli/test_hostile_checkpoints.py)."""
    loaded = load_checkpoint(write_tiny_checkpoint(tmp_path / "nan", tensors=_nan))
    assert bool(loaded.weights.layers[0].attention.kv_b_proj.isnan().all())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"theta": 1.0, "rope_type": "yarn"}, "yarn needs theta > 1 (it divides by ln(theta))"),
    ({"beta_fast": float("nan")}, "beta_fast must be a finite number > 0, got nan"),
    ({"attention_factor": 0.0}, "attention_factor must be a finite number > 0, got 0.0"),
    ({"mscale": -1.0}, "mscale must be a finite number >= 0, got -1.0"),
    ({"rope_type": "longrope"}, "rope_type must be 'default', 'linear' or 'yarn'"),
])
def test_a_rope_config_built_in_code_is_checked_too(kwargs: dict[str, Any],
                                                     message: str) -> None:
    """The engine divided by zero at construction for yarn with theta 1 (ZeroDivisionError)."""
    from app.model import RopeConfig

    with pytest.raises(ValueError, match=re.escape(f"RopeConfig: {message}")):
        RopeConfig(**kwargs)
