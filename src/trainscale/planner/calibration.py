"""Calibration: the planner against published runs, read on one set and judged on another.

:func:`estimate_run` estimates a published run (:func:`trainscale.published.published_runs`)
at its own layout, with a range (:class:`RunEstimate`); :func:`mfu_range` gives any
layout of :func:`plan` the same range; :func:`reported_mfu` restates a run's published
utilisation in the book's ``6 N`` convention and :func:`restated_run` turns a published
utilisation into a run; :func:`calibration_targets` measures estimates against
:data:`CALIBRATION_TARGETS`. What a run's software did is its
:attr:`~trainscale.published.PublishedRun.software` (:class:`trainscale.software.Software`,
each field read off the stack's code or docs).

The runs are split by GPU before anything is read off them (:func:`split_runs`): the A100
runs (:data:`FIT_GPUS`, most of them Megatron-LM on NVIDIA's Selene, the stack and machine
of the one measurement the GEMM share is read off) are the set the model was built and
checked against; the H100 runs (Megatron-Core's and torchtitan's published benchmarks,
Llama 3) are held out: they say how well the model predicts runs it was not read against.

A range has two parts. The unknowns' span (:mod:`trainscale.planner.unknowns`): the
slowest and the fastest estimate over the settings of what no source pins, with the GEMM
share re-read off Table 4 at each setting (so the span is narrow near Table 4's layer and
wider away from it). And the model's own error: the span is widened on each side by
:data:`MODEL_MARGIN`, the split-conformal margin (:func:`conformal_margin`) that brings 90 %
of the A100 runs inside it. On the A100 runs the coverage is then about 90 % by
construction; on the held-out runs it is a prediction, and chapter 16's appendix prints how
it fares.
"""

from __future__ import annotations

import dataclasses
import functools
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
from trainscale.planner.layout import Layout, _options, _Shape
from trainscale.planner.memory import _chunks_fit
from trainscale.planner.search import plan, top_layouts
from trainscale.planner.step import _evaluate
from trainscale.planner.unknowns import CENTRAL, Unknowns, range_corners
from trainscale.published import GPUS, PublishedRun, published_runs
from trainscale.software import Software


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
    fields the run does not publish, at the central unknowns and at the slowest and the
    fastest of :func:`trainscale.planner.unknowns.range_corners` (``span_low`` and
    ``span_high``, the unknowns' span, with the overlap the run's software documents),
    widened by the model's ``margin`` (:data:`MODEL_MARGIN`).
    ``layout`` is the central estimate (its ``times`` the step's breakdown, in
    seconds), ``memory_bytes`` its memory per GPU, ``fits`` whether that is within
    :data:`trainscale.memory.USABLE_MEMORY` of the GPU, ``rank`` the published
    shape's place among the planner's fitting shapes (1 = the planner's first
    choice; ``None`` when it is not among them).
    """

    run: PublishedRun
    layout: Layout
    mfu: float
    span_low: float
    span_high: float
    margin: float
    memory_bytes: float
    fits: bool
    rank: int | None

    @property
    def mfu_low(self) -> float:
        """The range's low end: the unknowns' slowest, divided by ``1 + margin``."""
        return self.span_low / (1 + self.margin)

    @property
    def mfu_high(self) -> float:
        """The range's high end: the unknowns' fastest, times ``1 + margin``."""
        return self.span_high * (1 + self.margin)

    @property
    def inside(self) -> bool:
        """Whether the run's published 6N MFU (:func:`reported_mfu`) is within the range."""
        return self.mfu_low <= reported_mfu(self.run) <= self.mfu_high

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
    run: PublishedRun, unknowns: Unknowns = CENTRAL, overlap: float | None = None
) -> Layout | None:
    """The fastest setting at the run's shape, searched over what it does not publish, at
    one setting of the ``unknowns``; ``overlap`` pins the share of communication hidden
    (else documented, else the unknowns')."""
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
                *(sp, v, None, USABLE_MEMORY, 1.0, unknowns, "1f1b"),
                software=stack,
                overlap=overlap,
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


@functools.lru_cache(maxsize=64)
def ranked_search(run: PublishedRun, search_context_parallel: bool = False) -> tuple[Layout, ...]:
    """The layouts that fit the run's model, GPUs and batch, fastest first, under the
    defaults a user of ``python -m trainscale.planner --software`` gets (the run's
    software; every interleaving depth, ZeRO stage, recomputation mode and micro-batch the
    defaults try; the default bubble limit; the central unknowns), at the run's CP degree,
    or with ``search_context_parallel`` every degree the command line tries by default
    (:func:`context_parallel_degrees`)."""
    cluster = published_cluster(run)
    layouts = plan(
        published_model(run),
        cluster,
        run.global_batch,
        virtual_stages=INTERLEAVING,
        software=run.software,
        context_parallel=None if search_context_parallel else (run.cp or 1,),
        tensor_parallel=range(1, cluster.gpus_per_node + 1),  # wider: never fits, never ranks
    )
    return tuple(top_layouts(layouts, count=len(layouts)))


