"""efficiency: FLOP accounting, warmup arithmetic, the loader and prefetcher, the timeline model.

Timings are never asserted beyond very loose relations: the arithmetic around
them is tested with a fake clock and a recording sleep instead.
"""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from trainscale.efficiency import (
    MAX_CALLS,
    BatchList,
    SlowLoader,
    Span,
    StepTimes,
    best_seconds,
    busy_share,
    counted_step_flops,
    loader_timeline,
    main,
    matmul_flops,
    matmul_rate,
    matmul_rates,
    measure_training,
    mlp_stack_params,
    prefetch,
    steady_step_seconds,
    synthetic_batches,
    time_steps,
    train_step,
    worker_loader,
)
from trainscale.memory import mlp_stack


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- FLOPs ------------------------------------------------------------------------------


def test_matmul_flops_counts_a_multiply_add_as_two():
    assert matmul_flops(2, 3, 4) == 48
    assert matmul_flops(1024, 1024, 1024) == 2_147_483_648
    assert matmul_flops(0, 5, 7) == 0


@settings(max_examples=20)
@given(st.integers(1, 24), st.integers(1, 24), st.integers(1, 24))
def test_matmul_flops_agrees_with_pytorchs_counter(m, k, n):
    a, b = torch.ones(m, k), torch.ones(k, n)
    with FlopCounterMode(display=False) as counter:
        torch.mm(a, b)
    assert counter.get_total_flops() == matmul_flops(m, k, n)


@pytest.mark.parametrize(
    ("args", "name"), [((-1, 2, 2), "m"), ((2, 1.5, 2), "k"), ((2, 2, None), "n")]
)
def test_matmul_flops_names_the_bad_size(args, name):
    with pytest.raises(ValueError, match=name):
        matmul_flops(*args)


def test_reference_mlp_has_4_204_544_parameters():
    assert mlp_stack_params(256, 8) == 4_204_544
    assert mlp_stack_params() == sum(p.numel() for p in mlp_stack().parameters())


@settings(max_examples=20)
@given(st.integers(1, 48), st.integers(1, 4))
def test_mlp_stack_params_matches_the_model(width, blocks):
    model = mlp_stack(width, blocks)
    assert mlp_stack_params(width, blocks) == sum(p.numel() for p in model.parameters())


def test_mlp_stack_params_rejects_zero_width():
    with pytest.raises(ValueError, match="width"):
        mlp_stack_params(0, 8)


def test_counted_step_flops_of_the_reference_mlp_by_hand():
    model = mlp_stack()
    x, y = synthetic_batches(1, 64)[0]
    weights = 8 * 2 * 256 * 1024  # 4,194,304 matrix weights
    plain = counted_step_flops(model, (x, y))
    assert plain["forward"] == 2 * weights * 64 == 536_870_912
    # Backward: two products per layer, less the first layer's input gradient.
    assert plain["backward"] == (4 * weights - 2 * 256 * 1024) * 64 == 1_040_187_392
    total = plain["forward"] + plain["backward"]
    assert total == 5.875 * weights * 64
    assert total / (6 * mlp_stack_params() * 64) == pytest.approx(0.97678, abs=1e-5)
    ckpt = counted_step_flops(model, (x, y), checkpointed=True)
    assert ckpt["forward"] == plain["forward"]
    assert ckpt["backward"] == plain["backward"] + plain["forward"]  # forward again
    assert all(p.grad is None for p in model.parameters())  # .grad left untouched


def test_counted_step_flops_needs_a_sequential():
    with pytest.raises(ValueError, match="model"):
        counted_step_flops(torch.nn.Linear(2, 2), (torch.ones(1, 2), torch.ones(1, 2)))


# --- timing -----------------------------------------------------------------------------


def test_best_seconds_skips_warmup_and_keeps_the_best_run():
    clock = FakeClock()
    durations = iter([0.5] + [0.01] * 6 + [0.02] * 5 + [0.01] * 5)
    calls = []

    def fn():
        calls.append(1)
        clock.advance(next(durations))

    syncs = []
    best = best_seconds(fn, repeats=2, min_seconds=0.05, sync=lambda: syncs.append(1), clock=clock)
    # warmup (0.5 s, ignored), one sizing call (0.01 s -> 5 calls a run), two runs of 5.
    assert len(calls) == 1 + 1 + 2 * 5
    assert best == pytest.approx(0.01)  # the first run (5 x 0.01) beats the second (5 x 0.02)
    assert len(syncs) == 4  # once per run, before the clock is read


