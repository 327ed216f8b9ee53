"""Every figure of the book, one function each, in one house style.

Each function takes numbers computed elsewhere in the package and returns a
matplotlib ``Figure`` (a :class:`~trainscale.figures.style.BookFigure`, which a
notebook shows as SVG); none computes results of its own, so what a figure
shows is what a cell printed. One module per chapter idea; the house style is
in :mod:`trainscale.figures.style`.
"""

from trainscale.figures.memory import activations_against_batch, memory_stack
from trainscale.figures.step import flop_bars, step_timeline
from trainscale.figures.style import PALETTE, STYLE, BookFigure, new_figure, svg_text

__all__ = [
    "PALETTE",
    "STYLE",
    "BookFigure",
    "activations_against_batch",
    "flop_bars",
    "memory_stack",
    "new_figure",
    "step_timeline",
    "svg_text",
]
