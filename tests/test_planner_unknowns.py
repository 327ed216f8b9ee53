"""planner.unknowns and the software-dependent terms: hand-worked numbers and edges."""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainscale import planner as P
from trainscale.memory import saved_activation_bytes
from trainscale.parallel import layer_collectives
from trainscale.planner.kernels import _layer_times, _roofline
from trainscale.planner.memory import (
    eager_layer_activation_bytes,
    eager_layer_traffic_bytes,
    every_other_matmul_bytes,
    every_other_matmul_share,
)
from trainscale.planner.step import _tensor_halves
from trainscale.planner.unknowns import band_value

LLAMA_8B = P.LLAMA3["8B"]
H100 = P.Cluster(nodes=1, **P.H100_NODE)


def test_the_central_unknowns_are_the_middle_of_each_span():
    assert P.Unknowns(3.0, 1.0, 0.5, "point", "point") == P.CENTRAL
    assert P.ELEMENTWISE_TRAFFIC == {"low": 4.0, "point": 3.0, "high": 2.0}
    assert P.OVERLAP == {"low": 0.0, "point": 0.5, "high": 1.0}
    assert set(P.TILE_OVERHEAD.values()) == {0.0, 1.0}  # hidden, or fully waited for


def test_range_corners_hold_each_end_and_every_pair_table_4_ties():
    pessimistic, optimistic = P.range_corners()
    assert len(pessimistic) == len(optimistic) == 6  # traffic 2, 3, 4 x tile overhead 0, 1
    assert {(u.traffic, u.tile_overhead) for u in pessimistic} == {
        (t, o) for t in (2.0, 3.0, 4.0) for o in (0.0, 1.0)
    }
    assert all(u.overlap == 0 and u.attention == u.peak == "low" for u in pessimistic)
    assert all(u.overlap == 1 and u.attention == u.peak == "high" for u in optimistic)


def test_band_value_by_hand():
    assert band_value((0.35, 0.75), "low", 0.6) == 0.35
    assert band_value((0.35, 0.75), "high", 0.6) == 0.75
    assert band_value((0.25, 1.0), "point", 0.6) == pytest.approx(0.5)  # sqrt(0.25 x 1)
    assert band_value(None, "low", 0.6) == 0.6  # nothing measured: the default
    with pytest.raises(ValueError, match="band"):
        band_value((0.35, 0.75), "middle", 0.6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"traffic": 0.0}, "traffic"),
        ({"tile_overhead": -1.0}, "tile_overhead"),
        ({"overlap": 1.5}, "overlap"),
        ({"attention": "best"}, "attention"),
        ({"peak": "max"}, "peak"),
    ],
)
def test_bad_unknowns_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        P.Unknowns(**kwargs)


@given(st.sampled_from(list(P.range_corners()[0] + P.range_corners()[1])))
def test_every_corner_brackets_the_central_estimate_of_a_layout(corner):
    # A layout's MFU at any corner is a valid estimate; the range is its min and max.
    layout = P.evaluate(P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 1024, 8, 4, 2, 1, "selective")
    low, high = P.mfu_range(P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, layout, margin=0.0)
    pessimistic, _ = P.range_corners()
    assert low <= layout.mfu <= high
    if corner in pessimistic:
        assert low > 0


def test_megatrons_sequence_parallelism_gathers_again_in_backward():
    # Chapter 8's count: TP alone 2 + 2 all-reduces (8 halves); Megatron's sequence
    # parallelism 4 halves forward, 6 backward; DTensor's keeps the gathered input, 4 + 4.
    assert _tensor_halves("") == {"forward": 4, "backward": 4}
    assert _tensor_halves("re-gather") == {"forward": 4, "backward": 6}
    assert _tensor_halves("keep gathered") == {"forward": 4, "backward": 4}
    assert layer_collectives("re-gather")["backward"] == {"all-gather": 4, "reduce-scatter": 2}