def test_best_seconds_caps_the_calls_when_the_clock_does_not_move():
    calls = []
    assert best_seconds(lambda: calls.append(1), repeats=1, clock=lambda: 0.0) == 0.0
    assert len(calls) == 2 + MAX_CALLS


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"repeats": 0}, "repeats"), ({"min_seconds": 0}, "min_seconds")]
)
def test_best_seconds_names_the_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        best_seconds(lambda: None, **kwargs)


def test_matmul_rate_is_a_positive_rate():
    rate = matmul_rate(16, repeats=1, min_seconds=0.001)
    assert 0 < rate < float("inf")
    rates = matmul_rates([8, 16], repeats=1, min_seconds=0.001)
    assert list(rates) == [8, 16] and all(r > 0 for r in rates.values())


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"size": 0}, "size"), ({"size": 4, "dtype": torch.int32}, "dtype")]
)
def test_matmul_rate_names_the_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        matmul_rate(**kwargs, repeats=1, min_seconds=0.001)


def test_matmul_rates_needs_a_size():
    with pytest.raises(ValueError, match="sizes"):
        matmul_rates([])


def test_time_steps_includes_waiting_for_the_batch():
    clock = FakeClock()

    def loader():
        for load in (0.5, 0.25, 0.0):
            clock.advance(load)  # the batch takes this long to arrive
            yield load

    syncs = []
    times = time_steps(
        lambda batch: clock.advance(1.0),
        loader(),
        warmup=1,
        sync=lambda: syncs.append(1),
        clock=clock,
    )
    assert times.seconds == (1.5, 1.25, 1.0)
    assert times.waiting == (0.5, 0.25, 0.0)
    assert times.warmup == 1
    assert len(syncs) == 3
    assert times.waiting_share() == pytest.approx(0.25 / 2.25)
    assert times.waiting_share(include_warmup=True) == pytest.approx(0.75 / 3.75)


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0.001, 100)), min_size=1, max_size=20))
def test_time_steps_splits_each_step_into_waiting_and_the_rest(plan):
    clock = FakeClock()

    def loader():
        for load, _ in plan:
            clock.advance(load)
            yield _

    times = time_steps(clock.advance, loader(), clock=clock)
    assert times.seconds == pytest.approx([load + work for load, work in plan])
    assert times.waiting == pytest.approx([load for load, _ in plan])
    total = sum(load + work for load, work in plan)
    assert times.waiting_share() == pytest.approx(sum(load for load, _ in plan) / total)
    assert 0 <= times.waiting_share() < 1


def test_time_steps_needs_a_batch():
    with pytest.raises(ValueError, match="batches"):
        time_steps(lambda batch: None, [])


# --- warmup arithmetic --------------------------------------------------------------------


def test_step_times_leave_warmup_out_by_hand():
    times = StepTimes((5.0, 3.0, 1.0, 1.0, 2.0, 1.0), warmup=2)
    assert times.steady == (1.0, 1.0, 2.0, 1.0)
    assert times.seconds_per_step() == 1.25
    assert times.seconds_per_step(statistic="median") == 1.0
    assert times.seconds_per_step(include_warmup=True) == pytest.approx(13 / 6)
    assert times.per_second(64) == pytest.approx(51.2)
    assert times.per_second(64, include_warmup=True) == pytest.approx(64 * 6 / 13)
    # 6 FLOPs x 1e6 parameters x 51.2 examples/s on a peak of 1e9 FLOP/s.
    assert times.mfu(64, 1e6, 1e9) == pytest.approx(0.3072)
    assert times.mfu(64, 1e6, 1e9, include_warmup=True) < times.mfu(64, 1e6, 1e9)


