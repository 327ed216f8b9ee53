"""Failures and how often to checkpoint (chapter 16).

A synchronous training job stops when any one of its GPUs fails, so the job's
mean time between failures (MTBF) is one GPU's MTBF divided by the GPUs:
:func:`job_mtbf_seconds`. Llama 3 (arXiv 2407.21783, section 3.3.4) reports 419
unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100s
(:data:`LLAMA3_INTERRUPTIONS`), from which :func:`gpu_mtbf_seconds` derives a
rate per GPU.

A job that saves a checkpoint every ``tau`` seconds of training, each save
stalling it for ``C`` seconds, loses two things: the saves themselves, and on
every failure the work since the last complete checkpoint, which it must
compute again. Failures are taken as a Poisson process (exponential times
between them, each GPU failing independently at a constant rate), a failure can
strike during a save too, and each restart costs ``R`` seconds during which the
job is assumed not to fail again. Then, exactly (:func:`expected_segment_seconds`),
one segment of ``tau + C`` seconds takes on average ``(M + R) (e^((tau + C)/M) - 1)``
seconds of wall-clock time, with ``M`` the job's MTBF. To first order in
``tau / M`` and ``C / tau`` (:func:`lost_time_parts`) the time lost per second of
useful training is ``C / tau + (tau + C) / (2 M) + R / M``, which is smallest at

    tau = sqrt(2 C M)

(Young 1974, doi 10.1145/361147.361115, bib key young1974checkpoint; Daly 2006,
doi 10.1016/j.future.2004.11.016, bib key daly2006checkpoint, gives the higher-order
estimate :func:`daly_interval`). :func:`optimal_interval` finds the exact optimum;
:func:`simulate_run` plays a run out with random failures, seeded, in simulated
time only, to check both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainscale import _checks

SECONDS_PER_DAY = 86_400
"""Seconds in a day."""


@dataclass(frozen=True)
class FailureRecord:
    """How often a published run was interrupted: ``interruptions`` in ``days`` on ``gpus``."""

    interruptions: int
    days: float
    gpus: int
    source: str


LLAMA3_INTERRUPTIONS = FailureRecord(
    interruptions=419,
    days=54,
    gpus=16_384,
    source=(
        "Llama 3 (arXiv 2407.21783, section 3.3.4; bib key dubey2024llama3): 'During a 54-day "
        "snapshot period of pre-training, we experienced a total of 466 job interruptions. "
        "Of these, 47 were planned ... The remaining 419 were unexpected interruptions'; "
        "'Approximately 78% of the unexpected interruptions are attributed to confirmed "
        "hardware issues ... or suspected hardware-related issues'; 'we achieved higher than "
        "90% effective training time'. The paper calls it '16K GPU training'; the book "
        "assumes the 16,384 GPUs of its largest layout (Table 4) for the whole snapshot."
    ),
)
"""Llama 3 405B's unexpected interruptions: 419 in 54 days on 16,384 GPUs."""

LLAMA3_HARDWARE_SHARE = 0.78
"""Share of Llama 3's unexpected interruptions attributed to confirmed or suspected
hardware issues ("approximately 78%")."""

LLAMA3_EFFECTIVE_TRAINING_TIME = 0.90
"""Llama 3's effective training time, "higher than 90%": the time spent on useful
training over the elapsed time."""


def gpu_mtbf_seconds(interruptions: int, days: float, gpus: int) -> float:
    """One GPU's mean time between failures, in seconds: ``days x 86,400 x gpus / interruptions``.

    ``interruptions`` failures of a job on ``gpus`` GPUs over ``days`` days are
    ``gpus x days`` GPU-days of exposure; each GPU is assumed to fail at the same
    constant rate, and every interruption is charged to the GPUs (the switches,
    cables and hosts that also fail are spread over them).
    """
    count = _checks.count("interruptions", interruptions, minimum=1)
    span = _checks.positive("days", days)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    return span * SECONDS_PER_DAY * n_gpus / count


def job_mtbf_seconds(gpu_mtbf: float, gpus: int) -> float:
    """A synchronous job's mean time between failures, in seconds: ``gpu_mtbf / gpus``.

    Any one GPU's failure stops the job, and the minimum of ``gpus`` independent
    exponential lifetimes is exponential with ``gpus`` times the rate.
    """
    mtbf = _checks.positive("gpu_mtbf", gpu_mtbf)
    return mtbf / _checks.count("gpus", gpus, minimum=1)


