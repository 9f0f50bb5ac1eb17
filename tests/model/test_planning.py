"""Prefill and decode are planned alike: a free function, an executor method and a model
method for each, and a plan whose ``metadata`` is what the kind's ``prepare_metadata`` takes."""

from __future__ import annotations

import torch

from app.backends import MLADecodeMetadata, MLAPrefillMetadata
from app.config import EngineConfig
from app.containers import create_container
from app.model import (
    DecodePlan,
    DeepseekModel,
    PrefillPlan,
    PrefillSlice,
    StepPlan,
    plan_decode_step,
    plan_prefill_step,
)
from tests.model.conftest import BLOCK, VOCAB, tiny_model

CPU = torch.device("cpu")


def _model() -> DeepseekModel:
    arch, weights = tiny_model(layers=2)
    config = EngineConfig(model=arch.model_config(torch.float32))
    container = create_container(config)
    return DeepseekModel(config, weights, container.mla_prefill_backend(),
                         container.mla_decode_backend(), num_blocks=32, block_size=BLOCK,
                         device=CPU, compute_dtype=torch.float32)


def test_prefill_and_decode_plans_carry_their_backends_metadata() -> None:
    model = _model()
    tables = [torch.arange(1, 5, dtype=torch.int64), torch.arange(5, 9, dtype=torch.int64)]
    batch = [PrefillSlice(tables[0], 0, 10), PrefillSlice(tables[1], 3, 6)]
    plan = model.plan_prefill(batch)
    assert isinstance(plan, PrefillPlan) and StepPlan is PrefillPlan
    assert isinstance(plan.metadata, MLAPrefillMetadata) and plan.metadata.total_q == 16
    free = plan_prefill_step(batch, block_size=BLOCK, device=CPU,
                             context_chunk_tokens=model.config.attention.context_chunk_tokens)
    same = model.prefill_executors[1].plan(batch)
    for other in (free, same):
        assert torch.equal(other.new_slots, plan.new_slots)
        assert torch.equal(other.metadata.cu_seqlens_q, plan.metadata.cu_seqlens_q)

    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(0))
    by_batch = model.prefill(ids, batch)
    assert torch.equal(model.prefill(ids, plan), by_batch)          # a plan or its batch

    decode = model.plan_decode([t.to(torch.int32) for t in tables], [10, 9], 2)
    assert isinstance(decode, DecodePlan) and isinstance(decode.metadata, MLADecodeMetadata)
    assert decode.metadata.seq_lens_list == (12, 11) and decode.metadata.query_len == 2
    free_decode = plan_decode_step([t.to(torch.int32) for t in tables], [10, 9], 2, BLOCK, CPU)
    same_decode = model.decode_executors[0].plan([t.to(torch.int32) for t in tables], [10, 9], 2)
    for other_decode in (free_decode, same_decode):
        assert torch.equal(other_decode.slots, decode.slots)
        assert other_decode.metadata.seq_lens_list == decode.metadata.seq_lens_list
    hidden = model.decode(torch.tensor([3, 4, 5, 6]), decode)
    assert hidden.shape == (4, model.hidden_size)
    assert model.decode_backend.metadata is decode.metadata         # handed over as is