@given(
    st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=40),
    st.data(),
)
def test_step_times_means_are_totals_over_counts(seconds, data):
    warmup = data.draw(st.integers(0, len(seconds) - 1))
    original = list(seconds)
    times = StepTimes(seconds, warmup)
    assert seconds == original  # the input list is copied, not changed
    steady = seconds[warmup:]
    assert times.seconds_per_step() == pytest.approx(sum(steady) / len(steady))
    assert times.seconds_per_step(include_warmup=True) == pytest.approx(sum(seconds) / len(seconds))
    if sum(steady) > 0:
        assert times.per_second(10) == pytest.approx(10 * len(steady) / sum(steady))


@pytest.mark.parametrize(
    ("seconds", "warmup", "name"),
    [
        ((1.0, 2.0), 2, "warmup"),
        ((1.0,), -1, "warmup"),
        ((1.0, -2.0), 0, "seconds"),
        ((), 0, "warmup"),
    ],
)
def test_step_times_name_the_bad_argument(seconds, warmup, name):
    with pytest.raises(ValueError, match=name):
        StepTimes(seconds, warmup)


def test_step_times_check_their_waiting_times():
    with pytest.raises(ValueError, match="waiting"):
        StepTimes((1.0, 1.0), 0, (0.5,))  # one wait for two steps
    with pytest.raises(ValueError, match="waiting"):
        StepTimes((1.0,), 0, (1.5,))  # waited longer than the step took
    with pytest.raises(ValueError, match="waiting"):
        StepTimes((1.0,), 0).waiting_share()  # never recorded
    assert StepTimes((2.0, 1.0), 1, (2.0, 0.25)).waiting_share() == 0.25


def test_step_times_reject_bad_statistic_and_zero_time():
    with pytest.raises(ValueError, match="statistic"):
        StepTimes((1.0,), 0).seconds_per_step(statistic="mode")
    with pytest.raises(ValueError, match="seconds"):
        StepTimes((0.0, 0.0), 0).per_second(8)
    with pytest.raises(ValueError, match="items_per_step"):
        StepTimes((1.0,), 0).per_second(0)


# --- a training loop ------------------------------------------------------------------------