def test_dtensors_plan_keeps_more_activations_than_megatrons():
    # Chapter 8: the gathered layer-norm outputs kept whole, 4 sbh (1 - 1/t) more.
    # (megatron-core-te keeps dropout masks, torchtitan none: the model says none for both)
    same = dataclasses.replace(P.EXAMPLE_MODEL, dropout=False)
    args = (same, P.EXAMPLE_CLUSTER, 1024, 8, 4, 2, 1, "none")
    megatron = P.evaluate(*args, software="megatron-core-te")
    titan = P.evaluate(*args, software="torchtitan-fsdp2")
    s, h, t, b, layers = 4096, 8192, 8, 1, 20
    per_layer = 4 * s * b * h * (1 - 1 / t)
    in_flight = 4  # 1F1B: the first of PP 4 stages holds 4 micro-batches
    extra = titan.memory_parts["activations"] - megatron.memory_parts["activations"]
    assert extra == pytest.approx(in_flight * layers * per_layer)


def test_torchtitans_per_op_policy_by_hand():
    # Llama 3 8B, one layer, TP 1: the products in order q (4,096), k (1,024), v (1,024),
    # o (4,096), gate (14,336), up (14,336), down (4,096); saved: the 1st, 3rd, 5th, 7th
    # outputs (4,096 + 1,024 + 14,336 + 4,096), the block's input (4,096), the attention
    # output (4,096), all 16-bit, and 32 heads' fp32 statistic: per token
    # 2 x 31,744 + 128 = 63,616 bytes.
    assert every_other_matmul_bytes(LLAMA_8B, 8192, 2, 1, False) == 63_616 * 8192 * 2
    # Recomputed: k, o and up, (4,096 x 1,024 + 4,096^2 + 4,096 x 14,336) of the
    # 2 x 4,096^2 + 2 x 4,096 x 1,024 + 3 x 4,096 x 14,336 FLOPs per token: 0.3654.
    hand = (1024 + 4096 + 14336) / (2 * 4096 + 2 * 1024 + 3 * 14336)
    assert every_other_matmul_share(LLAMA_8B) == pytest.approx(hand)
    assert hand == pytest.approx(0.3654, abs=1e-4)
    # TP 8 with sequence parallelism splits the column-parallel outputs and the input; the
    # row-parallel products' outputs (o, down) are whole partial sums on every rank.
    split = every_other_matmul_bytes(LLAMA_8B, 8192, 1, 8, True)
    per_token = 2 * (4096 / 8 + 4096 / 8 + 1024 / 8 + 14336 / 8 + 4096 + 4096 / 8) + 4 * 32 / 8
    assert split == pytest.approx(per_token * 8192)


def test_selective_recomputation_follows_the_softwares_policy():
    fused = dataclasses.replace(LLAMA_8B, fused_attention=True)
    layer, score, _ = _layer_times(fused, H100, 1, 1, False)

    def recompute(policy: str) -> float:
        stage = _roofline(fused, H100, 1, 1, 32, "selective", False, P.CENTRAL, 0, 1, 1, policy)
        return stage[2]

    assert recompute("scores") == 0.0  # a fused kernel stores no scores to rebuild
    assert recompute("core attention") == pytest.approx(32 * score)  # Megatron-Core reruns it
    op = recompute("every other matmul")
    assert 32 * every_other_matmul_share(fused) * (layer - score) < op < 32 * layer


def test_llama_3s_all_gather_context_parallelism_hides_nothing():
    # The same bytes as the ring, all of them in the critical path (Llama 3, section 3.3.2).
    args = (P.LONG_CONTEXT_MODEL, P.Cluster(nodes=2, **P.H100_NODE), 16, 8, 1, 1, 1, "none")
    ring = P.evaluate(*args, context_parallel=2, software="torchtitan-fsdp2")
    stack = P.SOFTWARE["torchtitan-fsdp2"].replace(context_parallel_style="all-gather")
    gathered = P.evaluate(*args, context_parallel=2, software=stack)
    assert gathered.times["context-parallel traffic"] > ring.times["context-parallel traffic"]
    assert P.SOFTWARE["meta-llama3"].context_parallel_style == "all-gather"


def test_tensor_parallel_traffic_shrinks_with_context_parallelism():
    # A CP rank's TP collectives carry its s / c tokens (the sequence it holds).
    args = (P.LONG_CONTEXT_MODEL, P.Cluster(nodes=2, **P.H100_NODE), 16, 8, 1)
    one = P.evaluate(*args, 2, 1, "none", 1, efficiency=0.5, sequence_parallel=False)
    two = P.evaluate(
        *args, 1, 1, "none", 1, efficiency=0.5, sequence_parallel=False, context_parallel=2
    )
    per_micro = one.times["tensor-parallel traffic"] / one.accumulation
    assert two.times["tensor-parallel traffic"] / two.accumulation == pytest.approx(per_micro / 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sequence_parallel_style", "scatter"),
        ("selective_recompute", "half"),
        ("context_parallel_style", "tree"),
    ],
)
def test_bad_software_styles_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        P.SOFTWARE["planner-default"].replace(**{field: value})


