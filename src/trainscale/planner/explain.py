"""``--explain TP,PP,DP[,CP,EP,V]``: why one layout ranks where it does, or why it is rejected.

:func:`explain_spec` (in :mod:`~trainscale.planner.arguments`) reads the flag's value;
:func:`explain` estimates that layout at every
setting the search tries (ZeRO stage, recomputation, micro-batch, interleaving depth) and
says, for its best setting, where its shape ranks among those that fit, which term of the
step time limits it (:data:`trainscale.planner.TIME_PARTS`) and how far it is from the
planner's first choice, term by term; for a layout that does not fit, the rule it breaks
with the term behind it (the largest part of the memory, the bubble, the note of an
invalid layout).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainscale import planner
from trainscale.memory import GIB
from trainscale.planner.arguments import SPEC_FIELDS, Request, explain_spec

__all__ = ["SPEC_FIELDS", "explain", "explain_spec"]


def _candidates(request: Request, spec: tuple[int, ...]) -> list[planner.Layout]:
    """The layout of ``spec`` at every setting the search tries, best first."""
    tp, pp, dp, cp, ep, v = spec
    stack = request.software
    depths = (v,) if v else stack.depths_for(request.virtual_stages) if pp > 1 else (1,)
    found = [
        planner.evaluate(
            *(request.model, request.cluster, request.global_batch, tp, pp, dp),
            *(zero, mode, micro),
            virtual_stages=depth,
            software=stack,
            context_parallel=cp,
            expert_parallel=ep,
        )
        for zero in stack.zero_stages
        for mode in planner.RECOMPUTE
        for micro in (1, 2, 4, 8)
        for depth in depths
    ]
    order = ("fits", "bubble too large", "TP across nodes", "out of memory", "invalid")
    return sorted(
        found,
        key=lambda lay: (order.index(lay.verdict), len(lay.problems), lay.step_seconds),
    )


def _terms(layout: planner.Layout) -> list[tuple[str, float]]:
    """The step's terms, largest first, in seconds."""
    return sorted(layout.times.items(), key=lambda item: -item[1])


def _setting(layout: planner.Layout) -> str:
    return f"{layout.settings}, V {layout.virtual_stages}"


def explain(
    request: Request, spec: tuple[int, ...], layouts: Sequence[planner.Layout]
) -> list[str]:
    """The lines ``--explain`` prints for ``spec`` (:func:`explain_spec`), with ``layouts``
    the search's results (for the ranking)."""
    tp, pp, dp, cp, ep, v = spec
    name = f"TP {tp} x {f'CP {cp} x ' if cp > 1 else ''}PP {pp} x DP {dp}"
    name += f"{f' (EP {ep})' if ep > 1 else ''}{f', V {v}' if v else ''}"
    best = _candidates(request, spec)[0]
    lines = [f"explain {name}:"]
    if best.verdict == "invalid":
        return [*lines, f"  rejected at every setting: {'; '.join(best.notes)}"]
    if best.verdict != "fits":
        lines.append(f"  rejected: its nearest setting ({_setting(best)}) breaks")
        for problem, note in zip(best.problems, best.notes[-len(best.problems) :], strict=True):
            lines.append(f"    {problem}: {note}")
        if "out of memory" in best.problems:
            part, size = max(best.memory_parts.items(), key=lambda item: item[1])
            lines.append(
                f"    the largest part of its memory: {part}, {size / GIB:.1f} GiB per GPU"
            )
        return lines
    shapes = [lay.shape for lay in planner.top_layouts(layouts, count=len(layouts))]
    place = shapes.index(best.shape) + 1 if best.shape in shapes else None
    first = planner.top_layouts(layouts, 1)[0] if shapes else best
    step = best.step_seconds
    rank = f"its shape ranks {place} of {len(shapes):,} fitting shapes" if place else "it fits"
    lines += [
        f"  {rank}; this layout at its best ({_setting(best)}) MFU {best.mfu:.1%},"
        f" step {step:.2f} s, {best.memory_bytes / GIB:.1f} GiB per GPU",
        "  its step, largest terms first: "
        + ", ".join(f"{part} {seconds / step:.0%}" for part, seconds in _terms(best)[:4]),
    ]
    overheads = [(part, seconds) for part, seconds in _terms(best) if part != "compute"]
    part, seconds = overheads[0]
    bound = "compute-bound" if _terms(best)[0][0] == "compute" else "not compute-bound"
    lines.append(f"  limiting term: {part}, {seconds / step:.0%} of the step ({bound})")
    if place != 1:
        gaps = {part: best.times[part] - first.times[part] for part in best.times}
        part, gap = max(gaps.items(), key=lambda item: item[1])
        lines.append(
            f"  against the first, {first.name.replace(chr(215), 'x')} ({_setting(first)}):"
            f" {step / first.step_seconds - 1:+.0%} step time, most of it {part}"
            f" ({gap:+.2f} s)"
        )
    return lines
