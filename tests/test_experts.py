"""experts: capacity, routing with drops, the balancing loss, the router z-loss and rounding,
the MoE layer, EP traffic (the modules routing, layer and traffic; dropless and groups have
test files of their own)."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale import experts as ex

# --- capacity and drops ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "factor", "expected"),
    [
        (16, 8, 2, 1.0, 4),  # 1.0 * 16 * 2 / 8 = 4
        (64, 8, 2, 1.25, 20),  # 1.25 * 128 / 8 = 20 exactly, no rounding up
        (10, 4, 1, 1.0, 3),  # 2.5 -> 3
        (64, 8, 1, 0.5, 4),  # 0.5 * 8 = 4
        (3, 3, 2, 0.375, 1),  # 0.375 * 6 / 3 = 0.75 -> 1
    ],
)
def test_capacity_by_hand(tokens, experts, top_k, factor, expected):
    assert ex.expert_capacity(tokens, experts, top_k, factor) == expected


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tokens": 0, "experts": 4}, "tokens"),
        ({"tokens": 8, "experts": 0}, "experts"),
        ({"tokens": 8, "experts": 4, "top_k": 5}, "top_k"),
        ({"tokens": 8, "experts": 4, "capacity_factor": 0}, "capacity_factor"),
    ],
)
def test_capacity_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ex.expert_capacity(**kwargs)


def test_dropped_assignments_by_hand():
    # over 16: 18 -> 2, 30 -> 14, 19 -> 3, 54 -> 38; the rest fit: 57
    assert ex.dropped_assignments([18, 30, 0, 19, 4, 54, 3, 0], 16) == 57
    assert ex.dropped_assignments(torch.tensor([4, 4]), 4) == 0
    with pytest.raises(ValueError, match="loads"):
        ex.dropped_assignments([3, -1], 2)


# --- routing ----------------------------------------------------------------------------------

PROBABILITIES = torch.tensor(
    [[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.3, 0.6], [0.1, 0.8, 0.1]], dtype=torch.float64
)
LOGITS = PROBABILITIES.log()  # softmax(log p) = p, as the rows sum to 1


def test_route_picks_top_k_and_renormalises_or_not():
    kept_all = ex.route(LOGITS, 2, None)
    assert kept_all.experts.tolist() == [[0, 1], [0, 1], [2, 1], [1, 0]]
    assert kept_all.gates[0].tolist() == pytest.approx([0.7 / 0.9, 0.2 / 0.9])
    raw = ex.route(LOGITS, 2, None, renormalise=False)
    assert raw.gates[0].tolist() == pytest.approx([0.7, 0.2])
    assert kept_all.dropped == 0
    assert kept_all.loads.tolist() == [3, 4, 1]


def test_first_choices_are_served_before_second_choices():
    # capacity 1 (0.375 * 4 * 2 / 3 = 1): expert 0 takes token 0 (first choice) and
    # drops token 1; expert 1 takes token 3's first choice, so token 0's second choice,
    # earlier in token order, is dropped; expert 2 takes token 2.
    routing = ex.route(LOGITS, 2, 0.375)
    assert routing.kept.tolist() == [[True, False], [False, False], [True, False], [True, False]]
    assert routing.dropped == 5  # 8 assignments, 3 kept


def test_each_group_has_its_own_capacity():
    # two groups of 2 tokens: capacity ceil(1.0 * 2 * 1 / 3) = 1 per expert and group.
    # Group 0: tokens 0 and 1 both want expert 0, token 1 dropped. Group 1: experts 2 and 1.
    routing = ex.route(LOGITS, 1, 1.0, groups=2)
    assert routing.kept[:, 0].tolist() == [True, False, True, True]
    one_group = ex.route(LOGITS, 1, 1.0)  # capacity ceil(4 / 3) = 2: nothing dropped
    assert one_group.dropped == 0


def test_softmax_over_the_top_k_logits_is_the_renormalised_softmax():
    """Mixtral's Softmax(TopK(logits)) and GShard's renormalised top-k are one gate."""
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    routing = ex.route(logits, 2, None)
    top_logits = logits.gather(1, routing.experts)
    assert torch.allclose(routing.gates, top_logits.softmax(dim=-1), atol=1e-15)


def test_route_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        ex.route(LOGITS, 4)
    with pytest.raises(ValueError, match="groups"):
        ex.route(LOGITS, 1, groups=5)
    with pytest.raises(ValueError, match="logits"):
        ex.route(LOGITS[0], 1)


@given(st.integers(1, 40), st.integers(1, 6), st.floats(0.1, 3.0), st.integers(1, 4))
def test_no_expert_keeps_more_than_its_capacity(tokens, experts, factor, groups):
    groups = min(groups, tokens)
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
    top_k = min(2, experts)
    routing = ex.route(logits, top_k, factor, groups=groups)
    for rows in torch.tensor_split(torch.arange(tokens), groups):
        capacity = ex.expert_capacity(len(rows), experts, top_k, factor)
        chosen = routing.experts[rows][routing.kept[rows]]
        kept = torch.bincount(chosen, minlength=experts)
        assert int(kept.max()) <= capacity
        offered = torch.bincount(routing.experts[rows].reshape(-1), minlength=experts)
        assert int((~routing.kept[rows]).sum()) == ex.dropped_assignments(offered, capacity)


# --- the balancing loss ---------------------------------------------------------------------


def test_balancing_loss_by_hand():
    probabilities = torch.tensor([[0.7, 0.3], [0.4, 0.6]], dtype=torch.float64)
    # f = [0.5, 0.5], P = [0.55, 0.45]: 2 * (0.275 + 0.225) = 1.0
    assert ex.load_balancing_loss(probabilities, torch.tensor([[0], [1]])).item() == 1.0
    # f = [1, 0]: 2 * 0.55 = 1.1
    assert ex.load_balancing_loss(probabilities, torch.tensor([[0], [0]])).item() == 1.1


def test_balancing_loss_is_one_when_even_and_e_when_collapsed():
    even = torch.full((8, 4), 0.25, dtype=torch.float64)
    assert ex.load_balancing_loss(even, torch.tensor([[0, 1], [2, 3]] * 4)).item() == 1.0
    collapsed = torch.zeros(8, 4, dtype=torch.float64)
    collapsed[:, 0] = 1.0
    assert ex.load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long)).item() == 4.0


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (8, 4), (6, 3), (5, 1)])
def test_balancing_loss_peaks_at_e_over_k(experts, top_k):
    """All tokens on the same k experts, with all the probability: f = 1/k on each of
    them, P sums to 1 over them, so E * sum f P = E * (1/k) * 1 = E/k (8/2 = 4, 8/4 = 2,
    6/3 = 2, Switch's k = 1: E = 5). An even router still gives 1."""
    collapsed = torch.zeros(6, experts, dtype=torch.float64)
    collapsed[:, :top_k] = 1 / top_k
    chosen = torch.arange(top_k).repeat(6, 1)
    assert ex.load_balancing_loss(collapsed, chosen).item() == pytest.approx(experts / top_k)
    even = torch.full((experts, experts), 1 / experts, dtype=torch.float64)
    rotations = torch.stack([(torch.arange(top_k) + t) % experts for t in range(experts)])
    assert ex.load_balancing_loss(even, rotations).item() == pytest.approx(1.0)


@given(st.integers(2, 8), st.integers(1, 8), st.integers(1, 12), st.integers(0, 10_000))
def test_balancing_loss_never_exceeds_e_over_k(experts, top_k, tokens, seed):
    top_k = min(top_k, experts)
    g = torch.Generator().manual_seed(seed)
    probabilities = torch.rand(tokens, experts, generator=g, dtype=torch.float64)
    probabilities /= probabilities.sum(dim=1, keepdim=True)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    assert ex.load_balancing_loss(probabilities, chosen).item() <= experts / top_k + 1e-12


def test_balancing_loss_gradient_flows_through_the_probabilities_only():
    logits = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)
    loss = ex.load_balancing_loss(logits.softmax(-1), torch.tensor([[0], [0], [0], [1]]))
    loss.backward()
    # f = [3/4, 1/4]: the loss grows with P_0, so each token's logit 0 gets a positive
    # gradient: d/dz0 of 2 * (3/4 p0 + 1/4 p1) / 4 at p = 1/2 is (3/4 - 1/4) * 1/4 / 2 * 2 / 4
    assert logits.grad[:, 0].tolist() == pytest.approx([1 / 16] * 4)
    assert logits.grad[:, 1].tolist() == pytest.approx([-1 / 16] * 4)


