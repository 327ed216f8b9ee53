"""loss_scaling and the chapter-08 parts of precision: formats, spacing, master weights,
the dynamic loss scaler against torch.amp.GradScaler."""

import copy
import hashlib
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale import memory
from trainscale.loss_scaling import (
    DynamicLossScaler,
    StepRecord,
    fp16_forward,
    fp16_gradients,
    fp16_train_step,
    next_scale,
    synthetic_gradients,
)
from trainscale.precision import (
    accumulate_updates,
    accumulation_trace,
    bit_string,
    float_format,
    fp16_cast_losses,
    spacing,
)

# --- formats, read from torch.finfo ------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "exponent", "mantissa", "largest", "normal", "subnormal"),
    [
        (torch.float32, 8, 23, (2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149),
        (torch.float16, 5, 10, 65504.0, 2.0**-14, 2.0**-24),
        (torch.bfloat16, 8, 7, (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133),
        (torch.float8_e4m3fn, 4, 3, 448.0, 2.0**-6, 2.0**-9),
    ],
)
def test_formats_match_the_hand_worked_layouts(
    dtype, exponent, mantissa, largest, normal, subnormal
):
    fmt = float_format(dtype)
    assert (fmt.exponent_bits, fmt.mantissa_bits) == (exponent, mantissa)
    assert fmt.bits == 1 + exponent + mantissa
    assert (fmt.largest, fmt.smallest_normal, fmt.smallest_subnormal) == (
        largest,
        normal,
        subnormal,
    )
    assert fmt.eps == 2.0**-mantissa


def test_smallest_subnormal_is_really_the_last_number_before_zero():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        tiny = float_format(dtype).smallest_subnormal
        assert float(torch.tensor(tiny, dtype=torch.float64).to(dtype)) == tiny
        assert float(torch.tensor(tiny * 0.49, dtype=torch.float64).to(dtype)) == 0.0


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float16"])
def test_float_format_rejects_non_float_dtypes(dtype):
    with pytest.raises(ValueError, match="dtype"):
        float_format(dtype)


def test_spacing_near_one_and_elsewhere():
    assert spacing(torch.bfloat16) == 2.0**-7 == 0.0078125
    assert spacing(torch.float16) == 2.0**-10
    assert spacing(torch.float32) == 2.0**-23
    assert spacing(torch.float16, 1024.0) == 1.0
    assert spacing(torch.bfloat16, 256.0) == 2.0


@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), st.integers(-10, 10))
def test_spacing_at_a_power_of_two_is_eps_times_it(dtype, exponent):
    value = 2.0**exponent
    assert spacing(dtype, value) == float_format(dtype).eps * value


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"dtype": torch.int8}, "dtype"), ({"value": math.inf}, "value"), ({"value": 1e6}, "value")],
)
def test_spacing_names_bad_arguments(kwargs, name):
    args = {"dtype": torch.float16, "value": 1.0} | kwargs
    with pytest.raises(ValueError, match=name):
        spacing(**args)


def test_bit_strings_show_sign_exponent_mantissa():
    assert bit_string(1.0, torch.bfloat16) == "0 01111111 0000000"
    assert bit_string(-2.5, torch.float16) == "1 10000 0100000000"
    assert bit_string(1 / 3, torch.float32) == "0 01111101 01010101010101010101011"
    # bf16 is the top half of fp32, rounded to nearest
    assert bit_string(1 / 3, torch.bfloat16) == "0 01111101 0101011"
    # fp8: e4m3 has a bias of 7 (1.0 = 2^(7-7)), e5m2 a bias of 15
    assert bit_string(1.0, torch.float8_e4m3fn) == "0 0111 000"
    assert bit_string(1.0, torch.float8_e5m2) == "0 01111 00"
    with pytest.raises(ValueError, match="dtype"):
        bit_string(1.0, torch.int32)
    with pytest.raises(ValueError, match="value"):
        bit_string("1", torch.float16)


# --- accumulation and the master copy ----------------------------------------------------


def test_accumulation_trace_ends_where_accumulate_updates_does():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        trace = accumulation_trace(dtype, 200, 1e-4)
        assert len(trace) == 201 and trace[0] == 1.0
        assert trace[-1] == accumulate_updates(dtype, 200, 1e-4)