def test_fp8_linears_run_at_the_measured_fp8_gemms_share_of_the_fp8_peak():
    # H100: 1,979 TFLOP/s dense FP8; its fastest FP8 GEMM 1,541 of them (tile-lang, H800);
    # the A100-read share moved there as the bf16 one is: share x 0.779 / 0.869.
    from trainscale.planner.kernels import _linear_rate

    h100 = P.Cluster(nodes=1, **P.H100_NODE)
    peak, share = _linear_rate(h100, P.CENTRAL, "fp8")
    assert peak == 1979e12
    assert share == pytest.approx(P.GEMM_SHARE * (1541 / 1979) / (271.2 / 312))
    assert _linear_rate(h100, P.CENTRAL, "bf16") is None
    # the linear layers run faster; attention and the output layer do not change
    stack = P.SOFTWARE["megatron-core-te"]
    args = (P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 1024, 8, 4, 2, 1, "none")
    bf16 = P.evaluate(*args, software=stack)
    fp8 = P.evaluate(*args, software=stack.replace(linear_dtype="fp8"))
    assert fp8.mfu > bf16.mfu
    assert fp8.times["compute"] > bf16.times["compute"] / 2  # not all of it is FP8 GEMMs
    # an A100 has no FP8 tensor cores: the layout is invalid, and says why
    a100 = P.Cluster(nodes=8, **P.A100_NODE)
    no = P.evaluate(
        P.EXAMPLE_MODEL, a100, 1024, 8, 4, 2, software=stack.replace(linear_dtype="fp8")
    )
    assert no.verdict == "invalid" and "FP8" in " ".join(no.notes)
    with pytest.raises(ValueError, match="linear_dtype"):
        stack.replace(linear_dtype="fp4")


class _RMSNorm(torch.nn.Module):
    """RMSNorm as torchtitan writes it (eager, in fp32), for the check below."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)
        return out.type_as(x) * self.weight


class _EagerLlamaBlock(torch.nn.Module):
    """A Llama block written as torchtitan's eager model runs it: fp32 RMSNorm, complex
    rotary embedding, keys and values repeated to every head, SDPA, SwiGLU. Written here,
    independently of the planner's count."""

    def __init__(self, h: int, a: int, kv: int, f: int, s: int) -> None:
        super().__init__()
        self.a, self.kv, self.d = a, kv, h // a
        linear = functools.partial(torch.nn.Linear, bias=False)
        self.wq, self.wk, self.wv = linear(h, h), linear(h, kv * self.d), linear(h, kv * self.d)
        self.wo, self.w1, self.w3, self.w2 = linear(h, h), linear(h, f), linear(h, f), linear(f, h)
        self.n1, self.n2 = _RMSNorm(h), _RMSNorm(h)
        angles = torch.arange(s)[:, None] * torch.arange(self.d // 2)[None, :] * 0.01
        self.freqs = torch.polar(torch.ones_like(angles), angles)[None, :, None]  # complex64

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.freqs).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.n1(x)
        q = self._rope(self.wq(y).view(b, s, self.a, self.d))
        k = self._rope(self.wk(y).view(b, s, self.kv, self.d))
        v = self.wv(y).view(b, s, self.kv, self.d)
        rep = self.a // self.kv
        k, v = (z[:, :, :, None].expand(b, s, self.kv, rep, self.d) for z in (k, v))
        k, v = (z.reshape(b, s, self.a, self.d) for z in (k, v))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, h))
        z = self.n2(x)
        return x + self.w2(F.silu(self.w1(z)) * self.w3(z))


def test_an_eager_llama_block_keeps_what_the_planner_counts():
    # 24 h + 8 f + 4 a bytes per token: h 256, f 896, a 8: 13,344; autograd also keeps two
    # fp32 reciprocal norms per token (8 bytes) and the rotation (64 bytes per position).
    h, a, kv, f, s, b = 256, 8, 2, 896, 64, 2
    torch.manual_seed(0)
    block = _EagerLlamaBlock(h, a, kv, f, s).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    kept = saved_activation_bytes(block, x)
    model = P.Model(10**9, 1, h, a, s, 64, kv_heads=kv, ffn_hidden=f, gated_mlp=True)
    counted = eager_layer_activation_bytes(model, s, b, 1, False)
    assert counted == (24 * h + 8 * f + 4 * a) * s * b == 13_344 * s * b
    assert kept == counted + (2 * 4 + 64) * s * b
    # Korthikanti et al.'s count for fused kernels keeps markedly less for this layer
    fused = P.layer_activation_bytes(s, b, h, a, 1, False, "none", **model.layer_shape)
    assert fused < 0.8 * counted


