"""Figures of chapter 16's decisions: which parallelism to add, as a flowchart drawn from the
book's decision table, and how the failure interval and the checkpoint interval shrink as a
cluster grows.

The flowchart's questions and answers are data (:data:`WHICH_PARALLELISM`), condensed from the
decision table of the cheat sheet ("Which parallelism, in order") and chapter 9, with its
context- and expert-parallel rows from chapters 10 and 11. Like the table, it leaves out
everything a cost model weighs (link speeds, batch, bubble): it says which dimension to
consider next, and the planner and a measurement say how much of it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

from trainscale.figures.style import INK, MUTED_INK, PALE_GREY, PALETTE, STYLE, new_figure


@dataclass(frozen=True)
class Leaf:
    """What to add (or do): ``title``, a one-line ``detail``, the ``chapters`` that teach it,
    and the ``row`` of the decision table it condenses (``None`` for the flowchart's end)."""

    title: str
    detail: str
    chapters: tuple[int, ...]
    row: str | None


@dataclass(frozen=True)
class Question:
    """A yes-or-no question: ``yes`` and ``no`` are what each answer adds (``None``: nothing),
    ``then`` is where the reader goes next whatever the answer (another question, or the end)."""

    text: str
    yes: Leaf | None
    no: Leaf | None
    then: Question | Leaf


_END = Leaf(
    "Estimate it, then measure it",
    "the planner ranks the layouts; measure the best two or three for a few steps",
    (16, 15),
    None,
)
_EXPERTS = Question(
    "A mixture of experts whose experts' weights do not fit?",
    yes=Leaf(
        "Expert parallelism",
        "experts spread over data-parallel GPUs, while the all-to-alls stay small "
        "next to the experts' compute",
        (11,),
        "expert parallelism",
    ),
    no=None,
    then=_END,
)
_CONTEXT = Question(
    "Long sequences: do the activations of one sequence no longer fit?",
    yes=Leaf(
        "Context parallelism",
        "each rank a slice of every sequence, while it keeps enough tokens "
        "for the ring's traffic to hide",
        (10,),
        "context parallelism",
    ),
    no=None,
    then=_EXPERTS,
)
_PIPELINE = Question(
    "Does the state not fit even sharded over a node, or are the only links left slow?",
    yes=Leaf(
        "Pipeline parallelism, across nodes",
        "stages send point to point; keep the micro-batches several times the stages",
        (9,),
        "pipeline parallelism",
    ),
    no=None,
    then=_CONTEXT,
)
_TENSOR = Question(
    "Would more GPUs push the tokens per GPU below T*, or is a layer too big or too slow "
    "for one GPU?",
    yes=Leaf(
        "Tensor parallelism, inside a node",
        "each replica becomes several GPUs, while its traffic stays small next to compute",
        (8,),
        "tensor parallelism",
    ),
    no=None,
    then=_PIPELINE,
)
WHICH_PARALLELISM = Question(
    "Does the model state (16 bytes per parameter) fit on one GPU?",
    yes=Leaf(
        "Data parallelism: DDP",
        "a full copy on every GPU, while each GPU's tokens per step stay above T*",
        (5, 6),
        "data parallelism",
    ),
    no=Leaf(
        "FSDP (ZeRO-3) and activation checkpointing",
        "each GPU keeps a share of the state; the same limit on tokens per GPU",
        (7, 3),
        "data parallelism",
    ),
    then=_TENSOR,
)
"""Which parallelism, as questions taken in order: the decision table of the cheat sheet
(chapters 9 to 11), one question per row, the first split by whether the state fits one GPU."""


def walk(tree: Question) -> Iterator[Question | Leaf]:
    """Every node reachable from ``tree``, each once, questions before what they lead to."""
    seen: set[int] = set()
    stack: list[Question | Leaf] = [tree]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node, Question):
            stack.extend(n for n in (node.then, node.no, node.yes) if n is not None)


def _spine(tree: Question) -> tuple[list[Question], Leaf]:
    """The questions in the order a reader meets them, and the end they lead to."""
    if not isinstance(tree, Question):
        raise ValueError(f"tree must be a Question, got {type(tree).__name__}")
    questions: list[Question] = []
    node: Question | Leaf = tree
    while isinstance(node, Question):
        if node in questions:
            raise ValueError("tree must not loop back to a question it has asked")
        if node.yes is None and node.no is None:
            raise ValueError(f"tree: question {node.text!r} must add something for some answer")
        questions.append(node)
        node = node.then
    return questions, node


