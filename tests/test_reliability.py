"""reliability: failure rates, Young's and Daly's checkpoint intervals, the exact loss and
the seeded simulation, against hand-worked numbers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import reliability as R


def test_llama3_rate_per_gpu_and_per_job():
    # 54 days x 86,400 s x 16,384 GPUs / 419 = 76,441,190,400 / 419 = 182,437,208.6 GPU-seconds
    record = R.LLAMA3_INTERRUPTIONS
    per_gpu = R.gpu_mtbf_seconds(record.interruptions, record.days, record.gpus)
    assert per_gpu == pytest.approx(182_437_208.6, abs=0.1)
    assert per_gpu / (365.25 * 86_400) == pytest.approx(5.78, abs=0.01)  # years
    # the whole job: 54 x 86,400 / 419 = 11,135.1 s = 3.09 h between failures
    assert R.job_mtbf_seconds(per_gpu, 16_384) == pytest.approx(11_135.1, abs=0.1)
    assert R.job_mtbf_seconds(per_gpu, 1_024) == pytest.approx(178_161.3, abs=0.1)


def test_young_interval_is_sqrt_2cm():
    assert R.young_interval(50, 10_000) == pytest.approx(1_000)  # sqrt(2 x 50 x 1e4) = 1e3
    # Llama 3's job MTBF with a 60 s save: sqrt(2 x 60 x 11,135.1) = sqrt(1,336,212) = 1,155.9 s
    assert R.young_interval(60, 11_135.1) == pytest.approx(1_155.9, abs=0.1)


@pytest.mark.parametrize(
    ("mtbf_minutes", "minutes"),
    # Daly 2006, figures 3-5: dump time 5 min, MTBF 24 h, 6 h and 15 min; "the new model
    # predicts" 117, 57 and 9.1 min. By hand for 24 h: sqrt(2 x 5 x 1440) = 120,
    # 5 / 2880 = 0.001736, 120 x (1 + 0.04167 / 3 + 0.001736 / 9) - 5 = 116.7 min.
    [(24 * 60, 117), (6 * 60, 57), (15, 9.1)],
)
def test_daly_interval_matches_his_published_examples(mtbf_minutes, minutes):
    assert R.daly_interval(5 * 60, mtbf_minutes * 60) / 60 == pytest.approx(minutes, abs=0.5)


def test_daly_interval_is_the_mtbf_once_a_save_outlasts_two_mtbfs():
    assert R.daly_interval(300, 100) == 100


def test_expected_segment_takes_one_failure_when_the_segment_is_m_ln2():
    # a = M ln 2: e^(a/M) - 1 = 1 expected failure, so (M + R) x 1 seconds in all.
    m = 1_000.0
    segment = m * math.log(2)
    assert R.expected_segment_seconds(segment - 93, 93, m) == pytest.approx(1_000)
    assert R.expected_segment_seconds(segment - 93, 93, m, restart_seconds=100) == pytest.approx(
        1_100
    )
    # 600 s of training in 1,000 s of wall clock: 40 % lost
    assert R.lost_fraction(600, segment - 600, m) == pytest.approx(0.4)


def test_lost_time_parts_by_hand():
    # tau 1,000 s, C 50 s, M 10,000 s, R 100 s: 50/1000 = 0.05, 1050/20000 = 0.0525, 0.01
    parts = R.lost_time_parts(1_000, 50, 10_000, restart_seconds=100)
    assert list(parts) == list(R.LOST_TIME_PARTS)
    assert list(parts.values()) == pytest.approx([0.05, 0.0525, 0.01])
    # 0.1125 lost per useful second: 0.1125 / 1.1125 = 10.11 % of wall-clock time
    assert R.first_order_lost_fraction(1_000, 50, 10_000, 100) == pytest.approx(0.101124, abs=1e-6)
    shares = R.lost_shares(1_000, 50, 10_000, 100)
    assert list(shares.values()) == pytest.approx([0.05 / 1.1125, 0.0525 / 1.1125, 0.01 / 1.1125])


def test_optimal_interval_solves_the_exact_condition():
    # C / M = 0.02: Young x = 0.2; Daly 0.2 (1 + 0.1/3 + 0.01/9) - 0.02 = 0.18689, and
    # e^(0.18689 + 0.02) (1 - 0.18689) = 1.229846 x 0.813111 = 1.000005: the root is there.
    best = R.optimal_interval(20, 1_000)
    assert best == pytest.approx(186.9, abs=0.1)
    x, c = best / 1_000, 0.02
    assert math.exp(x + c) * (1 - x) == pytest.approx(1, abs=1e-12)


def test_first_order_loss_at_young_is_sqrt_2c_over_m_plus_c_over_2m():
    # C 60 s, M 11,135.1 s: sqrt(120 / 11,135.1) = 0.10381, + 60 / 22,270.2 = 0.00269
    lost = sum(R.lost_time_parts(R.young_interval(60, 11_135.1), 60, 11_135.1).values())
    assert lost == pytest.approx(0.10650, abs=1e-5)


@given(
    st.floats(1e-2, 1e3),  # checkpoint seconds
    st.floats(1e2, 1e6),  # ratio M / C
)
def test_exact_optimum_lies_near_young_when_saves_are_short(checkpoint, ratio):
    mtbf = checkpoint * ratio
    best = R.optimal_interval(checkpoint, mtbf)
    young = R.young_interval(checkpoint, mtbf)
    # Daly: tau = young (1 + s/3 + s^2/9) - C with s = sqrt(C / 2M) = C / young, so
    # tau / young = 1 - 2s/3 + O(s^2): within s of Young's interval.
    s = math.sqrt(checkpoint / (2 * mtbf))
    assert abs(best / young - 1) <= s
    assert best == pytest.approx(R.daly_interval(checkpoint, mtbf), rel=max(1e-9, 2 * s * s))
    loss = R.lost_fraction(best, checkpoint, mtbf)
    for factor in (0.9, 0.99, 1.01, 1.1):
        assert loss <= R.lost_fraction(best * factor, checkpoint, mtbf)


@given(st.floats(1e-2, 1e3), st.floats(1e2, 1e6), st.floats(0.05, 20))
def test_restart_time_does_not_move_the_optimum(checkpoint, ratio, factor):
    mtbf = checkpoint * ratio
    best = R.optimal_interval(checkpoint, mtbf)
    with_restart = R.lost_fraction(best, checkpoint, mtbf, restart_seconds=600)
    assert with_restart <= R.lost_fraction(best * factor, checkpoint, mtbf, restart_seconds=600)
    assert R.optimal_lost_fraction(checkpoint, mtbf, 600) == pytest.approx(with_restart)


def test_a_run_without_failures_loses_only_its_saves():
    run = R.simulate_run(100, 10, 1e15, segments=50, seed=0, restart_seconds=30)
    assert (run.failures, run.elapsed_seconds, run.useful_seconds) == (0, 5_500, 5_000)
    assert run.lost_fraction == pytest.approx(1 / 11)


def test_the_simulation_is_reproducible_and_seeded():
    first = R.simulate_run(600, 60, 3_600, segments=2_000, seed=7, restart_seconds=120)
    again = R.simulate_run(600, 60, 3_600, segments=2_000, seed=7, restart_seconds=120)
    other = R.simulate_run(600, 60, 3_600, segments=2_000, seed=8, restart_seconds=120)
    assert first == again
    assert first != other


def test_a_long_simulated_run_matches_the_exact_loss():
    # tau 600 s, C 60 s, M 3,600 s: e^(660/3600) - 1 = 0.2012 failures per segment, so
    # 100,000 segments meet about 20,000 failures; each segment takes on average
    # (3,600 + 120) x 0.2012 = 748.5 s, so 1 - 600/748.5 = 19.8 % is lost.
    run = R.simulate_run(600, 60, 3_600, segments=100_000, seed=1, restart_seconds=120)
    assert run.failures == pytest.approx(20_120, rel=0.03)
    assert R.lost_fraction(600, 60, 3_600, 120) == pytest.approx(0.1984, abs=1e-4)
    assert run.lost_fraction == pytest.approx(0.1984, abs=0.005)


def test_the_simulated_optimum_is_near_young():
    c, m = 30.0, 20_000.0  # Young: sqrt(2 x 30 x 20,000) = 1,095.4 s
    young = R.young_interval(c, m)
    factors = [2 ** (k / 4) for k in range(-8, 9)]
    work = 2_000 * m  # about 2,000 failures whatever the interval
    lost = [
        R.simulate_run(young * f, c, m, segments=round(work / (young * f)), seed=3).lost_fraction
        for f in factors
    ]
    best = factors[lost.index(min(lost))]
    assert 0.7 <= best <= 1.45


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: R.gpu_mtbf_seconds(0, 54, 16_384), "interruptions"),
        (lambda: R.gpu_mtbf_seconds(419, 0, 16_384), "days"),
        (lambda: R.gpu_mtbf_seconds(419, 54, 0), "gpus"),
        (lambda: R.job_mtbf_seconds(-1, 8), "gpu_mtbf"),
        (lambda: R.job_mtbf_seconds(1e6, 0.5), "gpus"),
        (lambda: R.young_interval(0, 1e4), "checkpoint_seconds"),
        (lambda: R.daly_interval(60, math.inf), "mtbf_seconds"),
        (lambda: R.lost_fraction(0, 60, 1e4), "interval"),
        (lambda: R.lost_fraction(60, 60, 1e4, restart_seconds=-1), "restart_seconds"),
        (lambda: R.optimal_interval(60, 0), "mtbf_seconds"),
        (lambda: R.simulate_run(60, 6, 1e4, segments=0, seed=0), "segments"),
        (lambda: R.simulate_run(60, 6, 1e4, segments=10, seed=-1), "seed"),
        (lambda: R.simulate_run(1e6, 6, 1e3, segments=10, seed=0), "interval"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()