_NO_TRAFFIC = {"mm", "bmm", "addmm", "detach", "_unsafe_view"}  # matrix products; no copy


class _ElementwiseBytes(TorchDispatchMode):
    """Bytes every ATen op reads and writes, forward and backward, but the matrix
    products, the attention kernel and views (a broadcast operand counted once)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_TRAFFIC or name.startswith("_scaled_dot_product"):
            return out
        tensors = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
        for x in tensors:
            touched = [n for n, stride in zip(x.shape, x.stride(), strict=True) if stride]
            self.moved += math.prod(touched) * x.element_size()
        return out


def _eager_block_bytes(s: int, b: int, h: int, a: int, kv: int, f: int) -> int:
    torch.manual_seed(0)
    block = _EagerLlamaBlock(h, a, kv, f, s).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    gradient = torch.ones_like(x)
    with _ElementwiseBytes() as counter:
        block(x).backward(gradient)
    return counter.moved


def test_an_eager_llama_block_moves_what_the_planner_counts():
    # 346 h + 48 k + 28 f bytes per token: h 256, k 64, f 896: 116,736. The slope between
    # two lengths drops the weights; what the count leaves out is 32 fp32 norm statistics
    # (128 bytes) per token and the rotation table, 8 reads of d/2 complex64 per position.
    h, a, kv, f, b = 256, 8, 2, 896, 2
    d = h // a
    per_token = _eager_block_bytes(128, b, h, a, kv, f) - _eager_block_bytes(64, b, h, a, kv, f)
    per_token /= 64 * b
    model = P.Model(10**9, 1, h, a, 64, 64, kv_heads=kv, ffn_hidden=f, gated_mlp=True)
    forward, backward = eager_layer_traffic_bytes(model, 1, 1, 1, False)
    assert (forward, backward) == (108 * h + 24 * 64 + 10 * f, 238 * h + 24 * 64 + 18 * f)
    assert forward + backward == 116_736
    llama = P.LLAMA3["8B"]  # h 4,096, k 1,024, f 14,336: 1.9 MB, against 0.14 MB kept (fused)
    assert sum(eager_layer_traffic_bytes(llama, 1, 1, 1, False)) == 1_867_776
    fused = P.layer_activation_bytes(1, 1, 4096, 32, 1, False, "none", **llama.layer_shape)
    assert fused == 139_392
    assert per_token == forward + backward + 128 + 8 * (d // 2) * 8 / b


@given(st.sampled_from([1, 2, 4, 8]), st.booleans())
def test_eager_traffic_splits_over_tensor_parallel_ranks(t: int, sp: bool):
    model, s = P.LLAMA3["8B"], 8192
    whole = sum(eager_layer_traffic_bytes(model, s, 1, 1, sp))
    split = sum(eager_layer_traffic_bytes(model, s, 1, t, sp))
    kept_whole = 18 * model.hidden * s  # the gradient sums, on the gathered sequence
    if not sp:  # the norms (36 h + 92 h each) and the residual adds (4 x 6 h) too
        kept_whole += (2 * (36 + 92) + 4 * 6) * model.hidden * s
    assert split == pytest.approx((whole - kept_whole) / t + kept_whole)


def test_an_eager_stack_keeps_more_and_moves_more_bytes():
    stack = P.SOFTWARE["torchtitan-2024"]
    args = (P.LLAMA3["8B"], P.Cluster(nodes=1, **P.node_settings("H100-80GB", 50e9)), 16)
    eager = P.evaluate(*args, 1, 1, 8, 3, "none", 2, software=stack)
    fused = P.evaluate(*args, 1, 1, 8, 3, "none", 2, software=stack.replace(fused_elementwise=True))
    assert eager.memory_parts["activations"] > 1.3 * fused.memory_parts["activations"]
    assert eager.times["compute"] > fused.times["compute"]