def _chapters(chapters: tuple[int, ...]) -> str:
    word = "chapter" if len(chapters) == 1 else "chapters"
    return f"{word} {', '.join(str(c) for c in chapters)}"


LEAF_COLOURS = {
    "data parallelism": PALETTE["green"],
    "tensor parallelism": PALETTE["orange"],
    "pipeline parallelism": PALETTE["sky"],
    "context parallelism": PALETTE["red"],
    "expert parallelism": PALETTE["purple"],
    None: INK,
}
"""The outline of each leaf, by decision-table row (the colours of the planner's time parts)."""

_WIDTH = 7.4  # inches: the axes use inch coordinates
_Q_X, _Q_W = 0.05, 3.25  # question boxes
_L_X, _L_W = 3.95, 3.4  # leaf boxes
_LEAF_H, _Q_H, _GAP = 0.78, 0.62, 0.28


def _box(ax: Axes, x: float, top: float, w: float, h: float, face: str, edge: str, lw: float):
    ax.add_patch(
        FancyBboxPatch(
            (x, top - h),
            w,
            h,
            boxstyle="round,pad=0,rounding_size=0.08",
            facecolor=face,
            edgecolor=edge,
            linewidth=lw,
        )
    )


def _leaf(ax: Axes, leaf: Leaf, x: float, top: float, width: float = _L_W) -> None:
    """A box that adds a kind of parallelism (or ends the chart): title, detail, chapters."""
    _box(ax, x, top, width, _LEAF_H, "white", LEAF_COLOURS[leaf.row], 2.0)
    ax.text(x + 0.1, top - 0.08, leaf.title, ha="left", va="top", fontsize=8.5, weight="bold")
    detail = textwrap.fill(leaf.detail, width=52)
    ax.text(x + 0.1, top - 0.27, detail, ha="left", va="top", fontsize=7.5, color=INK)
    ax.text(
        x + width - 0.1,
        top - _LEAF_H + 0.06,
        _chapters(leaf.chapters),
        ha="right",
        va="bottom",
        fontsize=7.5,
        color=MUTED_INK,
        style="italic",
    )


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], label: str) -> None:
    ax.annotate(
        "",
        end,
        start,
        arrowprops={"arrowstyle": "-|>", "color": MUTED_INK, "lw": 1.1, "shrinkA": 0, "shrinkB": 0},
    )
    if label:
        middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(*middle, label, ha="center", va="bottom", fontsize=8, color=INK, weight="bold")


def parallelism_flowchart(
    tree: Question = WHICH_PARALLELISM,
    *,
    title: str = "Which parallelism? Take the questions in order; each answer adds its box",
    source: str,
) -> Figure:
    """The questions of ``tree`` down the left, taken in order, each answer's addition to
    the right (outlined in its decision-table row's colour, with its chapters), and the end
    at the bottom. Sizes in inches; ``source`` names where the questions come from."""
    if not source.strip():
        raise ValueError("source must say where the questions come from, got ''")
    questions, end = _spine(tree)
    rows = [max(1, (q.yes is not None) + (q.no is not None)) for q in questions]
    height = sum(r * (_LEAF_H + _GAP) for r in rows) + _LEAF_H + 0.05
    with plt.rc_context({**STYLE, "axes.grid": False}):
        fig, ax = new_figure((_WIDTH, height + 0.7))
        ax.set_axis_off()
        ax.set_xlim(0, _WIDTH)
        ax.set_ylim(0, height)
        tops, top = [], height - 0.02
        for count in rows:  # the top of each row, and of the end below them
            tops.append(top)
            top -= count * (_LEAF_H + _GAP)
        # a question spans the leaves its answers add, so every arrow to them is level
        q_heights = [_Q_H if r == 1 else r * (_LEAF_H + _GAP) - _GAP - 0.3 for r in rows]
        q_tops = [
            t - (r * (_LEAF_H + _GAP) - _GAP - h) / 2
            for t, r, h in zip(tops, rows, q_heights, strict=True)
        ]
        centre = _Q_X + _Q_W / 2
        for k, question in enumerate(questions):
            q_top, q_h = q_tops[k], q_heights[k]
            _box(ax, _Q_X, q_top, _Q_W, q_h, PALE_GREY, INK, 0.8)
            ax.text(
                centre,
                q_top - q_h / 2,
                textwrap.fill(question.text, width=44),
                ha="center",
                va="center",
                fontsize=8.5,
            )
            answers = [
                (a, leaf) for a, leaf in (("yes", question.yes), ("no", question.no)) if leaf
            ]
            for j, (answer, leaf) in enumerate(answers):
                leaf_top = tops[k] - j * (_LEAF_H + _GAP)
                _leaf(ax, leaf, _L_X, leaf_top)
                level = leaf_top - _LEAF_H / 2
                _arrow(ax, (_Q_X + _Q_W, level), (_L_X, level), answer)
            following = q_tops[k + 1] if k + 1 < len(questions) else top
            _arrow(ax, (centre, q_top - q_h), (centre, following), "")
        _leaf(ax, end, _Q_X, top, width=_Q_W)
        ax.set_title(title, loc="left")
        fig.supxlabel(
            textwrap.fill(source, width=120), x=0.01, ha="left", fontsize=7, color=MUTED_INK
        )
    return fig