def shape_rank(run: PublishedRun, search_context_parallel: bool = False) -> int | None:
    """Place of the run's TP x PP x DP among the shapes of :func:`ranked_search`;
    ``None`` when it is not among the shapes that fit."""
    shapes = [lay.shape for lay in ranked_search(run, search_context_parallel)]
    shape = (run.tp, run.pp, run.dp)
    return shapes.index(shape) + 1 if shape in shapes else None


def _range_ends(evaluate_at) -> tuple[Layout, Layout]:
    """The slowest layout among ``evaluate_at(unknowns)`` at the pessimistic corners of
    :func:`trainscale.planner.unknowns.range_corners` and the fastest at the optimistic
    ones: the range's two ends."""
    pessimistic, optimistic = range_corners()
    lows = [evaluate_at(u) for u in pessimistic]
    highs = [evaluate_at(u) for u in optimistic]
    if None in lows or None in highs:
        raise ValueError("the layout is invalid for the planner")
    return min(lows, key=lambda lay: lay.mfu), max(highs, key=lambda lay: lay.mfu)


def estimate_run(
    run: PublishedRun,
    overlap: float | None = None,
    software: Software | str | None = None,
    *,
    margin: float | None = None,
    rank: bool = True,
) -> RunEstimate:
    """The planner's estimate of a published run, with its range (see :class:`RunEstimate`).

    The run's TP, PP, DP, global batch and GPUs are fixed; each field it leaves
    ``None`` (micro-batch, ZeRO stage, recomputation, sequence parallelism,
    interleaving depth) is searched, and the fastest setting taken, at the central
    unknowns and at each corner of :func:`trainscale.planner.unknowns.range_corners`.
    ``overlap`` (a share in [0, 1]) pins the share of the data- and tensor-parallel
    communication that hides instead of the software's documentation or the unknowns:
    what the range would be if a source said it. ``software`` (a
    :class:`trainscale.software.Software` or a preset's name) replaces the run's own
    :attr:`~trainscale.published.PublishedRun.software`: the same run on another stack;
    ``None``, its own. ``margin``: the model's error margin (``None``: :data:`MODEL_MARGIN`;
    0: the unknowns' span alone). ``rank=False`` skips the search for the shape's rank.
    """
    run = _published(run)
    if software is not None:
        run = dataclasses.replace(run, software=_software(software))
    pinned = None if overlap is None else _checks.fraction("overlap", overlap)
    widen = model_margin() if margin is None else _checks.non_negative("margin", margin)
    point = _at_shape(run, CENTRAL, pinned)
    if point is None:
        raise ValueError(f"run {run.name!r}: its layout is invalid for the planner")
    low, high = _range_ends(lambda unknowns: _at_shape(run, unknowns, pinned))
    memory_ok = point.memory_bytes <= USABLE_MEMORY * published_cluster(run).memory_bytes
    return RunEstimate(
        run=run,
        layout=point,
        mfu=point.mfu,
        span_low=low.mfu,
        span_high=high.mfu,
        margin=widen,
        memory_bytes=point.memory_bytes,
        fits=memory_ok,
        rank=shape_rank(run) if rank else None,
    )


def mfu_range(
    model: Model,
    cluster: Cluster,
    layout: Layout,
    *,
    schedule: str = "1f1b",
    software: Software | str | None = None,
    margin: float | None = None,
) -> tuple[float, float]:
    """``(low, high)``: the calibrated model's MFU range for one ``layout`` of
    :func:`plan` or :func:`evaluate` (with the ``schedule`` and ``software`` it was
    planned with), the same construction :func:`estimate_run` gives a published run:
    the unknowns' span (:func:`trainscale.planner.unknowns.range_corners`) widened by
    ``margin`` (``None``: :data:`MODEL_MARGIN`)."""
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

    def at(unknowns: Unknowns) -> Layout:
        opt = _options(
            layout.sequence_parallel,
            layout.virtual_stages,
            None,
            USABLE_MEMORY,
            1.0,
            unknowns,
            schedule,
            software=stack,
        )
        return _evaluate(problem, shape, opt)

    low, high = _range_ends(at)
    widen = model_margin() if margin is None else _checks.non_negative("margin", margin)
    return low.mfu / (1 + widen), high.mfu * (1 + widen)


def restated_run(use: PublishedUtilisation, base: PublishedRun, **layout) -> PublishedRun:
    """A published utilisation (:data:`trainscale.compute.PUBLISHED_UTILISATION`) as a run
    :func:`estimate_run` can take: ``base``'s model and GPU type, ``use``'s name and GPU
    count, the fields in ``layout`` replaced (TP, DP, batch, ...), and its step time from
    the utilisation restated in 6N (chapter 15): the step's ``6 N`` FLOPs over the GPUs'
    peak times that utilisation."""
    if not isinstance(use, PublishedUtilisation):
        raise ValueError(f"use must be a compute.PublishedUtilisation, got {type(use).__name__}")
    run = dataclasses.replace(_published(base), name=use.name, gpus=use.gpus, **layout)
    six_n_flops = 6 * run.params * run.tokens_per_step
    seconds = six_n_flops / (use.gpus * use.peak_flops * use.utilisation("6n"))
    return dataclasses.replace(run, step_seconds=seconds)