def test_balance_router_evens_the_load_and_leaves_the_experts():
    layer = ex.MoELayer(8, 16, 8, 2, None)
    x = ex.sample_tokens(64, 8, skew=2.0)
    experts_before = layer.w_up.detach().clone()
    before = layer.route(x).loads
    losses = ex.balance_router(layer, x, 30)
    after = layer.route(x).loads
    assert len(losses) == 31
    assert losses[-1] < 1.05 < 1.5 < losses[0]
    assert int(after.max() - after.min()) < int(before.max() - before.min())
    assert torch.equal(layer.w_up, experts_before)


# --- the layer ------------------------------------------------------------------------------


def test_layer_sums_the_gated_experts_token_by_token():
    layer = ex.MoELayer(4, 6, 3, 2, None)
    x = ex.sample_tokens(5, 4, seed=1)
    out = layer(x)
    routing = layer.last_routing
    for t in range(5):
        expected = sum(
            routing.gates[t, s] * layer.expert(int(routing.experts[t, s]), x[t : t + 1])[0]
            for s in range(2)
        )
        assert torch.allclose(out[t], expected, atol=1e-15)


def test_a_dropped_assignment_adds_nothing():
    layer = ex.MoELayer(4, 6, 3, 1, 0.1)  # capacity ceil(0.1 * 6 / 3) = 1 per expert
    x = ex.sample_tokens(6, 4, seed=2)
    out = layer(x)
    dropped = ~layer.last_routing.kept[:, 0]
    assert int(dropped.sum()) >= 3  # six tokens, at most three kept
    assert torch.equal(out[dropped], torch.zeros_like(out[dropped]))