def test_fp32_master_keeps_what_bf16_loses():
    plain = accumulation_trace(torch.bfloat16)
    master = accumulation_trace(torch.bfloat16, master=True)
    fp32 = accumulation_trace(torch.float32)
    assert set(plain) == {1.0}
    assert master[-1] == 1.1015625 == float(torch.tensor(fp32[-1]).to(torch.bfloat16))
    assert sorted(set(master)) == [1 + i * 2.0**-7 for i in range(14)]
    assert max(abs(a - b) for a, b in zip(master, fp32, strict=True)) <= 2.0**-8


@given(st.integers(0, 50), st.floats(1e-6, 1e-1))
def test_master_copy_stays_within_half_a_step_of_fp32(steps, update):
    master = accumulation_trace(torch.bfloat16, steps, update, master=True)
    fp32 = accumulation_trace(torch.float32, steps, update)
    for low, high in zip(master, fp32, strict=True):
        assert abs(low - high) <= spacing(torch.bfloat16, high) / 2 + 1e-12


def test_accumulation_trace_names_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        accumulation_trace(torch.int32)
    with pytest.raises(ValueError, match="steps"):
        accumulation_trace(torch.float32, steps=-1)
    with pytest.raises(ValueError, match="update"):
        accumulation_trace(torch.float32, update=0)
    with pytest.raises(ValueError, match="master"):
        accumulation_trace(torch.float32, master=1)


# --- synthetic gradients -----------------------------------------------------------------


def test_synthetic_gradients_are_seeded_and_leave_the_global_rng_alone():
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a = synthetic_gradients(1000, seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert torch.equal(a, synthetic_gradients(1000, seed=3))
    assert a.dtype == torch.float64 and bool((a > 0).all())


def test_default_synthetic_gradients_lose_a_third_in_fp16_and_little_when_scaled():
    grads = synthetic_gradients()
    assert grads.log10().median() == pytest.approx(-7.0, abs=0.02)
    under, over = fp16_cast_losses(grads)
    assert 0.33 < under < 0.40 and over == 0.0
    assert fp16_cast_losses(grads, 1024)[0] < 0.02
    assert fp16_cast_losses(grads, 2.0**24)[1] > 0.0  # the top of the range overflows


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"count": 0}, "count"),
        ({"std_log10": 0}, "std_log10"),
        ({"mean_log10": math.nan}, "mean_log10"),
        ({"mean_log10": "x"}, "mean_log10"),
        ({"seed": -1}, "seed"),
    ],
)
def test_synthetic_gradients_name_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        synthetic_gradients(**kwargs)


# --- the scaling rule --------------------------------------------------------------------


def test_next_scale_by_hand():
    assert next_scale(2.0**16, 0, True) == (2.0**15, 0)
    assert next_scale(2.0**16, 5, False, growth_interval=7) == (2.0**16, 6)
    assert next_scale(2.0**16, 6, False, growth_interval=7) == (2.0**17, 0)
    assert next_scale(2.0**16, 0, False, growth_interval=1) == (2.0**17, 0)
    # a growth that would leave fp32's range is dropped; the count restarts
    assert next_scale(2.0**127, 0, False, growth_interval=1) == (2.0**127, 0)
    # other factors are rounded to fp32, as GradScaler's fp32 scale is
    assert next_scale(1.0, 0, True, backoff_factor=0.1) == (float(torch.tensor(0.1)), 0)


