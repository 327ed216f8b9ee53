"""A layout: the options it is estimated with, and the record of what the planner finds.

:class:`Layout` holds one layout's memory per GPU (:data:`MEMORY_PARTS`), step time
(:data:`TIME_PARTS`), MFU, pipeline bubble and verdict (:data:`VERDICTS`);
:func:`_options` checks the options every estimate shares (sequence parallelism,
interleaving, the simple model's :data:`KERNEL_EFFICIENCY` or the calibrated model, the
pipeline schedule of :data:`SCHEDULES`, :data:`MAX_BUBBLE`); :func:`_invalid` is the
record of a layout that breaks a rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainscale import _checks
from trainscale.memory import STATE_GROUPS
from trainscale.planner.unknowns import CENTRAL, Unknowns
from trainscale.software import DEFAULT_SOFTWARE, Software

KERNEL_EFFICIENCY = 0.6
"""The simple cost model's one efficiency: the share of peak FLOP/s that a transformer
layer's kernels sustain together, before any time is lost to communication or
pipeline idling. An assumption, not a measurement; pass ``efficiency=KERNEL_EFFICIENCY``
to use the simple model (the default, ``None``, is the calibrated roofline)."""

MAX_BUBBLE = 0.25
"""A pipeline that idles more than this share of the step is flagged."""

VERDICTS = ("fits", "TP across nodes", "bubble too large", "out of memory", "invalid")
"""Every verdict a layout can get. A layout with several problems gets the
first of ``invalid``, ``out of memory``, ``TP across nodes``, ``bubble too large``;
:attr:`Layout.problems` lists them all."""

_SEVERITY = ("invalid", "out of memory", "TP across nodes", "bubble too large")

TIME_PARTS = (
    "compute",
    "recomputation",
    "tensor-parallel traffic",
    "context-parallel traffic",
    "expert-parallel traffic",
    "pipeline sends",
    "data-parallel traffic",
    "optimiser step",
    "pipeline bubble",
)
"""The terms of :attr:`Layout.times`, which add up to the step time."""

MEMORY_PARTS = (*STATE_GROUPS, "activations")
"""The terms of :attr:`Layout.memory_parts`, which add up to the memory per GPU."""


@dataclass(frozen=True)
class Layout:
    """One candidate layout and what the planner estimates for it.

    ``memory_parts`` (bytes on one GPU of the fullest stage, keys :data:`MEMORY_PARTS`)
    and ``times`` (seconds per step, keys :data:`TIME_PARTS`) add up to
    ``memory_bytes`` and ``step_seconds``. ``bubble`` is the pipeline's idle share
    of the step. For an ``invalid`` layout the numbers are ``nan`` and
    ``accumulation`` is ``None``; ``notes`` says what is wrong. ``cp`` is the
    context-parallel degree (GPUs that share each sequence) and ``ep`` the
    expert-parallel one (DP ranks that share a mixture of experts' experts).
    """

    tp: int
    pp: int
    dp: int
    zero_stage: int
    recompute: str
    micro_batch: int
    global_batch: int
    accumulation: int | None
    memory_parts: Mapping[str, float] = field(repr=False)
    memory_bytes: float
    times: Mapping[str, float] = field(repr=False)
    step_seconds: float
    mfu: float
    bubble: float
    verdict: str
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(repr=False)
    virtual_stages: int = 1
    sequence_parallel: bool = True
    cp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        """GPUs the layout uses: ``TP x CP x PP x DP`` (expert parallelism reuses DP's)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(TP, PP, DP)`` (for a given GPU count it also fixes CP)."""
        return (self.tp, self.pp, self.dp)

    @property
    def effective_batch(self) -> int | None:
        """Sequences per optimiser step: micro-batch x accumulation steps x DP."""
        if self.accumulation is None:
            return None
        return self.micro_batch * self.accumulation * self.dp

    @property
    def name(self) -> str:
        """``"TP 8 x PP 4 x DP 2"``, with ``CP n`` after TP when the sequence is split."""
        cp = f"CP {self.cp} \u00d7 " if self.cp > 1 else ""
        return f"TP {self.tp} \u00d7 {cp}PP {self.pp} \u00d7 DP {self.dp}"

    @property
    def settings(self) -> str:
        """``"ZeRO-1, selective recompute, micro-batch 1"`` (``", EP 8"`` added when the
        experts are spread over 8 of the DP ranks)."""
        recompute = "no recompute" if self.recompute == "none" else f"{self.recompute} recompute"
        experts = f", EP {self.ep}" if self.ep > 1 else ""
        return f"ZeRO-{self.zero_stage}, {recompute}, micro-batch {self.micro_batch}{experts}"


SCHEDULES = ("1f1b", "zb-h1")
"""Pipeline schedules the planner prices: 1F1B (interleaved when ``virtual_stages`` > 1;
bubble :func:`trainscale.pipeline.bubble`) and Qi et al.'s zero-bubble ZB-H1 (arXiv
2401.10241; bubble :func:`trainscale.pipeline.bubble_zb_h1`, the weight-gradient pass
taken as half of the backward: its GEMMs are half of the backward's), which keeps
1F1B's activation memory and needs ``m >= p`` micro-batches and no interleaving."""


@dataclass(frozen=True)
class _Options:
    sequence_parallel: bool
    virtual_stages: int
    efficiency: float | None
    usable_memory: float
    max_bubble: float
    unknowns: Unknowns = CENTRAL
    schedule: str = "1f1b"
    software: Software = DEFAULT_SOFTWARE
    overlap: float | None = None  # pinned share hidden (estimate_run); None: the software's


def _options(
    sequence_parallel: object,
    virtual_stages: object,
    efficiency: object,
    usable_memory: object,
    max_bubble: object,
    unknowns: Unknowns = CENTRAL,
    schedule: object = "1f1b",
    *,
    software: Software = DEFAULT_SOFTWARE,
    overlap: float | None = None,
) -> _Options:
    """Checked options; ``unknowns`` the setting of what no source pins
    (:mod:`trainscale.planner.unknowns`), ``software`` the stack (its documented overlap,
    else the unknowns'), ``overlap`` a share of communication hidden that replaces both."""
    if not isinstance(unknowns, Unknowns):
        raise ValueError(f"unknowns must be a planner.Unknowns, got {type(unknowns).__name__}")
    return _Options(
        sequence_parallel=_checks.boolean("sequence_parallel", sequence_parallel),
        virtual_stages=_checks.count("virtual_stages", virtual_stages, minimum=1),
        efficiency=None
        if efficiency is None
        else _checks.positive("efficiency", efficiency, maximum=1.0),
        usable_memory=_checks.positive("usable_memory", usable_memory, maximum=1.0),
        max_bubble=_checks.fraction("max_bubble", max_bubble),
        unknowns=unknowns,
        schedule=str(_checks.choice("schedule", schedule, SCHEDULES)),
        software=software,
        overlap=overlap,
    )


@dataclass(frozen=True)
class _Shape:
    """One layout's degrees and settings, named as :class:`Layout` names them: what
    :func:`trainscale.planner.step._evaluate` estimates, under its :class:`_Options`."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    recompute: str
    micro_batch: int
    cp: int = 1
    ep: int = 1


def _invalid(shape: _Shape, batch: int, problems: list[str], notes: list[str]) -> Layout:
    nan = math.nan
    return Layout(
        tp=shape.tp,
        pp=shape.pp,
        dp=shape.dp,
        zero_stage=shape.zero_stage,
        recompute=shape.recompute,
        micro_batch=shape.micro_batch,
        global_batch=batch,
        accumulation=None,
        memory_parts=dict.fromkeys(MEMORY_PARTS, nan),
        memory_bytes=nan,
        times=dict.fromkeys(TIME_PARTS, nan),
        step_seconds=nan,
        mfu=nan,
        bubble=nan,
        verdict="invalid",
        problems=tuple(problems),
        notes=tuple(notes),
        cp=shape.cp,
        ep=shape.ep,
    )