def test_identical_experts_with_renormalised_gates_act_as_one():
    layer = ex.MoELayer(4, 6, 4, 4, None)  # every token uses all four experts
    with torch.no_grad():
        layer.w_up[:] = layer.w_up[0]
        layer.w_down[:] = layer.w_down[0]
    x = ex.sample_tokens(7, 4)
    assert torch.allclose(layer(x), layer.expert(0, x), atol=1e-14)


def test_layer_weights_come_from_the_seed_in_float64():
    a, b = ex.MoELayer(8, 16, 8, seed=3), ex.MoELayer(8, 16, 8, seed=3)
    assert a.router.dtype == torch.float64
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.router, ex.MoELayer(8, 16, 8, seed=4).router)


def test_parameter_counts_by_hand():
    # expert: 2 * 8 * 16 = 256; router 8 * 8 = 64; 8 experts: 2,112; 2 per token: 576
    counts = ex.MoELayer(8, 16, 8, 2).parameter_counts()
    assert counts == {"total": 2112, "per token": 576}
    assert counts["total"] == sum(p.numel() for p in ex.MoELayer(8, 16, 8, 2).parameters())


def test_layer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        ex.MoELayer(8, 16, 2, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        ex.MoELayer(8, 16, 2, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="x must be"):
        ex.MoELayer(8, 16, 2)(torch.zeros(3, 7, dtype=torch.float64))


def test_sample_tokens_skew_shifts_every_token_by_the_same_length():
    plain, skewed = ex.sample_tokens(10, 8), ex.sample_tokens(10, 8, skew=2.5)
    shift = skewed - plain
    assert torch.allclose(shift.norm(dim=1), torch.full((10,), 2.5, dtype=torch.float64))
    assert torch.allclose(shift, shift[0].expand_as(shift))
    assert plain.dtype == torch.float64


# --- expert parallelism: traffic ------------------------------------------------------------


def test_all_to_all_bytes_by_hand():
    # 16 tokens * 8 values * 2 experts * 3/4 leave * 8 bytes = 1,536
    assert ex.all_to_all_bytes_per_rank(16, 8, 2, 4, 8) == 1536
    # 4,096 * 7,168 * 8 * 63/64 * 2 = 462,422,016
    assert ex.all_to_all_bytes_per_rank(4096, 7168, 8, 64) == 462_422_016
    assert ex.all_to_all_bytes_per_rank(4096, 7168, 8, 1) == 0  # one rank: nothing leaves
    with pytest.raises(ValueError, match="ep"):
        ex.all_to_all_bytes_per_rank(16, 8, 2, 0)


def test_ep_comm_to_compute_by_hand():
    # 2 * 2 * 63/64 * 989e12 * 0.4 / (3 * 3 * 2,048 * 50e9) = 1.557675e15 / 9.216e14
    ratio = ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9)
    assert ratio == pytest.approx(1.690185546875)
    # a plain two-matrix expert does 2/3 of the FLOPs: the ratio grows by 3/2
    plain = ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9, matrices_per_expert=2)
    assert plain == pytest.approx(1.5 * ratio)
    with pytest.raises(ValueError, match="mfu"):
        ex.ep_comm_to_compute(2048, 64, 989e12, 1.5, 50e9)


