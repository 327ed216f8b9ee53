"""Sliders that work in JupyterLab *and* on the static website, with no kernel.

On a built web page there is no Python behind a widget: a slider bound to a
Python callback moves but its figure never changes. So every figure the
slider can show is drawn in advance, put in a ``widgets.Stack`` (which shows
one child at a time), and the slider's position is linked to the stack's
``selected_index`` with ``widgets.jslink``, a link the browser runs by itself.

Figures are embedded as inline SVG: sharp at any zoom, small once gzipped,
and byte-identical from run to run (fixed hash salt, no date), so re-running
a notebook does not churn its stored output.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence

import ipywidgets as widgets
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures import svg_text

MAX_FIGURES = 120
"""Most figures one widget may precompute: each adds to the page's weight."""


def figure_to_svg(fig: Figure, alt: str) -> str:
    """Render ``fig`` as an inline ``<svg>`` element labelled ``alt``, and close it.

    The SVG gets ``role="img"`` and ``aria-label`` so a screen reader announces
    what the figure shows, and scales to the width of the page.
    """
    if not alt.strip():
        raise ValueError("alt must describe the figure, got an empty string")
    svg = svg_text(fig)
    plt.close(fig)  # a no-op for a BookFigure, but frees a pyplot figure
    svg = svg[svg.index("<svg") :]  # drop the XML declaration and DOCTYPE
    label = html.escape(alt, quote=True)
    return re.sub(
        r"<svg ",
        f'<svg role="img" aria-label="{label}" style="max-width:100%;height:auto" ',
        svg,
        count=1,
    )


class FigureSlider(widgets.VBox):
    """A ``VBox`` of sliders and precomputed figures with a short, stable ``repr``.

    The default repr lists every child, SVG text included; this one stays the
    same across library versions, so the notebook's stored text output does too.
    """

    def __repr__(self) -> str:
        sliders = [c.description for c in self.children if isinstance(c, widgets.SelectionSlider)]
        return f"FigureSlider(sliders={sliders})"


def _page(fig: Figure, alt: str) -> widgets.HTML:
    return widgets.HTML(figure_to_svg(fig, alt))


def _slider(description: str, options: Sequence[tuple[str, object]], value: object):
    """A ``SelectionSlider`` over ``(label, value)`` options, starting at ``value``."""
    values = [v for _, v in options]
    if value not in values:
        raise ValueError(f"value must be one of the slider's values {values}, got {value!r}")
    return widgets.SelectionSlider(
        options=list(options),
        value=value,
        description=description,
        continuous_update=True,
        style={"description_width": "initial"},
        layout=widgets.Layout(width="95%"),
    )


def _options(values: Sequence[object], label: Callable[[object], str]) -> list[tuple[str, object]]:
    if len(values) == 0:
        raise ValueError("values must hold at least one position, got none")
    return [(label(v), v) for v in values]


def slider(
    values: Sequence[object],
    make_figure: Callable[[object], Figure],
    *,
    description: str,
    value: object,
    alt: Callable[[object], str],
    label: Callable[[object], str] = str,
) -> FigureSlider:
    """One slider over ``values`` switching between precomputed figures.

    ``make_figure(v)`` draws the figure for position ``v``; ``alt(v)`` describes
    it in words; ``label(v)`` is the text the slider shows.
    """
    options = _options(values, label)
    if len(options) > MAX_FIGURES:
        raise ValueError(f"values must have at most {MAX_FIGURES} positions, got {len(options)}")
    pages = [_page(make_figure(v), alt(v)) for _, v in options]
    control = _slider(description, options, value)
    stack = widgets.Stack(pages, selected_index=control.index)
    widgets.jslink((control, "index"), (stack, "selected_index"))
    return FigureSlider([control, stack])


def two_sliders(
    first: Sequence[object],
    second: Sequence[object],
    make_figure: Callable[[object, object], Figure],
    *,
    descriptions: tuple[str, str],
    value: tuple[object, object],
    alt: Callable[[object, object], str],
    labels: tuple[Callable[[object], str], Callable[[object], str]] = (str, str),
) -> FigureSlider:
    """Two sliders over a grid of precomputed figures (a stack of stacks).

    The first slider picks a row of the grid, the second a figure in every
    row, so both links run in the browser. Keep ``len(first) * len(second)``
    near a hundred at most.
    """
    rows, cols = _options(first, labels[0]), _options(second, labels[1])
    if len(rows) * len(cols) > MAX_FIGURES:
        raise ValueError(
            f"first x second must have at most {MAX_FIGURES} positions, got {len(rows) * len(cols)}"
        )
    outer = _slider(descriptions[0], rows, value[0])
    inner = _slider(descriptions[1], cols, value[1])
    row_stacks = []
    for _, a in rows:
        pages = [_page(make_figure(a, b), alt(a, b)) for _, b in cols]
        row_stack = widgets.Stack(pages, selected_index=inner.index)
        widgets.jslink((inner, "index"), (row_stack, "selected_index"))
        row_stacks.append(row_stack)
    grid = widgets.Stack(row_stacks, selected_index=outer.index)
    widgets.jslink((outer, "index"), (grid, "selected_index"))
    return FigureSlider([outer, inner, grid])
