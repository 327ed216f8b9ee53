"""Calibration: the planner against published runs (chapter 13's check).

:func:`estimate_run` estimates a published run (:func:`trainscale.published.published_runs`)
at its own layout, with a range (:class:`RunEstimate`); :func:`mfu_range` gives any
layout of :func:`plan` the same range; :func:`reported_mfu` restates a run's published
utilisation in the book's ``6 N`` convention and :func:`restated_run` turns a published
utilisation into a run; :func:`calibration_targets` measures the estimates against
:data:`CALIBRATION_TARGETS`. What a run's software did is its
:attr:`~trainscale.published.PublishedRun.software` (:class:`trainscale.software.Software`,
each field read off the stack's code or docs): its attention kernel, dropout, gradient
dtype, pipeline engine and documented overlap.

The calibrated model's range (:func:`estimate_run`, :func:`mfu_range`) comes from
what it admits it does not know: the GEMM share (the two halves of Table 4 read
apart, :func:`gemm_share`) and how far that share carries to GEMMs of other shapes
(the tiles' fixed cost between none and the most Table 4 can carry,
:func:`tile_overhead_range`: narrow at Table 4's shapes, wider away from them),
:data:`ELEMENTWISE_TRAFFIC`, and :data:`OVERLAP` where the software does not document it; the
fields a run does not publish are searched. Chapter 13 prints it against every published run of
:func:`trainscale.published.published_runs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from trainscale import _checks
from trainscale.checkpointing import RECOMPUTE
from trainscale.compute import PublishedUtilisation, mfu
from trainscale.memory import USABLE_MEMORY
from trainscale.planner.inputs import (
    Cluster,
    Model,
    _check_inputs,
    _Problem,
    _published,
    _software,
    published_cluster,
    published_model,
)
from trainscale.planner.kernels import tile_overhead_range
from trainscale.planner.layout import Layout, _options, _Shape
from trainscale.planner.memory import _chunks_fit
from trainscale.planner.search import plan, top_layouts
from trainscale.planner.step import _evaluate
from trainscale.published import GPUS, PublishedRun
from trainscale.software import DEFAULT_SOFTWARE, Software


def reported_mfu_6n(run: PublishedRun) -> float:
    """A published run's utilisation in the book's ``6 N`` convention.

    ``6 N`` FLOPs per token times the tokens per second of its ``step_seconds``, over
    the peak of its GPUs (:func:`trainscale.compute.mfu`): comparable with
    :attr:`Layout.mfu`. Papers count more per token
    (:data:`trainscale.compute.FLOP_CONVENTIONS`): attention's products, which are
    model work that ``6 N`` leaves out, and in Megatron-LM's equation 3 also the
    forward pass full recomputation repeats, which is hardware work (HFU), not model
    work. ``step_seconds`` already undid their convention.
    """
    run = _published(run)
    peak = GPUS[run.gpu].peak_flops
    return mfu(run.tokens_per_step / run.step_seconds, run.params, run.gpus, peak)


def reported_mfu(run: PublishedRun) -> float:
    """A published run's MFU in the ``6 N`` convention (:func:`reported_mfu_6n`)."""
    return reported_mfu_6n(run)


@dataclass(frozen=True)
class RunEstimate:
    """The planner's estimate of a published run, at the run's own TP x PP x DP.

    ``mfu`` (6N) and its range ``[mfu_low, mfu_high]``: the fastest setting of the
    fields the run does not publish, under the central and the pessimistic and
    optimistic ends of :func:`gemm_share` (with no tile cost, the counted one and the
    upper end of :func:`tile_overhead_range`), :data:`ELEMENTWISE_TRAFFIC` and
    :data:`OVERLAP` (or the overlap the run's software documents).
    ``layout`` is the central estimate (its ``times`` the step's breakdown, in
    seconds), ``memory_bytes`` its memory per GPU, ``fits`` whether that is within
    :data:`trainscale.memory.USABLE_MEMORY` of the GPU, ``rank`` the published
    shape's place among the planner's fitting shapes (1 = the planner's first
    choice; ``None`` when it is not among them).
    """

    run: PublishedRun
    layout: Layout
    mfu: float
    mfu_low: float
    mfu_high: float
    memory_bytes: float
    fits: bool
    rank: int | None

    @property
    def times(self) -> Mapping[str, float]:
        """The central estimate's step time, term by term (:data:`TIME_PARTS`), in seconds."""
        return self.layout.times


INTERLEAVING = (1, 2, 3, 4, 6, 8)
"""Interleaving depths (model chunks per GPU) tried where a run does not publish one."""


def _choices(run: PublishedRun) -> dict:
    """What a run publishes, or every value the planner tries where it does not: the
    interleaving depths of :data:`INTERLEAVING` and the ZeRO stages its software's engine
    runs at its pipeline depth (DeepSpeed's pipeline engine: one model chunk per GPU,
    ZeRO 0 or 1)."""
    stack = run.software
    return {
        "micro_batches": (run.micro_batch,) if run.micro_batch else (1, 2, 4, 8),
        "zero_stages": (run.zero_stage,)
        if run.zero_stage is not None
        else stack.stages_for(run.pp),
        "recompute": (run.recompute,) if run.recompute else RECOMPUTE,
        "sp": (run.sequence_parallel,) if run.sequence_parallel is not None else (True, False),
        "v": (run.virtual_stages,) if run.virtual_stages else stack.depths_for(INTERLEAVING),
    }