def test_ep_ratio_is_the_bytes_formula_over_the_flops():
    """The closed form agrees with bytes / bandwidth over FLOPs / (peak * MFU), for any h and k."""
    hidden, top_k, tokens, ep, ffn = 7168, 8, 4096, 64, 2048
    comm_s = 4 * ex.all_to_all_bytes_per_rank(tokens, hidden, top_k, ep) / 50e9
    compute_s = 3 * 2 * 3 * hidden * ffn * top_k * tokens / (989e12 * 0.4)
    assert math.isclose(comm_s / compute_s, ex.ep_comm_to_compute(ffn, ep, 989e12, 0.4, 50e9))


def test_link_ratio_by_hand():
    # 4 network copies of a token's 8: (4 / 8) * 2 * 2 * 989e12 * 0.4 / (3 * 3 * 2,048 * 50e9)
    # = 0.5 * 1.5824e15 / 9.216e14 = 0.858506944...
    assert ex.link_comm_to_compute(4, 8, 2048, 989e12, 0.4, 50e9) == pytest.approx(
        0.8585069444444444
    )
    # FP8 for two of the four all-to-alls: 1.5 bytes on average, 3/4 of the BF16 figure
    fp8 = ex.link_comm_to_compute(4, 8, 2048, 989e12, 0.4, 50e9, 1.5)
    assert fp8 == pytest.approx(0.75 * 0.8585069444444444)
    assert ex.link_comm_to_compute(0, 8, 2048, 989e12, 0.4, 50e9) == 0
    with pytest.raises(ValueError, match="copies"):
        ex.link_comm_to_compute(-1, 8, 2048, 989e12, 0.4, 50e9)


def test_ep_ratio_on_one_link_is_the_link_ratio_of_the_copies_that_leave():
    one_link = ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9)
    copies = 8 * 63 / 64
    assert one_link == pytest.approx(ex.link_comm_to_compute(copies, 8, 2048, 989e12, 0.4, 50e9))


def test_ep_ratio_with_nodes_charges_same_node_copies_at_nvlink_speed():
    # 64 GPUs in nodes of 8: 56/64 of the copies to other nodes at 50 GB/s:
    # (56/64) * 1.717013888... = 1.502387152...; 7/64 at 160 GB/s: 0.0587; the slower wins
    ratio = ex.ep_comm_to_compute(
        2048, 64, 989e12, 0.4, 50e9, gpus_per_node=8, nvlink_bandwidth=160e9
    )
    assert ratio == pytest.approx(1.502387152777778)
    assert ratio < ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9)
    # one node: nothing crosses the network, NVLink sets the time, (7/8) * 1.717 * 50/160
    one_node = ex.ep_comm_to_compute(
        2048, 8, 989e12, 0.4, 50e9, gpus_per_node=8, nvlink_bandwidth=160e9
    )
    assert one_node == pytest.approx(7 / 8 * 1.717013888888889 * 50 / 160)
    # a slow NVLink can be the slower link: 7/64 at 5 GB/s beats 56/64 at 50 GB/s
    slow = ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9, gpus_per_node=8, nvlink_bandwidth=5e9)
    assert slow == pytest.approx(7 / 64 * 1.717013888888889 * 10)
    with pytest.raises(ValueError, match="ep must be a multiple of gpus_per_node"):
        ex.ep_comm_to_compute(2048, 12, 989e12, 0.4, 50e9, gpus_per_node=8, nvlink_bandwidth=1e11)
    with pytest.raises(ValueError, match="nvlink_bandwidth"):
        ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9, gpus_per_node=8)
    with pytest.raises(ValueError, match="nvlink_bandwidth"):
        ex.ep_comm_to_compute(2048, 64, 989e12, 0.4, 50e9, nvlink_bandwidth=1e11)