def test_synthetic_batches_are_reproducible_and_leave_the_global_seed_alone():
    before = torch.random.get_rng_state()
    first, again = synthetic_batches(3, 4, 8, seed=1), synthetic_batches(3, 4, 8, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert len(first) == 3 and first[0][0].shape == (4, 8) and first[0][1].shape == (4, 8)
    assert all(
        torch.equal(a, b)
        for pa, pb in zip(first, again, strict=True)
        for a, b in zip(pa, pb, strict=True)
    )
    assert not torch.equal(first[0][0], synthetic_batches(1, 4, 8, seed=2)[0][0])
    assert synthetic_batches(0, 4) == []


def test_train_step_updates_the_weights_and_lowers_the_loss():
    model = mlp_stack(8, 1)
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.05))
    batch = synthetic_batches(1, 16, 8)[0]
    before = [p.detach().clone() for p in model.parameters()]
    losses = [float(step(batch)) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_measure_training_times_every_step():
    times = measure_training(2, steps=4, warmup=1, width=8, blocks=1)
    assert len(times.seconds) == 4 and times.warmup == 1
    assert all(s > 0 for s in times.seconds)
    slow = measure_training(2, steps=3, warmup=1, width=8, blocks=1, delay=0.002, depth=2)
    assert len(slow.seconds) == 3


def test_batch_list_and_a_loader_without_workers_keep_the_order():
    batches = synthetic_batches(4, 2, 3)
    assert len(BatchList(batches)) == 4 and BatchList(batches)[2] is batches[2]
    assert [x for x, _ in worker_loader(batches, 0)] == [x for x, _ in batches]


@pytest.mark.slow  # starts a loader process
def test_worker_loader_hands_over_the_same_batches_in_order_from_a_process():
    batches = synthetic_batches(5, 2, 3)
    got = list(worker_loader(batches, 1))  # one spawned worker process
    assert len(got) == 5
    for (x, y), (gx, gy) in zip(batches, got, strict=True):
        assert torch.equal(x, gx) and torch.equal(y, gy)


def test_worker_loader_rejects_negative_workers():
    with pytest.raises(ValueError, match="workers"):
        worker_loader([], -1)


def test_measure_training_names_bad_arguments():
    with pytest.raises(ValueError, match="delay"):
        measure_training(2, steps=2, warmup=0, width=8, blocks=1, delay=-1)
    with pytest.raises(ValueError, match="depth"):
        measure_training(2, steps=2, warmup=0, width=8, blocks=1, depth=-1)
    with pytest.raises(ValueError, match="warmup"):
        measure_training(2, steps=2, warmup=2, width=8, blocks=1)
    with pytest.raises(ValueError, match="workers"):
        measure_training(2, steps=2, warmup=0, width=8, blocks=1, workers=1, delay=0.1)


# --- the loader and the prefetcher -----------------------------------------------------------


def test_slow_loader_hands_out_every_item_in_order_after_its_delay():
    slept = []
    items = ["a", "b", "c"]
    loader = SlowLoader(items, 0.25, sleep=slept.append)
    assert len(loader) == 3
    assert list(loader) == items
    assert slept == [0.25, 0.25, 0.25]
    assert list(loader) == items  # each pass starts again from the beginning
    assert items == ["a", "b", "c"]


def test_slow_loader_without_delay_never_sleeps():
    slept = []
    assert list(SlowLoader([1, 2], 0, sleep=slept.append)) == [1, 2]
    assert slept == []


@pytest.mark.parametrize("delay", [-0.1, float("nan"), float("inf"), True, "1"])
def test_slow_loader_rejects_bad_delay(delay):
    with pytest.raises(ValueError, match="delay"):
        SlowLoader([1], delay)


@given(st.lists(st.integers(), max_size=30), st.integers(1, 5))
def test_prefetch_yields_the_same_items_in_the_same_order(items, depth):
    assert list(prefetch(iter(items), depth)) == items


def test_prefetch_yields_the_very_same_batches():
    batches = synthetic_batches(5, 2, 4)
    got = list(prefetch(SlowLoader(batches, 0.001), depth=2))
    assert len(got) == 5 and all(a is b for a, b in zip(got, batches, strict=True))


def test_prefetch_raises_the_loaders_error_where_it_happened():
    def broken():
        yield 1
        yield 2
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for item in prefetch(broken(), depth=4):
            seen.append(item)
    assert seen == [1, 2]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trainscale-prefetch"]


def test_prefetch_stops_its_thread_when_the_consumer_stops_early():
    def endless():
        n = 0
        while True:
            yield n
            n += 1

    stream = prefetch(endless(), depth=2)
    assert [next(stream) for _ in range(3)] == [0, 1, 2]
    stream.close()
    assert _prefetch_threads() == []


def test_prefetch_rejects_depth_zero_at_once():
    with pytest.raises(ValueError, match="depth"):
        prefetch([1, 2], depth=0)


def test_prefetch_loads_the_next_batch_while_the_caller_works_on_this_one():
    # No clock: the loader signals when it starts loading each batch, and the caller,
    # while "working" on batch k, waits for the signal that batch k + 1 is being
    # loaded. Without a background thread that signal could never come in time.
    started = [threading.Event() for _ in range(4)]
    calls = iter(range(4))

    def load(_delay: float) -> None:
        started[next(calls)].set()

    stream = prefetch(SlowLoader(list(range(4)), 1.0, sleep=load), depth=2)
    for k, batch in enumerate(stream):
        assert batch == k
        if k + 1 < 4:
            assert started[k + 1].wait(timeout=30), f"batch {k + 1} was not loaded ahead"


# --- the timeline model -------------------------------------------------------------------


def _lane(spans, lane):
    return [(s.start, s.end) for s in spans if s.lane == lane]


def test_timeline_without_prefetch_takes_turns_by_hand():
    spans = loader_timeline(1.0, [2.0, 0.5, 0.5], depth=0)
    assert _lane(spans, "load") == [(0.0, 2.0), (3.0, 3.5), (4.5, 5.0)]
    assert _lane(spans, "compute") == [(2.0, 3.0), (3.5, 4.5), (5.0, 6.0)]
    assert busy_share(spans) == pytest.approx(3 / 6)


def test_timeline_with_prefetch_overlaps_by_hand():
    spans = loader_timeline(1.0, [0.5] * 4, depth=1)
    # depth 1: batch 2 waits for batch 1 to be taken (at 1.5) before it is handed over.
    assert _lane(spans, "load") == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0)]
    assert _lane(spans, "compute") == [(0.5, 1.5), (1.5, 2.5), (2.5, 3.5), (3.5, 4.5)]
    assert busy_share(spans) == pytest.approx(4 / 4.5)
    # The loader keeps ahead, so a deeper queue changes nothing here.
    deeper = loader_timeline(1.0, [0.5] * 4, depth=2)
    assert deeper == spans