def _log2_ticks(axis, values: Sequence[float]) -> None:
    axis.set_major_locator(FixedLocator(list(values)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


HOURS_TICKS = tuple(10.0**e for e in range(-3, 7))
"""Tick values of the hours axis: the powers of ten (the axis spans several decades)."""


def failure_intervals(
    gpus: Sequence[int],
    job_mtbf: Sequence[float],
    checkpoint_interval: Sequence[float],
    *,
    save_seconds: float,
    title: str,
    source: str,
) -> Figure:
    """A job's mean time between failures and its checkpoint interval against its GPUs, log-log.

    ``gpus`` are the cluster sizes; ``job_mtbf`` (seconds) the job's MTBF at each
    (:func:`trainscale.reliability.job_mtbf_seconds`); ``checkpoint_interval`` (seconds) the
    interval between saves at each (:func:`trainscale.reliability.young_interval` with saves
    of ``save_seconds``). Both are drawn in hours.
    """
    if len(gpus) < 2:
        raise ValueError(f"gpus must hold at least 2 cluster sizes, got {len(gpus)}")
    for name, values in (("job_mtbf", job_mtbf), ("checkpoint_interval", checkpoint_interval)):
        if len(values) != len(gpus):
            raise ValueError(
                f"{name} must have one value per GPU count ({len(gpus)}), got {len(values)}"
            )
        if any(v <= 0 for v in values):
            raise ValueError(f"{name} must hold seconds > 0, got {list(values)}")
    if any(n < 1 for n in gpus):
        raise ValueError(f"gpus must be counts >= 1, got {list(gpus)}")
    if not source.strip():
        raise ValueError("source must say where the failure rate comes from, got ''")
    mtbf_hours = [m / 3_600 for m in job_mtbf]
    interval_hours = [t / 3_600 for t in checkpoint_interval]
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 3.6))
        ax.plot(gpus, mtbf_hours, "o-", color=INK, linewidth=2, markersize=4, label="job MTBF")
        ax.plot(
            gpus,
            interval_hours,
            "s--",
            color=PALETTE["blue"],
            linewidth=1.8,
            markersize=4,
            label=f"checkpoint interval $\\sqrt{{2CM}}$, C = {save_seconds:g} s",
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="major", axis="both")
        ticks = list(gpus[::3])
        _log2_ticks(ax.xaxis, ticks if ticks[-1] == gpus[-1] else [*ticks, gpus[-1]])
        shown = [*mtbf_hours, *interval_hours]
        low, high = min(shown) / 1.5, max(shown) * 1.5
        ax.yaxis.set_major_locator(FixedLocator([t for t in HOURS_TICKS if low <= t <= high]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(low, high)
        ax.set_xlabel("GPUs in the job")
        ax.set_ylabel("hours")
        ax.set_title(title, loc="left")
        fig.legend(loc="outside upper center", fontsize=8, ncols=2)
        fig.supxlabel(
            textwrap.fill(source, width=119), x=0.01, ha="left", fontsize=7, color=MUTED_INK
        )
    return fig