def test_remote_nodes_by_hand():
    # 4 experts on 2 nodes, top-2: the other node holds neither with probability
    # C(2, 2) / C(4, 2) = 1/6, so it is reached 5/6 of the time
    assert ex.remote_nodes(4, 2, 2) == pytest.approx(5 / 6)
    # top-1: the expert is on another node with probability (n - 1) / n
    assert ex.remote_nodes(256, 1, 8) == pytest.approx(7 / 8)
    # DeepSeek-V3: 8 of 256 experts on 8 nodes of 32; C(224, 8) / C(256, 8) is the product
    # (224 * 223 * ... * 217) / (256 * 255 * ... * 249) = 0.338168...; 7 * (1 - it) = 4.6328
    none_there = math.prod((224 - i) / (256 - i) for i in range(8))
    assert ex.remote_nodes(256, 8, 8) == pytest.approx(7 * (1 - none_there))
    assert round(ex.remote_nodes(256, 8, 8), 2) == 4.63
    assert ex.remote_nodes(8, 8, 4) == 3  # every expert chosen: every other node reached
    with pytest.raises(ValueError, match="experts must be divisible by nodes"):
        ex.remote_nodes(10, 2, 4)
    with pytest.raises(ValueError, match="top_k"):
        ex.remote_nodes(8, 9, 2)