def test_timeline_with_shallow_queue_stalls_the_loader_by_hand():
    spans = loader_timeline(1.0, [0.1, 0.1, 0.1, 0.1], depth=1)
    loads = [t for span in _lane(spans, "load") for t in span]
    # batch 0 taken at 0.1; batch 1 queued at 0.2; batch 2 loaded at 0.3 but the queue
    # is full until step 1 takes batch 1 at 1.1; batch 3 starts loading then.
    assert loads == pytest.approx([0.0, 0.1, 0.1, 0.2, 0.2, 0.3, 1.1, 1.2])


@given(
    st.floats(0.01, 10.0),
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=25),
    st.integers(0, 6),
)
def test_timeline_properties(compute, loads, depth):
    original = list(loads)
    spans = loader_timeline(compute, loads, depth)
    assert loads == original
    work, fetch = _lane(spans, "compute"), _lane(spans, "load")
    assert len(work) == len(fetch) == len(loads)
    for i, ((c0, c1), (l0, l1)) in enumerate(zip(work, fetch, strict=True)):
        assert c1 - c0 == pytest.approx(compute) and l1 - l0 == pytest.approx(loads[i])
        assert c0 >= l1 - 1e-9  # a step computes on a batch that has arrived
        if i:
            assert c0 >= work[i - 1][1] - 1e-9 and l0 >= fetch[i - 1][1] - 1e-9
    end = work[-1][1]
    if depth == 0:
        assert end == pytest.approx(sum(loads) + len(loads) * compute)
    else:
        assert end >= max(sum(loads), loads[0] + (len(loads) - 1) * compute) + compute - 1e-6
        slower = loader_timeline(compute, loads, depth - 1)
        assert end <= max(s.end for s in slower) + 1e-9  # one more place never hurts
    assert 0 < busy_share(spans) <= 1 + 1e-12


@pytest.mark.parametrize(("compute", "load"), [(1.0, 0.3), (1.0, 1.0), (1.0, 2.5), (0.2, 0.0)])
def test_timeline_settles_to_the_steady_step(compute, load):
    for depth, prefetched in [(0, False), (1, True), (3, True)]:
        work = _lane(loader_timeline(compute, [load] * 40, depth), "compute")
        assert work[-1][0] - work[-2][0] == pytest.approx(
            steady_step_seconds(compute, load, prefetched)
        )


def test_steady_step_seconds_by_hand():
    assert steady_step_seconds(1.0, 0.75, prefetched=False) == 1.75
    assert steady_step_seconds(1.0, 0.75, prefetched=True) == 1.0
    assert steady_step_seconds(1.0, 1.5, prefetched=True) == 1.5


@pytest.mark.parametrize(
    ("args", "name"),
    [((0.0, [1.0], 0), "compute"), ((1.0, [-1.0], 0), "loads"), ((1.0, [1.0], -1), "depth")],
)
def test_timeline_names_the_bad_argument(args, name):
    with pytest.raises(ValueError, match=name):
        loader_timeline(*args)


def test_busy_share_needs_a_compute_span():
    with pytest.raises(ValueError, match="spans"):
        busy_share([Span("load", 0, 0.0, 1.0)])


# --- the command line ------------------------------------------------------------------------


def test_command_line_prints_only_marked_measurements(capsys):
    threads = torch.get_num_threads()
    try:
        main(
            [
                "--sizes",
                "16",
                "--batches",
                "1",
                "--width",
                "8",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--threads",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device cpu, float32, 1 CPU thread"
    measured = [line for line in lines[1:] if not line.startswith("  above 100 %")]
    assert len(measured) == 2
    assert all(line.endswith("(measured)") for line in measured)