CALIBRATION_TARGETS = {
    "coverage": 0.80,
    "median error": 0.10,
    "within 1.35": 1.0,
    "fits": 1.0,
    "top 5": 0.70,
}
"""The targets (issue 20, for the held-out runs): the share of runs whose published MFU
lies in the range (at least), the median of ``|estimate / published - 1|`` (at most), the
share of ranges no wider than 1.35x where the software documents its overlap, of
published layouts that fit, and of published shapes among the five the planner ranks first
under a user's defaults (at least)."""


def calibration_targets(estimates: Sequence[RunEstimate]) -> dict[str, float]:
    """How ``estimates`` (of :func:`estimate_run`) meet :data:`CALIBRATION_TARGETS`, with
    the widest range (high / low) as well. "within 1.35" counts the runs whose software
    documents its overlap (:meth:`trainscale.software.Software.overlap_shares`); the
    others' ranges carry that unknown too."""
    if not estimates or not all(isinstance(e, RunEstimate) for e in estimates):
        raise ValueError("estimates must be a non-empty sequence of planner.RunEstimate")
    n = len(estimates)
    published = [reported_mfu(e.run) for e in estimates]
    errors = sorted(abs(e.mfu / p - 1) for e, p in zip(estimates, published, strict=True))
    spans = [e.mfu_high / e.mfu_low for e in estimates]
    documented = [s for e, s in zip(estimates, spans, strict=True) if _documented(e.run)]
    return {
        "coverage": sum(e.inside for e in estimates) / n,
        "median error": (errors[(n - 1) // 2] + errors[n // 2]) / 2,
        "within 1.35": sum(span <= 1.35 for span in documented) / max(1, len(documented)),
        "widest range": max(spans),
        "fits": sum(e.fits for e in estimates) / n,
        "top 5": sum(e.rank is not None and e.rank <= 5 for e in estimates) / n,
    }


def _documented(run: PublishedRun) -> bool:
    """Whether the run's software documents how much of its communication hides."""
    zero = run.zero_stage if run.zero_stage is not None else min(run.software.stages_for(run.pp))
    return None not in run.software.overlap_shares(run.pp, zero)


FIT_GPUS = ("A100-80GB",)
"""The GPUs of the runs the planner is read against: the A100 era (Megatron-LM, DeepSpeed
and BLOOM on A100s, 2021-2022). Runs on every other GPU are held out."""


def split_runs(
    runs: Sequence[PublishedRun] | None = None,
) -> tuple[tuple[PublishedRun, ...], tuple[PublishedRun, ...]]:
    """``(fit, held_out)``: ``runs`` (``None``: every published run) split by GPU,
    :data:`FIT_GPUS` against the rest, in their order."""
    runs = published_runs() if runs is None else tuple(_published(r) for r in runs)
    fit = tuple(r for r in runs if r.gpu in FIT_GPUS)
    return fit, tuple(r for r in runs if r.gpu not in FIT_GPUS)


MARGIN_COVERAGE = 0.90
"""The share of the fit runs :data:`MODEL_MARGIN` brings inside their range."""


def conformal_margin(estimates: Sequence[RunEstimate], coverage: float = MARGIN_COVERAGE) -> float:
    """The split-conformal margin of the model's error (Vovk et al. 2005; Lei et al.
    2018, arXiv 1604.04173): each estimate's score is how far, as a share, its published
    MFU lies outside the unknowns' span ``[span_low, span_high]`` (``max(span_low / p,
    p / span_high) - 1``, negative inside); the margin is the ``ceil((n + 1) coverage)``-th
    smallest of the ``n`` scores (at least 0). Widening each span by it on both sides
    brings ``coverage`` of these runs inside, and, for runs drawn like them, at least
    ``coverage`` of new ones: the claim the held-out runs test."""
    if not estimates or not all(isinstance(e, RunEstimate) for e in estimates):
        raise ValueError("estimates must be a non-empty sequence of planner.RunEstimate")
    level = _checks.fraction("coverage", coverage)
    scores = sorted(
        max(e.span_low / p, p / e.span_high) - 1
        for e, p in ((e, reported_mfu(e.run)) for e in estimates)
    )
    k = -(-(len(scores) + 1) * level // 1)
    if k > len(scores):
        raise ValueError(
            f"coverage {coverage} needs at least {int(k)} estimates, got {len(scores)}"
        )
    return max(0.0, scores[int(k) - 1])


@functools.cache
def model_margin() -> float:
    """:data:`MODEL_MARGIN`: :func:`conformal_margin` of the fit runs (:func:`split_runs`),
    each estimated with no margin of its own. Computed when first asked for (a second or
    two: every fit run's estimate), not when the planner is imported."""
    fit, _ = split_runs()
    return conformal_margin([estimate_run(run, margin=0.0, rank=False) for run in fit])


def __getattr__(name: str) -> object:
    """``MODEL_MARGIN``: the model's error margin, :func:`model_margin` (computed when first
    read)."""
    if name == "MODEL_MARGIN":
        return model_margin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