def test_remote_nodes_equals_counting_every_choice():
    """6 experts on 3 nodes (2 each), top-3, the sender on node 0: all C(6, 3) = 20 choices."""
    choices = list(itertools.combinations(range(6), 3))
    reached = [len({e // 2 for e in c} - {0}) for c in choices]
    assert ex.remote_nodes(6, 3, 3) == pytest.approx(sum(reached) / len(choices))


# --- the independent reference --------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "factor", "groups", "renormalise"),
    [
        (12, 4, 2, 1.0, 1, True),
        (12, 4, 2, 0.5, 3, True),
        (10, 4, 2, 1.25, 3, True),  # groups of 4, 3, 3
        (9, 6, 3, 1.0, 2, False),
        (8, 4, 1, 1.0, 2, False),  # Switch: top-1, the raw probability as the gate
        (8, 4, 2, None, 1, True),
    ],
)
def test_per_token_reference_agrees_with_the_layer(
    tokens, experts, top_k, factor, groups, renormalise
):
    layer = ex.MoELayer(
        4, 6, experts, top_k, factor, renormalise=renormalise, groups=groups, seed=3
    )
    x = ex.sample_tokens(tokens, 4, seed=2, skew=2.0)
    run = ex.per_token_reference(
        x,
        layer.router,
        layer.w_up,
        layer.w_down,
        top_k,
        factor,
        groups=groups,
        renormalise=renormalise,
    )
    out = layer(x)
    routing = layer.last_routing
    assert torch.allclose(run.output, out, rtol=0, atol=1e-14)
    assert run.dropped == routing.dropped
    token, slot = torch.nonzero(routing.kept, as_tuple=True)
    kept = {
        (t, e) for t, e in zip(token.tolist(), routing.experts[token, slot].tolist(), strict=True)
    }
    assert set(run.kept) == kept and len(run.kept) == len(kept)


def test_per_token_reference_by_hand():
    """Two tokens, two experts, top-1, capacity 1 each: both prefer expert 0, token 1 is dropped."""
    router = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    w_up = torch.ones(2, 2, 1, dtype=torch.float64)
    w_down = torch.ones(2, 1, 2, dtype=torch.float64)
    x = torch.tensor([[2.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    run = ex.per_token_reference(x, router, w_up, w_down, 1, 1.0, renormalise=False)
    assert run.kept == [(0, 0)] and run.dropped == 1
    # token 0: p_0 = e^2 / (e^2 + 1); z = 2, GELU(2) = 2 * Phi(2) = 1.954500;
    # its output is p_0 * 1.9545 in both places
    p0 = math.exp(2) / (math.exp(2) + 1)
    gelu = 2 * 0.5 * (1 + math.erf(2 / math.sqrt(2)))
    assert run.output[0].tolist() == pytest.approx([p0 * gelu] * 2)
    assert run.output[1].tolist() == [0.0, 0.0]


# --- the router z-loss ------------------------------------------------------------------------


def test_router_z_loss_by_hand():
    # Two equal logits of 0: lse = log 2, (log 2)^2 = 0.480453.
    assert ex.router_z_loss(torch.zeros(1, 2, dtype=torch.float64)).item() == pytest.approx(
        0.480453, abs=1e-6
    )
    # Logits (log 3, 0, 0): lse = log(3 + 1 + 1) = log 5, (log 5)^2 = 2.590290.
    logits = torch.tensor([[math.log(3), 0.0, 0.0]], dtype=torch.float64)
    assert ex.router_z_loss(logits).item() == pytest.approx(2.590290, abs=1e-6)
    # The mean over tokens: rows of lse 0 and lse log 2 give (0 + 0.480453) / 2.
    two = torch.tensor([[-math.log(2), -math.log(2)], [0.0, 0.0]], dtype=torch.float64)
    assert ex.router_z_loss(two).item() == pytest.approx(0.240227, abs=1e-6)


@given(
    st.integers(1, 16),
    st.floats(-50, 50, allow_nan=False),
    st.integers(1, 6),
    st.integers(0, 10_000),
)
def test_router_z_loss_sees_the_shift_the_softmax_cannot(n_experts, shift, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=g, dtype=torch.float64)
    shifted = logits + shift
    assert torch.allclose(shifted.softmax(-1), logits.softmax(-1), atol=1e-12)  # same routing
    lse = torch.logsumexp(logits, -1)
    # each token's lse moves by the shift, so the loss is the mean of (lse + shift)^2
    want = ((lse + shift) ** 2).mean().item()
    assert ex.router_z_loss(shifted).item() == pytest.approx(want, rel=1e-9, abs=1e-9)
    # equal logits c over E experts: (c + log E)^2; zero at c = -log E
    equal = torch.full((1, n_experts), shift, dtype=torch.float64)
    assert ex.router_z_loss(equal).item() == pytest.approx(
        (shift + math.log(n_experts)) ** 2, rel=1e-9, abs=1e-9
    )
    assert ex.router_z_loss(equal - shift - math.log(n_experts)).item() == pytest.approx(
        0, abs=1e-20
    )


def test_router_z_loss_gradient_lowers_each_logit_by_its_probability():
    logits = torch.tensor([[2.0, 1.0, -1.0], [0.5, 0.5, 0.0]], dtype=torch.float64)
    logits.requires_grad_(True)
    (gradient,) = torch.autograd.grad(ex.router_z_loss(logits), [logits])
    lse = torch.logsumexp(logits, -1, keepdim=True)
    expected = 2 * lse * logits.softmax(-1) / logits.shape[0]
    assert torch.allclose(gradient, expected.detach(), atol=1e-15)


def test_router_z_loss_rejects_bad_shapes():
    for bad in (torch.zeros(3), torch.zeros(0, 4), torch.zeros(2, 0)):
        with pytest.raises(ValueError, match="logits"):
            ex.router_z_loss(bad)


def test_rounding_drift_by_hand():
    # 256 + (3.0, 1.2, 0.0) in bfloat16 (spacing 2 above 256): 259 -> 260 (the tie goes to
    # the even mantissa), 257.2 -> 258, 256 -> 256. The top 2 stay experts 0 and 1 with no
    # tie; their gates move from e^3 / (e^3 + e^1.2) = 0.858149 to e^4 / (e^4 + e^2)
    # = 0.880797: by 0.022648.
    logits = torch.tensor([[3.0, 1.2, 0.0]], dtype=torch.float64) + 256
    tied, gate = ex.rounding_drift(logits, 2, torch.bfloat16)
    assert tied == 0 and gate == pytest.approx(0.022648, abs=1e-6)
    # 256 + (1.0, 0.6, -3.0): 257 -> 256 (tie to even), 256.6 -> 256: experts 0 and 1 tie
    # for the top 1 (its renormalised gate stays 1).
    tied, gate = ex.rounding_drift(torch.tensor([[1.0, 0.6, -3.0]]) + 256, 1, torch.bfloat16)
    assert (tied, gate) == (1, 0.0)
    # every expert chosen: nothing left to tie with
    assert ex.rounding_drift(logits, 3, torch.bfloat16)[0] == 0


@given(st.integers(0, 10_000), st.floats(-1e3, 1e3, allow_nan=False))
def test_float64_rounding_moves_nothing(seed, offset):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 5, generator=g, dtype=torch.float64) + offset
    assert ex.rounding_drift(logits, 2, torch.float64) == (0, 0.0)


def test_rounding_drift_rejects_a_non_float_dtype():
    with pytest.raises(ValueError, match="dtype"):
        ex.rounding_drift(torch.zeros(2, 3), 1, torch.int32)
