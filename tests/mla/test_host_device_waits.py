"""How often a decode step makes the host wait for the GPU (issue 35), counted without a GPU.

The H100 ran the main job's engine at 18 ms a step for a one-layer model: host-bound. A step
that waits for the device cannot run ahead of it (nor be captured as a CUDA graph). Here the
engine runs the main job's configuration (FLASHINFER prefill, FLASHINFER_MLA decode on an
SM90 platform, their kernels stand-ins) on a CUDA device simulated on the CPU
(``tests._simulated_cuda``), and every host-device crossing of a decode step is recorded: the
step may wait once, to read the sampled tokens (with their margins and log-probabilities, which
also carry the non-finite check); every upload is asynchronous, from pinned memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from app.backends.decode import flashinfer_mla as fim_mod
from app.backends.prefill import flashinfer as fi_mod
from app.config import EngineConfig
from app.containers import create_container
from app.mla.engine import MLAEngine
from app.mla.requests import Request
from app.model.config import ModelConfig
from app.model.random import random_config, random_weights
from tests._simulated_cuda import SimTensor, SimulatedCuda
from tests.backends.decode import _kernel_fakes as decode_fakes
from tests.backends.prefill import _kernel_fakes as prefill_fakes

#: runs decode steps under a dispatch counter: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

DIMS = {"num_heads": 2, "hidden_size": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 64, "v_head_dim": 16}


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimulatedCuda]:
    flashinfer = pytest.importorskip("flashinfer")
    monkeypatch.setenv("APP_PLATFORM", "cuda:9.0")
    monkeypatch.setattr(fi_mod, "WORKSPACE_BYTES", 1 << 16)
    monkeypatch.setattr(fim_mod, "WORKSPACE_BYTES", 1 << 16)
    with SimulatedCuda(monkeypatch) as simulated:
        prefill = prefill_fakes.FakeFlashInfer(flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
        wrapper = prefill.BatchPrefillWithRaggedKVCacheWrapper
        monkeypatch.setattr(wrapper, "run", simulated.as_kernel(wrapper.run))
        decode = decode_fakes.FakeFlashInferMLA()
        monkeypatch.setattr(decode, "_wrapper_attention",
                            simulated.as_kernel(decode._wrapper_attention))
        monkeypatch.setattr(fi_mod, "_probe", lambda: prefill)
        monkeypatch.setattr(fim_mod, "_probe", lambda: decode)
        yield simulated


def _engine(spec: int, sizes: tuple[int, ...] = ()) -> MLAEngine:
    arch = random_config(ModelConfig(dtype=torch.bfloat16, **DIMS), num_layers=1,
                         vocab_size=97, moe=True)
    base = EngineConfig.from_dict({"cache": {"block_size": 16, "num_blocks": 64}})
    config = EngineConfig(model=arch.model_config(torch.bfloat16), cache=base.cache)
    return MLAEngine(create_container(config), weights=random_weights(arch, torch.bfloat16, 0),
                     step_tokens=256, num_speculative_tokens=spec, decode_batch_sizes=sizes)


def _decode_step(engine: MLAEngine, sim: SimulatedCuda) -> Any:
    for i, n in enumerate((21, 9, 30)):
        engine.add_request(Request(f"r{i}", [(7 * i + j) % 90 for j in range(n)],
                                   max_new_tokens=8))
    while True:
        out = engine.step()
        if not out.num_prefill_tokens and out.num_decode_tokens:
            break
    with sim.recording():
        out = engine.step()
    assert out.num_decode_tokens and not out.num_prefill_tokens
    return out


@pytest.mark.parametrize(("spec", "sizes"), [(0, ()), (3, ()), (3, (8,))])
def test_a_decode_step_waits_for_the_device_once(sim: SimulatedCuda, spec: int,
                                                 sizes: tuple[int, ...]) -> None:
    """Plain and speculative steps, and a step padded to a batch of 8 (graph-ready shapes)."""
    engine = _engine(spec, sizes)
    assert engine.decode_backend_class is fim_mod.FlashInferMLADecodeBackend
    assert engine.backend_class is fi_mod.FlashInferPrefillBackend
    assert isinstance(engine.model.caches[0].data, SimTensor)     # the cache is "on the GPU"
    _decode_step(engine, sim)
    waits = sim.waits()
    assert len(waits) == 1, "\n".join(map(str, waits))
    assert waits[0].kind == "readback" and "greedy" in waits[0].where
    uploads = [e for e in sim.events if e.kind == "async upload"]
    assert uploads, "the step's inputs reach the device by asynchronous copies"
    # flashinfer's plan copies the CSR metadata with non_blocking=True: from pinned memory
    plan = fim_mod._probe().plans[-1]["metadata"]
    assert all(sim.is_pinned(t) for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                          plan.kv_len_arr))


def test_the_harness_sees_what_used_to_wait(sim: SimulatedCuda,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The count is not vacuous: a plain ``.to(device)`` of the step's token ids, the cache
    reading its slots back and the three separate readbacks of the sampled rows (what the
    decode step did before issue 35) are each seen."""
    from app.model import cache as cache_mod
    from app.model import model as model_mod

    monkeypatch.setattr(model_mod, "copy_to_device", lambda host, device: host.to(device))
    write = cache_mod.PagedLatentCache.write
    monkeypatch.setattr(cache_mod.PagedLatentCache, "write",
                        lambda self, slots, latent, bounds=None: write(self, slots, latent))
    engine = _engine(0)
    _decode_step(engine, sim)
    kinds = sorted({(e.kind, e.where.split(" ")[0].split(":")[0]) for e in sim.waits()})
    assert ("upload", "model/model.py") in kinds
    assert ("readback", "model/cache.py") in kinds