@given(
    st.lists(st.booleans(), max_size=40),
    st.integers(1, 5),
    st.sampled_from([2.0, 1.5, 4.0]),
    st.sampled_from([0.5, 0.25, 0.9]),
    st.sampled_from([1.0, 2.0**16, 3.0e38, 1e-30, 7.3]),
)
def test_next_scale_is_torchs_update_kernel(overflows, interval, growth, backoff, start):
    scale = torch.full((), start, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    ours, good = float(scale), 0
    for overflow in overflows:
        torch._amp_update_scale_(
            scale, tracker, torch.full((), float(overflow)), growth, backoff, interval
        )
        if float(scale) == 0.0:  # fp32 underflow: our rule stops (DynamicLossScaler raises)
            return
        ours, good = next_scale(
            ours,
            good,
            overflow,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=interval,
        )
        assert (ours, good) == (float(scale), int(tracker))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"scale": 0.0}, "scale"),
        ({"scale": math.inf}, "scale"),
        ({"good_steps": -1}, "good_steps"),
        ({"found_inf": 1}, "found_inf"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ],
)
def test_next_scale_names_bad_arguments(kwargs, name):
    args = {"scale": 1.0, "good_steps": 0, "found_inf": False} | kwargs
    with pytest.raises(ValueError, match=name):
        next_scale(**args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": 0}, "init_scale"),
        ({"init_scale": 1e39}, "init_scale"),
        ({"init_scale": 1e-50}, "init_scale"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ],
)
def test_scaler_names_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


# --- the scaler on a model ---------------------------------------------------------------


def _tiny():
    model = memory.mlp_stack(width=8, blocks=2, seed=1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_scale_unscale_and_step():
    model, optimizer = _tiny()
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=1)
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    assert float(scaler.scale(loss.detach())) == float(loss.detach()) * 1024
    scaler.scale(loss).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.step(optimizer) is True
    for p, g in zip(model.parameters(), scaled, strict=True):
        assert torch.equal(p.grad, g / 1024)  # a power of two: exact
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    scaler.update()
    assert scaler.get_scale() == 2048.0 and scaler.good_steps == 0


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_an_overflow_skips_the_step_and_halves(bad):
    model, optimizer = _tiny()
    scaler = DynamicLossScaler(init_scale=2.0**16)
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    next(model.parameters()).grad.view(-1)[0] = bad
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.unscale_(optimizer) is True
    assert scaler.step(optimizer) is False
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    scaler.update()
    assert scaler.get_scale() == 2.0**15


def test_scaler_misuse_is_an_error():
    model, optimizer = _tiny()
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(optimizer)


def test_scale_falling_to_zero_is_reported():
    model, optimizer = _tiny()
    scaler = DynamicLossScaler(init_scale=2.0**-149)  # fp32's smallest number
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    next(model.parameters()).grad.view(-1)[0] = math.nan
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="fell to 0"):
        scaler.update()


def test_agrees_with_gradscaler_step_by_step_through_overflows():
    """Start far too high, so that the first steps overflow and are skipped."""
    ours_model = memory.mlp_stack(width=8, blocks=3, seed=2)
    torch_model = copy.deepcopy(ours_model)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    ours = DynamicLossScaler(init_scale=2.0**30, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=2)
    gen = torch.Generator().manual_seed(0)
    records = {"ours": [], "torch": []}
    for _ in range(14):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
        records["ours"].append(fp16_train_step(ours_model, ours_opt, ours, x, y))
        records["torch"].append(fp16_train_step(torch_model, torch_opt, theirs, x, y))
    assert records["ours"] == records["torch"]
    assert any(r.skipped for r in records["ours"]) and not all(r.skipped for r in records["ours"])
    assert all(isinstance(r, StepRecord) for r in records["ours"])
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_gradients_underflow_without_a_scale_and_overflow_with_a_huge_one():
    model = memory.mlp_stack(width=16, blocks=6, seed=0)
    x = torch.randn(8, 16)
    y = torch.randn(8, 16)
    before = [p.detach().clone() for p in model.parameters()]

    def zeros(scale):
        grads = fp16_gradients(model, x, y, scale)
        flat = torch.cat([g.flatten() for g in grads.values()])
        return float((flat == 0).float().mean()), bool(torch.isfinite(flat).all())

    unscaled, scaled = zeros(1.0), zeros(2.0**16)
    assert unscaled[0] > scaled[0] and unscaled[1] and scaled[1]
    assert not zeros(2.0**40)[1]
    assert all(p.grad is None for p in model.parameters())  # .grad left alone
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with pytest.raises(ValueError, match="scale"):
        fp16_gradients(model, x, y, 0)


# --- the fp16 emulation -------------------------------------------------------------------


