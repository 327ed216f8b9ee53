"""Markup that assistive technology reads right, where the site's tools write it wrong.

Two fixes, each drawing the same HTML as the tool it replaces, less the fault
(axe-core's rule in brackets; ``tests/browser/test_site.py`` runs axe on every page):

**Collapsed code cells** [``label-content-name-mismatch``, serious]. myst-nb 1.4
(``myst_nb.sphinx_.visit_HideCellInput``) writes each ``hide-input`` cell as
``<details><summary aria-label="Toggle hidden content">`` around the visible text "Show
code cell source". The label replaces that text for screen readers, so the control a
sighted reader sees as "Show code cell source" is announced, and reached by voice, only
as "Toggle hidden content" (WCAG 2.5.3). The summary is drawn here without the label,
named by the text it shows; everything else is myst-nb's own.

**The bibliography** [``aria-required-children``, critical]. docutils 0.21
(``_html_base.HTMLTranslator.visit_citation``) wraps the references in
``<div role="list">`` and gives each entry DPub-ARIA's ``role="doc-biblioentry"``, which
ARIA 1.2 no longer counts as a list item (DPub-ARIA 1.1 deprecates it): a screen reader
meets a list with no items. Each entry is a ``role="listitem"`` here.
"""

from __future__ import annotations

from html import escape
from typing import Any

from docutils import nodes
from myst_nb.sphinx_ import HideCodeCellNode, depart_HideCellInput
from sphinx.application import Sphinx


def visit_hide_cell_input(self: Any, node: HideCodeCellNode) -> None:
    """myst-nb's ``visit_HideCellInput``, with a ``<summary>`` named by its own text."""
    classes = " ".join(node["classes"])
    self.body.append(f'<details class="admonition hide {classes}">\n')
    self.body.append("<summary>\n")
    self.body.append(f'<p class="collapsed admonition-title">{escape(node["prompt_show"])}</p>\n')
    self.body.append(f'<p class="expanded admonition-title">{escape(node["prompt_hide"])}</p>\n')
    self.body.append("</summary>\n")


def visit_citation(self: Any, node: nodes.citation) -> None:
    """docutils' ``visit_citation``, each entry a list item of the citation list."""
    if not isinstance(node.previous_sibling(), type(node)):
        self.body.append('<div role="list" class="citation-list">\n')
    self.body.append(self.starttag(node, "div", classes=[node.tagname], role="listitem"))


def depart_citation(self: Any, node: nodes.citation) -> None:
    """docutils' ``depart_citation``: closes the entry, and the list after its last one."""
    self.body.append("</div>\n")
    if not isinstance(node.next_node(descend=False, siblings=True), type(node)):
        self.body.append("</div>\n")


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("myst_nb")
    app.add_node(
        HideCodeCellNode, override=True, html=(visit_hide_cell_input, depart_HideCellInput)
    )
    app.add_node(nodes.citation, override=True, html=(visit_citation, depart_citation))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
