"""workers.experts, beyond what notebook 15 checks when it runs the worker on 4 real ranks
(top-2, renormalised gates, four capacity factors, two routers): the dispatch order, where
the received rows go, the splits refused before any communication, and one cheap 2-rank
run of a Switch-style top-1 layer; for the folded layout (notebook 15 runs EP 2 x EDP 2):
the local experts' permutation, the refusals, and the two other ways of splitting 4 ranks."""

import pytest
import torch

from trainscale import experts as ex
from trainscale.distributed import run_ranks
from trainscale.workers import experts as wx


def _state(layer: ex.MoELayer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in layer.named_parameters()}


def test_dispatch_order_groups_rows_by_expert_then_preference_then_token():
    routing = ex.route(ex.sample_tokens(6, 4) @ ex.MoELayer(4, 4, 4).router.T, 2, None)
    order = wx._dispatch_order(routing)
    token, slot = order[:, 0], order[:, 1]
    experts = routing.experts[token, slot]
    assert len(order) == 12  # nothing dropped: 6 tokens x 2
    keys = list(zip(experts.tolist(), slot.tolist(), token.tolist(), strict=True))
    assert keys == sorted(keys)


def test_dropped_assignments_are_not_dispatched():
    routing = ex.route(ex.sample_tokens(8, 4, skew=3.0) @ ex.MoELayer(4, 4, 4).router.T, 2, 0.5)
    assert routing.dropped > 0
    assert len(wx._dispatch_order(routing)) == routing.kept.numel() - routing.dropped


def test_received_rows_meet_their_experts():
    layer = ex.MoELayer(4, 6, 4)
    rows = ex.sample_tokens(4, 4, seed=5)
    counts = torch.tensor([[1, 2], [0, 1]])  # rank 0 sends 1 row for my expert 2, 2 for 3; ...
    out = wx._experts_on_rows(layer, 2, rows, counts)
    for i, expert in enumerate([2, 3, 3, 3]):
        assert torch.allclose(out[i], layer.expert(expert, rows[i : i + 1])[0], atol=1e-15)


def test_loss_weights_are_fixed_float64():
    assert torch.equal(wx.loss_weights(4, 3), wx.loss_weights(4, 3))
    assert wx.loss_weights(4, 3).dtype == torch.float64


@pytest.mark.parametrize(
    ("experts", "tokens", "match"),
    [(6, 16, "experts must be divisible"), (8, 18, "tokens must be divisible")],
)
def test_worker_refuses_uneven_splits_before_communicating(experts, tokens, match):
    state = _state(ex.MoELayer(4, 4, experts))
    with pytest.raises(ValueError, match=match):
        wx.worker(0, 4, (state,), tokens, 1, (1.0,))
    with pytest.raises(ValueError, match="states"):
        wx.worker(0, 4, (), tokens, 1, (1.0,))


@pytest.mark.slow  # two real gloo ranks
def test_switch_style_top_1_on_two_ranks_equals_the_per_token_reference():
    """Top-1 with the raw probability as the gate (not renormalised), as in Switch, checked
    against the per-token reference (no code shared with the worker's layer), and the bytes
    that arrived against the reference's assignments that cross ranks."""
    tokens, hidden = 12, 4
    layer = ex.MoELayer(hidden, 6, 4, 1, 1.0, renormalise=False, seed=7)
    state = _state(layer)
    results = run_ranks(wx.worker, 2, (state,), tokens, 1, (1.0,), 0, 1.0, False, timeout=120)
    x = ex.sample_tokens(tokens, hidden, skew=1.0).requires_grad_(True)
    leaves = [
        p.detach().clone().requires_grad_(True) for p in (layer.router, layer.w_up, layer.w_down)
    ]
    run = ex.per_token_reference(x, *leaves, 1, 1.0, groups=2, renormalise=False)
    loss = (run.output * wx.loss_weights(tokens, hidden)).sum()
    x_grad, router_grad, w_up_grad, _ = torch.autograd.grad(loss, [x, *leaves])
    got = [r[0][0] for r in results]
    assert torch.allclose(torch.cat([g["output"] for g in got]), run.output, atol=1e-12)
    assert torch.allclose(torch.cat([g["input gradient"] for g in got]), x_grad, atol=1e-12)
    w_up = torch.cat([g["expert gradients"]["w_up"] for g in got])
    assert torch.allclose(w_up, w_up_grad, atol=1e-12)
    assert sum(g["dropped"] for g in got) == run.dropped > 0
    # the router is replicated: its gradient, summed over both ranks, is the whole one
    assert all(torch.allclose(g["router gradient"], router_grad, atol=1e-12) for g in got)
    # bytes that arrived from the other rank: one float64 row per crossing assignment
    crossing = [0, 0]
    for token, expert in run.kept:
        if token // 6 != expert // 2:
            crossing[expert // 2] += 1
    assert all(g["all rows arrived"] for g in got)
    assert [g["bytes received"]["dispatch"][1 - r] for r, g in enumerate(got)] == [
        n * hidden * 8 for n in crossing
    ]


# --- expert parallelism folded into data parallelism ------------------------------------------


def test_local_experts_meet_their_rows():
    state = wx.folding_state(4, 6, 4)
    rows = ex.sample_tokens(5, 4, seed=3)
    # from rank 0: 1 row for my expert 0, 2 for expert 1; from rank 1: 2 rows for expert 0
    counts = torch.tensor([[1, 2], [2, 0]])
    out = wx._local_experts(rows, counts, state["w_up"][2:], state["w_down"][2:])
    layer = ex.MoELayer(4, 6, 4)
    for i, expert in enumerate([2, 3, 3, 2, 2]):
        assert torch.allclose(out[i], layer.expert(expert, rows[i : i + 1])[0], atol=1e-15)


def test_folding_worker_refuses_before_communicating():
    state = wx.folding_state(4, 6, 4)
    with pytest.raises(ValueError, match="ep must divide"):
        wx.folding_worker(0, 4, state, 16, 2, 3)
    with pytest.raises(ValueError, match="tokens must be divisible"):
        wx.folding_worker(0, 4, state, 18, 2, 2)
    with pytest.raises(ValueError, match="missing"):
        wx.folding_worker(0, 4, {"router": state["router"]}, 16, 2, 2)


@pytest.mark.slow  # real gloo ranks, twice
@pytest.mark.parametrize("ep", [1, 4])
def test_folding_with_all_or_no_expert_parallelism_equals_the_reference(ep):
    """EP 4 (every expert on one rank, EDP 1: no expert reduction) and EP 1 (every rank holds
    every expert, EDP 4: the experts reduce like the dense weights)."""
    state = wx.folding_state(8, 16, 4, seed=2)
    results = run_ranks(wx.folding_worker, 4, state, 32, 2, ep, 1, 1.5, 0.25, timeout=120)
    reference = wx.folding_reference(state, 32, 2, 1, 1.5, 0.25)
    for result in results:
        first, last = result["experts"]
        assert last - first + 1 == 4 // ep
        for name in wx.FOLDING_WEIGHTS:
            want = {key: reference[key][name] for key in ("gradients", "weights")}
            if name in ("w_up", "w_down"):
                want = {key: value[first : last + 1] for key, value in want.items()}
            for key in ("gradients", "weights"):
                assert torch.allclose(result[key][name], want[key], rtol=0, atol=1e-13)
    assert results[0]["groups"]["edp"] == [list(range(r, 4, ep)) for r in range(ep)]
