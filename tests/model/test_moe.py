"""MoE routing as DeepSeek defines it, and the grouped expert dispatch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from app.model import MoE, MoEConfig, MoEWeights, route
from app.model.weights import MLPWeights


def _v3(**changes: object) -> MoEConfig:
    base = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4,
            "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    return MoEConfig(**{**base, **changes})  # type: ignore[arg-type]


def test_v3_bias_chooses_but_does_not_weigh() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0])
    r = route(logits, _v3(n_group=1, topk_group=1), bias)
    assert sorted(r.experts[0].tolist()) == [0, 2]          # expert 2 chosen through its bias
    scores = logits.sigmoid()[0]
    w = torch.stack([scores[0], scores[2]])
    expected = w / w.sum() * 2.5                             # weighed by the plain scores
    got = dict(zip(r.experts[0].tolist(), r.weights[0].tolist(), strict=True))
    assert math.isclose(got[0], float(expected[0]), rel_tol=1e-6)
    assert math.isclose(got[2], float(expected[1]), rel_tol=1e-6)


def test_v3_groups_score_their_best_two_and_limit_the_choice() -> None:
    # groups of 2: {0,1} {2,3} {4,5} {6,7}; group {6,7} holds the single best expert but its
    # pair sums lowest, so with topk_group 2 neither 6 nor 7 can be chosen.
    logits = torch.tensor([[1.0, 1.0, 0.9, 0.9, -3.0, -3.0, 3.0, -9.0]])
    r = route(logits, _v3(), torch.zeros(8))
    assert sorted(r.experts[0].tolist()) == [0, 1]
    r = route(logits, _v3(topk_group=4), torch.zeros(8))
    assert 6 in r.experts[0].tolist()


def test_v2_softmax_greedy_and_group_limited_greedy() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0, 2.8, 0.0, 0.0, 0.0]])
    greedy = _v3(scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                 norm_topk_prob=False, routed_scaling_factor=16.0)
    r = route(logits, greedy, None)
    probs = logits.softmax(dim=-1)[0]
    assert sorted(r.experts[0].tolist()) == [1, 4]
    assert torch.allclose(r.weights[0].sort().values, (probs[[4, 1]] * 16.0).sort().values)
    # group_limited_greedy: groups {0..3} {4..7} scored by their best; 1 group kept
    limited = _v3(scoring_func="softmax", topk_method="group_limited_greedy", n_group=2,
                  topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    r = route(logits, limited, None)
    assert sorted(r.experts[0].tolist()) == [1, 2]


@pytest.mark.parametrize("sync_free", [False, True])
def test_grouped_dispatch_equals_a_per_token_loop(sync_free: bool) -> None:
    """The grouped experts, and (``sync_free``, what runs off the CPU for a small batch: issue
    35) every expert on every token weighted by the routing: both equal the per-token sum."""
    torch.manual_seed(0)
    cfg = _v3(n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
              n_shared_experts=1)
    d, inter = 16, 4
    weights = MoEWeights(gate=torch.randn(8, d, dtype=torch.float64).float(),
                         score_bias=torch.randn(8) * 0.1,
                         experts_gate_up=torch.randn(8, 2 * inter, d, dtype=torch.float64),
                         experts_down=torch.randn(8, d, inter, dtype=torch.float64),
                         shared=MLPWeights(torch.randn(2 * inter, d, dtype=torch.float64),
                                           torch.randn(d, inter, dtype=torch.float64)))
    moe = MoE(cfg, weights, torch.float64, torch.device("cpu"), sync_free=sync_free)
    x = torch.randn(11, d, dtype=torch.float64)
    got = moe(x)
    routing = moe.route(x)
    for t in range(11):
        want = torch.zeros(d, dtype=torch.float64)
        for e, w in zip(routing.experts[t].tolist(), routing.weights[t].tolist(), strict=True):
            h = weights.experts_gate_up[e] @ x[t]
            want += w * (weights.experts_down[e] @ (F.silu(h[:inter]) * h[inter:]))
        assert weights.shared is not None
        h = weights.shared.gate_up_proj @ x[t]
        want += weights.shared.down_proj @ (F.silu(h[:inter]) * h[inter:])
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
    # No rows (an empty chunk): no expert runs, the shape is kept.
    empty = moe(x[:0])
    assert empty.shape == (0, d) and empty.dtype == torch.float64


def test_the_dense_experts_only_below_their_row_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU by default; a batch beyond ``DENSE_EXPERT_ROWS`` token-expert rows (a long
    prefill) goes back to the grouped experts."""
    import app.model.moe as moe_module

    cfg = _v3()
    weights = MoEWeights(gate=torch.randn(8, 16), score_bias=None,
                         experts_gate_up=torch.randn(8, 8, 16),
                         experts_down=torch.randn(8, 16, 4), shared=None)
    assert not MoE(cfg, weights, torch.float32, torch.device("cpu")).sync_free
    assert MoE(cfg, weights, torch.float32, torch.device("meta")).sync_free
    moe = MoE(cfg, weights, torch.float32, torch.device("cpu"), sync_free=True)
    calls: list[int] = []
    real = moe._every_expert
    monkeypatch.setattr(moe, "_every_expert", lambda x, r: calls.append(len(x)) or real(x, r))
    monkeypatch.setattr(moe_module, "DENSE_EXPERT_ROWS", 8 * 3)
    moe(torch.randn(3, 16))
    moe(torch.randn(4, 16))
    assert calls == [3]