def test_fp16_linear_is_one_rounding_of_the_exact_sum_of_fp16_products():
    """Hand-worked: in fp16, 0.7 -> 0x1.668p-1, 1/3 -> 0x1.554p-2, 0.1 -> 0x1.998p-4 and
    0.2 -> 0x1.998p-3; 0x1.668p-1 * 0x1.554p-2 + 3 * 0x1.998p-4 + 0x1.998p-3 is
    0.73321938..., above the midpoint 0.733154296875 of its two fp16 neighbours, so
    the output is 0.7333984375."""
    layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1 / 3, 0.1]]))
        layer.bias.copy_(torch.tensor([0.2]))
    output = fp16_forward(layer, torch.tensor([[0.7, 3.0]])).detach()
    as16 = [Fraction(float.fromhex(h)) for h in ("0x1.668p-1", "0x1.554p-2", "0x1.998p-4")]
    exact = as16[0] * as16[1] + 3 * as16[2] + Fraction(float.fromhex("0x1.998p-3"))
    assert float(exact) == pytest.approx(0.7332193851)
    assert output.dtype == torch.float16
    assert float(output) == 0.7333984375 == float(torch.tensor(float(exact)).half())


def test_fp16_gelu_is_float64_gelu_rounded_once():
    h = torch.tensor([-3.0, -0.5, 1e-3, 0.1, 2.0]).half()
    expected = [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in h.double().tolist()]
    out = fp16_forward(torch.nn.GELU(), h)
    assert out.dtype == torch.float16
    assert out.tolist() == torch.tensor(expected, dtype=torch.float64).half().tolist()


def test_fp16_gradients_hold_fp16_values_and_match_autocast_closely():
    """Every weight gradient is an fp32 number that fp16 holds exactly; on this CPU,
    torch.autocast's fp16 kernels give the same zeros, mostly the same bits, and
    elsewhere differ by fp16 rounding noise."""
    model = memory.mlp_stack(width=16, blocks=6, seed=0)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(8, 16, generator=gen, dtype=torch.float64).float() for _ in range(2))
    emulated = fp16_gradients(model, x, y, 2.0**8)
    with torch.autocast("cpu", dtype=torch.float16):
        output = model(x)
    loss = torch.nn.functional.mse_loss(output.float(), y) * 2.0**8
    autocast = torch.autograd.grad(loss, list(model.parameters()))
    equal = 0
    for grad, reference in zip(emulated.values(), autocast, strict=True):
        assert grad.dtype == torch.float32
        assert torch.equal(grad.half().float(), grad)
        assert torch.equal(grad == 0, reference == 0)
        # fp16 rounding noise: small against the layer's largest gradient, or a few
        # steps of 2**-24 where the gradients are fp16 subnormals
        noise = max(2**-8 * float(reference.abs().max()), 4 * 2**-24)
        assert float((grad - reference).abs().max()) <= noise
        equal += int((grad == reference).sum())
    assert equal / sum(g.numel() for g in autocast) > 0.95


def test_fp16_forward_names_unsupported_layers():
    with pytest.raises(ValueError, match="model must be built of"):
        fp16_forward(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.ones(1, 2))


_HASH_GRADIENTS = """
import hashlib, torch
from trainscale import memory
from trainscale.loss_scaling import fp16_gradients
gen = torch.Generator().manual_seed(0)
x, y = (torch.randn(32, 32, generator=gen, dtype=torch.float64).float() for _ in range(2))
for scale in (1.0, 2.0**16):
    grads = fp16_gradients(memory.mlp_stack(width=32, blocks=8, seed=0), x, y, scale)
    flat = torch.cat([g.flatten() for g in grads.values()])
    print(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow  # a second Python process on another kernel path
def test_fp16_gradients_are_the_same_bits_with_another_cpu_kernel_path():
    """Torch's and MKL's kernels forced to another instruction set, as on another CPU."""
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    }
    other = subprocess.run(
        [sys.executable, "-c", _HASH_GRADIENTS], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(32, 32, generator=gen, dtype=torch.float64).float() for _ in range(2))
    here = []
    for scale in (1.0, 2.0**16):
        grads = fp16_gradients(memory.mlp_stack(width=32, blocks=8, seed=0), x, y, scale)
        flat = torch.cat([g.flatten() for g in grads.values()])
        here.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    assert other == here
