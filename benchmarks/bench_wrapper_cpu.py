#!/usr/bin/env python
"""The backends' own time per call on the CPU (issue 35), printed as JSON.

The whole call (checks, allocations, layouts: what runs on the host before and after a GPU
kernel) against the bare kernel hook, with a stand-in kernel that returns at once: FLASHINFER
prefill (``run_prefill_new_tokens`` vs ``_launch``, 64 tokens, 16 heads, bf16) and
FLASHINFER_MLA decode (``run_decode`` vs ``_run_decode``, 32 requests, 16 heads, bf16). Median
microseconds per call over ``--rounds`` rounds of ``--calls`` calls. To compare two trees, run
it with ``PYTHONPATH`` pointing at each, alternating: ``wrapper_us`` is the call minus its hook.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from app._types import DeviceCapability
from app.backends.decode import flashinfer_mla as fim_mod
from app.backends.prefill import flashinfer as fi_mod
from app.backends.prefill.base import MLAPrefillMetadata


class _InstantWrapper:
    """A flashinfer wrapper whose plan and run return at once (run's own signature, so the
    backend asks for the LSE as with flashinfer 0.7.2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def plan(self, *args: Any, **kwargs: Any) -> None:
        pass

    def run(self, *args: Any, out: Any = None, lse: Any = None, return_lse: bool = False,
            lse_base: str = "log2", lse_layout: str = "NH", **kwargs: Any) -> Any:
        return (out, lse) if return_lse else out


def _calls() -> dict[str, Callable[[], object]]:
    fi_mod._probe = lambda: types.SimpleNamespace(  # type: ignore[assignment]
        BatchPrefillWithRaggedKVCacheWrapper=_InstantWrapper)
    fim_mod._probe = lambda: types.SimpleNamespace(  # type: ignore[assignment]
        wrapper_cls=_InstantWrapper, plan_metadata=types.SimpleNamespace(csr=lambda **k: k))
    sm90, heads, tokens, batch = DeviceCapability(9, 0), 16, 64, 32
    prefill = type("CpuFlashInfer", (fi_mod.FlashInferPrefillBackend,),
                   {"requires_cuda": False})(
        num_heads=heads, scale=0.07, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, device_capability=sm90)
    prefill.prepare_metadata(MLAPrefillMetadata.build([tokens], [], device="cpu"))
    bf16 = torch.bfloat16
    q, k = torch.randn(tokens, heads, 192, dtype=bf16), torch.randn(tokens, heads, 192, dtype=bf16)
    v = torch.randn(tokens, heads, 256, dtype=bf16)[..., 128:]
    layout = prefill._step().new_tokens
    out, lse = torch.empty(tokens, heads, 128, dtype=bf16), torch.empty(heads, tokens)
    decode = type("CpuFlashInferMLA", (fim_mod.FlashInferMLADecodeBackend,),
                  {"requires_cuda": False})(
        num_heads=heads, scale=0.07, kv_lora_rank=512, qk_rope_head_dim=64,
        kv_cache_dtype=bf16, device_capability=sm90, block_size=16)
    decode.prepare_metadata(torch.arange(batch * 4, dtype=torch.int32).view(batch, 4),
                            torch.full((batch,), 50, dtype=torch.int32), 1)
    cache = torch.randn(batch * 4, 16, 576, dtype=bf16)
    dq = torch.randn(batch, 1, heads, 576, dtype=bf16)
    dout, meta = torch.empty(batch, 1, heads, 512, dtype=bf16), decode.metadata
    return {
        "prefill_call": lambda: prefill.run_prefill_new_tokens(q, k, v, True),
        "prefill_launch": lambda: prefill._launch(-1, layout, q, k, v, True, out, lse),
        "decode_call": lambda: decode.run_decode(dq, cache),
        "decode_launch": lambda: decode._run_decode(meta, dq, cache, dout, None, 0.07, 1.0),
    }


def main() -> None:
    """Time the calls, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    calls = _calls()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        for _ in range(200):
            fn()
    for _ in range(args.rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    us = {name: round(statistics.median(v), 2) for name, v in samples.items()}
    print(json.dumps({"us_per_call": us,
                      "wrapper_us": {kind: round(us[f"{kind}_call"] - us[f"{kind}_launch"], 2)
                                     for kind in ("prefill", "decode")},
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