def _best(layouts: Iterable[Layout]) -> Layout | None:
    order = ("fits", "bubble too large", "TP across nodes", "out of memory")
    usable = [lay for lay in layouts if lay.verdict != "invalid"]
    return min(usable, key=lambda lay: (order.index(lay.verdict), lay.step_seconds), default=None)


def _at_shape(
    run: PublishedRun, band: str, overhead: float = 1.0, overlap: float | None = None
) -> Layout | None:
    """The fastest setting at the run's shape, searched over what it does not publish;
    ``overlap`` pins the share of communication hidden (else documented, else the band)."""
    stack = run.software
    model, cluster, c = published_model(run).under(stack), published_cluster(run), _choices(run)
    problem = _Problem(model, cluster, run.global_batch)
    cp = run.cp or 1
    candidates = []
    for v in c["v"]:
        if not _chunks_fit(run.layers, run.pp, v):
            continue
        for sp in c["sp"]:
            opt = _options(
                *(sp, v, None, USABLE_MEMORY, 1.0, band, "1f1b"),
                software=stack,
                overlap=overlap,
                overhead=overhead,
            )
            candidates += [
                _evaluate(
                    problem,
                    _Shape(
                        tp=run.tp,
                        pp=run.pp,
                        dp=run.dp,
                        zero_stage=z,
                        recompute=r,
                        micro_batch=b,
                        cp=cp,
                    ),
                    opt,
                )
                for z in c["zero_stages"]
                for r in c["recompute"]
                for b in c["micro_batches"]
            ]
    return _best(candidates)


def _rank(run: PublishedRun, point: Layout) -> int | None:
    """Place of the run's shape among the planner's fastest fitting shapes (central band).

    Ranked on the run's attention kernel, dropout and gradient dtype, but with the default
    engine rules and overlap band of :data:`trainscale.software.DEFAULT_SOFTWARE` for every
    shape, as before the software was an input (the documented overlap and engine of the
    run's software describe its own layout, not every other shape's)."""
    c = _choices(run)
    own = run.software
    stack = DEFAULT_SOFTWARE.replace(
        fused_attention=own.fused_attention,
        dropout=own.dropout,
        gradient_reduce_dtype=own.gradient_reduce_dtype,
    )
    v = point.virtual_stages
    layouts = plan(
        published_model(run),
        published_cluster(run),
        run.global_batch,
        micro_batches=c["micro_batches"],
        zero_stages=c["zero_stages"],
        recompute=c["recompute"],
        sequence_parallel=point.sequence_parallel,
        virtual_stages=v,
        efficiency=None,
        max_bubble=1.0,
        software=stack,
        context_parallel=(run.cp or 1,),
    )
    shapes = [lay.shape for lay in top_layouts(layouts, count=len(layouts))]
    shape = (run.tp, run.pp, run.dp)
    return shapes.index(shape) + 1 if shape in shapes else None


def _range_ends(evaluate_at) -> tuple[Layout, Layout]:
    """The pessimistic and optimistic layouts among ``evaluate_at(band, overhead)`` for
    the ``low`` and ``high`` bands with no tile cost, the counted one and the upper end
    of :func:`tile_overhead_range`: the one slowest, the other fastest."""
    none, most = tile_overhead_range()
    ends = (none, 1.0, most)
    lows = [evaluate_at("low", overhead) for overhead in ends]
    highs = [evaluate_at("high", overhead) for overhead in ends]
    if None in lows or None in highs:
        raise ValueError("the layout is invalid for the planner")
    return min(lows, key=lambda lay: lay.mfu), max(highs, key=lambda lay: lay.mfu)


def estimate_run(
    run: PublishedRun, overlap: float | None = None, software: Software | str | None = None
) -> RunEstimate:
    """The planner's estimate of a published run, with its range (see :class:`RunEstimate`).

    The run's TP, PP, DP, global batch and GPUs are fixed; each field it leaves
    ``None`` (micro-batch, ZeRO stage, recomputation, sequence parallelism,
    interleaving depth) is searched, and the fastest setting taken, once for each end
    of the range: the ``low`` and ``high`` bands of :func:`gemm_share` (with no tile
    cost, the counted one and the upper end of :func:`tile_overhead_range`),
    :data:`ELEMENTWISE_TRAFFIC` and :data:`OVERLAP` (or the overlap the run's software
    documents, :meth:`trainscale.software.Software.overlap_shares`). ``overlap`` (a share
    in [0, 1]) pins the share of the data- and tensor-parallel communication that hides
    instead: what the range would be if a source said it. ``software`` (a
    :class:`trainscale.software.Software` or a preset's name) replaces the run's own
    :attr:`~trainscale.published.PublishedRun.software`: the same run on another stack;
    ``None``, its own.
    """
    run = _published(run)
    if software is not None:
        run = dataclasses.replace(run, software=_software(software))
    pinned = None if overlap is None else _checks.fraction("overlap", overlap)
    point = _at_shape(run, "point", 1.0, pinned)
    if point is None:
        raise ValueError(f"run {run.name!r}: its layout is invalid for the planner")
    low, high = _range_ends(lambda band, overhead: _at_shape(run, band, overhead, pinned))
    memory_ok = point.memory_bytes <= USABLE_MEMORY * published_cluster(run).memory_bytes
    return RunEstimate(
        run=run,
        layout=point,
        mfu=point.mfu,
        mfu_low=low.mfu,
        mfu_high=high.mfu,
        memory_bytes=point.memory_bytes,
        fits=memory_ok,
        rank=_rank(run, point),
    )


