"""figures.style: every colour of the book's figures is named in one module."""

import re
from pathlib import Path

from trainscale.figures import style

FIGURES = Path(style.__file__).parent
HEX = re.compile(r"#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?(?:[0-9a-fA-F]{2})?\b")


def test_no_figure_module_but_style_writes_a_hex_colour():
    offenders = {
        path.name: HEX.findall(path.read_text())
        for path in FIGURES.glob("*.py")
        if path.name != "style.py" and HEX.search(path.read_text())
    }
    assert offenders == {}


def test_named_greys_keep_their_values():
    # The figures looked like this before the colours moved here; SVG outputs depend on it.
    assert (style.INK, style.MUTED_INK, style.LIGHT_GREY) == ("#333333", "#555555", "#dddddd")
    assert (style.PALE_GREY, style.EDGE_GREY) == ("#eeeeee", "#cccccc")
    assert (style.TABLE_HEADER, style.PARTIAL_GREY) == ("#f2f2f2", "#b8b8b8")
    assert style.STYLE["axes.edgecolor"] == style.INK
    assert style.STYLE["grid.color"] == style.LIGHT_GREY