def _costs(checkpoint_seconds: float, mtbf_seconds: float) -> tuple[float, float]:
    return (
        _checks.positive("checkpoint_seconds", checkpoint_seconds),
        _checks.positive("mtbf_seconds", mtbf_seconds),
    )


def young_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Young's optimal checkpoint interval, ``sqrt(2 C M)`` seconds of training between saves.

    ``checkpoint_seconds`` (``C``) is how long one save stalls training,
    ``mtbf_seconds`` (``M``) the job's mean time between failures. It minimises
    the first-order loss of :func:`lost_time_parts`; good while ``C << M``.
    """
    c, m = _costs(checkpoint_seconds, mtbf_seconds)
    return math.sqrt(2 * c * m)


def daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order estimate of the optimal interval, in seconds.

    ``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` while ``C < 2 M``,
    else ``M`` (Daly 2006, doi 10.1016/j.future.2004.11.016): a perturbation series
    around Young's interval for the exact expected run time of
    :func:`expected_segment_seconds`.
    """
    c, m = _costs(checkpoint_seconds, mtbf_seconds)
    if c >= 2 * m:
        return m
    ratio = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - c


def expected_segment_seconds(
    interval: float, checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """Expected wall-clock seconds to complete ``interval`` seconds of training and its save.

    The segment needs ``a = interval + C`` failure-free seconds. Each attempt
    succeeds with probability ``e^(-a/M)``; a failed one wastes the time up to
    the failure (on average ``M - a / (e^(a/M) - 1)``) plus ``restart_seconds``.
    Summed over the expected ``e^(a/M) - 1`` failures:
    ``(M + R) (e^(a/M) - 1)`` seconds.
    """
    tau = _checks.positive("interval", interval)
    c, m = _costs(checkpoint_seconds, mtbf_seconds)
    restart = _checks.non_negative("restart_seconds", restart_seconds)
    return (m + restart) * math.expm1((tau + c) / m)


def lost_fraction(
    interval: float, checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """Share of wall-clock time not spent on useful training, exactly, for exponential failures.

    ``1 - interval / expected_segment_seconds(...)``: checkpoint saves, work lost to
    failures and computed again, and restarts. ``1 - lost_fraction`` is what Llama 3
    calls effective training time.
    """
    tau = _checks.positive("interval", interval)
    elapsed = expected_segment_seconds(tau, checkpoint_seconds, mtbf_seconds, restart_seconds)
    return 1 - tau / elapsed


LOST_TIME_PARTS = ("checkpoint saves", "recomputed work", "restarts")
"""The terms of :func:`lost_time_parts`."""


def lost_time_parts(
    interval: float, checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> dict[str, float]:
    """Seconds lost per second of useful training, to first order, by cause.

    ``checkpoint saves``: ``C / tau``, one save per ``tau`` of training;
    ``recomputed work``: ``(tau + C) / (2 M)``, a failure every ``M`` seconds
    destroying on average half a segment; ``restarts``: ``R / M``. Their sum ``s`` is
    lost time per useful second, so the lost share of wall-clock time is
    ``s / (1 + s)`` (:func:`first_order_lost_fraction`).
    """
    tau = _checks.positive("interval", interval)
    c, m = _costs(checkpoint_seconds, mtbf_seconds)
    restart = _checks.non_negative("restart_seconds", restart_seconds)
    return dict(zip(LOST_TIME_PARTS, (c / tau, (tau + c) / (2 * m), restart / m), strict=True))


def lost_shares(
    interval: float, checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> dict[str, float]:
    """Each cause's share of wall-clock time, to first order: :func:`lost_time_parts`
    divided by ``1 + their sum``, so the shares add up to :func:`first_order_lost_fraction`."""
    parts = lost_time_parts(interval, checkpoint_seconds, mtbf_seconds, restart_seconds)
    elapsed_per_useful = 1 + sum(parts.values())
    return {name: lost / elapsed_per_useful for name, lost in parts.items()}


def first_order_lost_fraction(
    interval: float, checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """The share of wall-clock time lost, to first order: ``s / (1 + s)`` for the sum ``s``
    of :func:`lost_time_parts`."""
    lost = sum(
        lost_time_parts(interval, checkpoint_seconds, mtbf_seconds, restart_seconds).values()
    )
    return lost / (1 + lost)


def optimal_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """The interval that minimises :func:`lost_fraction` exactly, in seconds.

    Setting the derivative of ``(e^((tau + C)/M) - 1) / tau`` to zero gives
    ``e^(x + c) (1 - x) = 1`` with ``x = tau / M`` and ``c = C / M``; the left side
    falls from ``e^c > 1`` at ``x = 0`` to ``0`` at ``x = 1``, so the root is unique
    and bisection finds it to float64 precision. The restart time shifts the loss,
    not the optimum.
    """
    c, m = _costs(checkpoint_seconds, mtbf_seconds)
    ratio = c / m
    low, high = 0.0, 1.0
    for _ in range(200):
        mid = (low + high) / 2
        # e^(x + c)(1 - x) - 1, written to keep its digits when x and c are small
        excess = math.expm1(mid + ratio) * (1 - mid) - mid
        if excess > 0:
            low = mid
        else:
            high = mid
        if high - low <= 1e-15 * high:
            break
    return m * (low + high) / 2


def optimal_lost_fraction(
    checkpoint_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """The smallest :func:`lost_fraction` any checkpoint interval achieves."""
    best = optimal_interval(checkpoint_seconds, mtbf_seconds)
    return lost_fraction(best, checkpoint_seconds, mtbf_seconds, restart_seconds)


MAX_SIMULATED_FAILURES = 1e7
"""The most failures :func:`simulate_run` expects to draw before it refuses a run."""


@dataclass(frozen=True)
class SimulatedRun:
    """One simulated run: wall-clock and useful seconds, and how many failures struck it."""

    elapsed_seconds: float
    useful_seconds: float
    failures: int

    @property
    def lost_fraction(self) -> float:
        """Share of the elapsed time not spent on useful training."""
        return 1 - self.useful_seconds / self.elapsed_seconds


def simulate_run(
    interval: float,
    checkpoint_seconds: float,
    mtbf_seconds: float,
    segments: int,
    seed: int,
    restart_seconds: float = 0.0,
) -> SimulatedRun:
    """Play out a run of ``segments`` checkpointed segments with random failures.

    Simulated time only (nothing sleeps). The job trains ``interval`` seconds, saves
    for ``checkpoint_seconds``, and repeats ``segments`` times. The gaps between
    failures are exponential with mean ``mtbf_seconds``, drawn from
    ``numpy.random.default_rng(seed)``; the job runs during a gap, completing as many
    segments as fit, and the failure at its end destroys the segment in progress.
    Each failure costs ``restart_seconds`` before the next gap starts (no failure
    strikes a restart). The same ``seed`` draws the same gaps whatever the
    interval, so a scan over intervals compares them on the same failures.
    """
    tau = _checks.positive("interval", interval)
    c, m = _costs(checkpoint_seconds, mtbf_seconds)
    n = _checks.count("segments", segments, minimum=1)
    restart = _checks.non_negative("restart_seconds", restart_seconds)
    rng = np.random.default_rng(_checks.count("seed", seed))
    segment = tau + c
    expected_failures = n * math.expm1(min(segment / m, 700.0))
    if expected_failures > MAX_SIMULATED_FAILURES:
        raise ValueError(
            f"interval + checkpoint_seconds must be small enough against mtbf_seconds for "
            f"{n} segments to finish within {MAX_SIMULATED_FAILURES:.0e} failures, got "
            f"{tau:g} + {c:g} s against {m:g} s (about {expected_failures:.1e} failures)"
        )
    chunk = int(max(1024.0, 2 * expected_failures + 64))
    done, elapsed, failures = 0, 0.0, 0
    while True:
        gaps = rng.exponential(m, size=chunk)
        completed = np.cumsum(np.floor(gaps / segment)) + done
        finish = int(np.searchsorted(completed, n))  # first gap in which the run ends
        if finish < chunk:
            before = done if finish == 0 else int(completed[finish - 1])
            elapsed += float(np.sum(gaps[:finish])) + finish * restart + (n - before) * segment
            failures += finish
            return SimulatedRun(elapsed, n * tau, failures)
        done = int(completed[-1])
        elapsed += float(np.sum(gaps)) + chunk * restart
        failures += chunk