def mfu_range(
    model: Model,
    cluster: Cluster,
    layout: Layout,
    *,
    schedule: str = "1f1b",
    software: Software | str | None = None,
) -> tuple[float, float]:
    """``(low, high)``: the calibrated model's MFU range for one ``layout`` of
    :func:`plan` or :func:`evaluate` (with the ``schedule`` and ``software`` it was
    planned with), the same construction :func:`estimate_run` gives a published run:
    the pessimistic and optimistic bands of :func:`gemm_share` (with no tile cost, the
    counted one and the upper end of :func:`tile_overhead_range`),
    :data:`ELEMENTWISE_TRAFFIC` and :data:`OVERLAP`."""
    _check_inputs(model, cluster, 1)
    stack = _software(software)
    model = model.under(stack)
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a planner.Layout, got {type(layout).__name__}")
    if layout.verdict == "invalid":
        raise ValueError(f"layout must be a valid layout, got one that is invalid: {layout.notes}")

    problem = _Problem(model, cluster, layout.global_batch)
    shape = _Shape(
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        zero_stage=layout.zero_stage,
        recompute=layout.recompute,
        micro_batch=layout.micro_batch,
        cp=layout.cp,
        ep=layout.ep,
    )

    def at(band: str, overhead: float) -> Layout:
        opt = _options(
            layout.sequence_parallel,
            layout.virtual_stages,
            None,
            USABLE_MEMORY,
            1.0,
            band,
            schedule,
            software=stack,
            overhead=overhead,
        )
        return _evaluate(problem, shape, opt)

    low, high = _range_ends(at)
    return low.mfu, high.mfu


def restated_run(use: PublishedUtilisation, base: PublishedRun, **layout) -> PublishedRun:
    """A published utilisation (:data:`trainscale.compute.PUBLISHED_UTILISATION`) as a run
    :func:`estimate_run` can take: ``base``'s model and GPU type, ``use``'s name and GPU
    count, the fields in ``layout`` replaced (TP, DP, batch, ...), and its step time from
    the utilisation restated in 6N (chapter 12): the step's ``6 N`` FLOPs over the GPUs'
    peak times that utilisation."""
    if not isinstance(use, PublishedUtilisation):
        raise ValueError(f"use must be a compute.PublishedUtilisation, got {type(use).__name__}")
    run = dataclasses.replace(_published(base), name=use.name, gpus=use.gpus, **layout)
    six_n_flops = 6 * run.params * run.tokens_per_step
    seconds = six_n_flops / (use.gpus * use.peak_flops * use.utilisation("6n"))
    return dataclasses.replace(run, step_seconds=seconds)


CALIBRATION_TARGETS = {
    "coverage": 0.90,
    "median error": 0.10,
    "within 1.35": 1.0,
    "fits": 1.0,
    "top 5": 0.70,
}
"""The calibration's targets (issue 12): the share of runs whose published MFU lies in
the range (at least), the median of ``|estimate / published - 1|`` (at most), the share
of ranges no wider than 1.35x, of published layouts that fit, and of published shapes
among the planner's five fastest (at least)."""


def calibration_targets(estimates: Sequence[RunEstimate]) -> dict[str, float]:
    """How ``estimates`` (of :func:`estimate_run`) meet :data:`CALIBRATION_TARGETS`, with
    the widest range (high / low) as well."""
    if not estimates or not all(isinstance(e, RunEstimate) for e in estimates):
        raise ValueError("estimates must be a non-empty sequence of planner.RunEstimate")
    n = len(estimates)
    published = [reported_mfu(e.run) for e in estimates]
    errors = sorted(abs(e.mfu / p - 1) for e, p in zip(estimates, published, strict=True))
    spans = [e.mfu_high / e.mfu_low for e in estimates]
    return {
        "coverage": sum(
            e.mfu_low <= p <= e.mfu_high for e, p in zip(estimates, published, strict=True)
        )
        / n,
        "median error": (errors[(n - 1) // 2] + errors[n // 2]) / 2,
        "within 1.35": sum(span <= 1.35 for span in spans) / n,
        "widest range": max(spans),
        "fits": sum(e.fits for e in estimates) / n,
        "top 5": sum(e.rank is not None and e.rank <= 5 for e in estimates) / n,
    }
