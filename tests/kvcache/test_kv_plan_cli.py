"""``python -m app kv-plan``: the TOML schema, the plan and its errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.cli import main
from app.commands.kv_plan import load_plan_config, make_plan, parse_memory

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kv_plan.toml"


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["kv-plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_example_plan_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--config", str(EXAMPLE))
    assert code == 0
    assert "48 layers in 6 KV-cache group(s)" in out
    assert "FullAttentionManager" in out and "SlidingWindowManager" in out
    assert "budget 40.00 GiB: 81920 blocks" in out
    assert "max concurrent requests of 32768 tokens" in out


def test_example_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--config", str(EXAMPLE), "--json", "--memory", "1GiB",
                           "--max-model-len", "4096")
    assert code == 0
    plan = json.loads(out)
    assert plan["num_layers"] == 48 and len(plan["groups"]) == 6
    assert plan["bytes_per_block"] == 2 * 16 * 8 * 128 * 2 * 8
    assert plan["num_blocks"] == 2**30 // plan["bytes_per_block"]
    assert plan["usable_blocks"] == plan["num_blocks"] - 1
    assert plan["groups"][0]["blocks_per_request"] == 256
    assert plan["max_concurrent_requests"] == plan["usable_blocks"] // plan["blocks_per_request"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return path


def test_mla_mamba_sink_and_custom_kinds(tmp_path: Path) -> None:
    path = write(tmp_path, """
[cache]
block_size = 64
[[layers]]
name = "mla.{i}"
count = 2
spec = "mla"
kv_lora_rank = 512
qk_rope_head_dim = 64
dtype = "bf16"
[[layers]]
name = "sink"
spec = "app.kvcache:SinkFullAttentionSpec"
num_kv_heads = 1
head_size = 576
dtype = "bf16"
sink_len = 128
""")
    specs, options = load_plan_config(path)
    assert options["cache"].block_size == 64
    assert specs["mla.0"].head_size == 576 and specs["mla.1"].block_size == 64
    plan = make_plan(specs, memory=parse_memory("1GiB"), max_model_len=1000)
    (group,) = plan["groups"]
    assert group["manager"] == "FullAttentionManager" and group["num_layers"] == 3
    assert plan["reserved_blocks"] == 0  # the sink layer joined the MLA group (first spec rules)
    mamba = write(tmp_path, """
[[layers]]
name = "m"
spec = "mamba"
shapes = [[4, 64], [8, 16]]
dtypes = ["bf16", "float32"]
""")
    specs, _ = load_plan_config(mamba)
    plan = make_plan(specs, max_model_len=10_000)
    assert plan["groups"][0]["manager"] == "MambaManager"
    assert plan["blocks_per_request"] == 2


@pytest.mark.parametrize(("text", "message"), [
    ('[[layers]]\nname = "a"\nspec = "nope"', "unknown spec kind 'nope'"),
    ('[[layers]]\nname = "a.{i}"\nspec = "full_attention"', "needs 'count' or 'indices'"),
    ('[[layers]]\nname = "a"\nspec = "full_attention"\nwindow = 3', "has no field"),
    ('[[layers]]\nname = "a"\nspec = "sliding_window"\nnum_kv_heads = 1\nhead_size = 8\n'
     'dtype = "bf16"', "cannot build SlidingWindowSpec"),
    ('[oops]\n', "unknown table"),
    ('layers = []', "no [[layers]]"),
    ('[[layers]]\nname = "a"\nspec = "app.kvcache:KVCacheManager"', "not a KVCacheSpec"),
    ('[plan]\nmemry = 3\n[[layers]]\nname = "a"\nspec = "mla"', "unknown [plan] key"),
])
def test_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                       message: str) -> None:
    code, _, err = run_cli(capsys, "--config", str(write(tmp_path, text)))
    assert code == 2
    assert message in err


def test_unregistered_custom_spec_names_the_layers(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, """
[[layers]]
name = "custom.{i}"
indices = [0, 3]
spec = "tests.kvcache.test_registry:Unrelated"
""")
    code, _, err = run_cli(capsys, "--config", str(path))
    assert code == 2
    assert "Unsupported KV cache spec type for layer custom.0" in err
    assert "Unsupported KV cache spec type for layer custom.3" in err


def test_missing_file_and_bad_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "--config", str(tmp_path / "none.toml"))[0] == 2
    assert "not valid TOML" in run_cli(capsys, "--config", str(write(tmp_path, "[[")))[2]


@pytest.mark.parametrize(("text", "size"), [
    ("40GiB", 40 * 2**30), ("512 MB", 512 * 10**6), ("1e9", 10**9), (4096, 4096),
    ("1.5KiB", 1536)])
def test_parse_memory(text: object, size: int) -> None:
    assert parse_memory(text) == size


@pytest.mark.parametrize("bad", ["lots", "-3GB", 0, "3 parsecs", math.inf, "1e999", 2**61])
def test_parse_memory_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="memory"):
        parse_memory(bad)


@pytest.mark.parametrize("bad", [True, [1], None])
def test_parse_memory_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match="memory: expected a size"):
        parse_memory(bad)


FP8_EXAMPLE = EXAMPLE.with_name("kv_plan_mla_fp8.toml")


@pytest.mark.parametrize(("kv_cache_dtype", "per_token"), [
    ("auto", 1152), ("fp8", 576), ("fp8_e4m3", 576), ("fp8_ds_mla", 656)])
def test_the_cache_dtype_sets_an_mla_layer_s_bytes_per_token(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, kv_cache_dtype: str,
        per_token: int) -> None:
    """``[cache] kv_cache_dtype`` (issue 36): DeepSeek's FP8 row is 656 B per token and layer,
    and the same budget holds 1152 / 656 = 1.76x the blocks of the bf16 cache."""
    text = FP8_EXAMPLE.read_text().replace('"fp8_ds_mla"', f'"{kv_cache_dtype}"')
    code, out, _ = run_cli(capsys, "--config", str(write(tmp_path, text)), "--json")
    assert code == 0
    plan = json.loads(out)
    group = plan["groups"][0]
    assert group["bytes_per_token_per_layer"] == [per_token]
    assert plan["bytes_per_block"] == 61 * 64 * per_token
    assert plan["num_blocks"] == (40 << 30) // plan["bytes_per_block"]
    code, text_out, _ = run_cli(capsys, "--config", str(FP8_EXAMPLE))
    assert code == 0 and "B/token/layer" in text_out and " 656 " in text_out


def test_a_bad_cache_dtype_names_the_file_and_the_key(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    text = FP8_EXAMPLE.read_text().replace('"fp8_ds_mla"', '"fp4"')
    code, _, err = run_cli(capsys, "--config", str(write(tmp_path, text)))
    assert code != 0 and "[cache]" in err and "kv_cache_dtype" in err and "'fp4'" in err
