"""axe-core, the accessibility checker, run inside a page the browser tests have open.

axe-core is committed under ``vendor/`` (from the npm registry, ``tools/vendor_axe.sh``),
so the tests need no npm and the site never loads it. It checks the page as rendered,
after scripts ran: the widgets' sliders and figures, MathJax, the theme's buttons.
"""

from __future__ import annotations

from pathlib import Path

AXE_SCRIPT = Path(__file__).resolve().parent / "vendor" / "axe.min.js"
BLOCKING = ("serious", "critical")
"""Impacts a page may not have: a reader who relies on them cannot use the control."""

COLOUR_RULES = ("color-contrast", "link-in-text-block")
"""The rules that compute the colours of text on its background: most of axe's time on a
chapter page (it maps every element's stacking and background first), and the same
answer on every page, since colours come from the theme's stylesheet and the package's
HTML (quiz, sliders), not from the chapter. The tests run them on a few pages."""

_RUN = """skip => axe.run(document, {
        resultTypes: ["violations"],
        rules: Object.fromEntries(skip.map(id => [id, {enabled: false}])),
    }).then(result =>
    result.violations.map(v => ({
        id: v.id, impact: v.impact, help: v.help, helpUrl: v.helpUrl,
        nodes: v.nodes.map(n => ({target: n.target.join(" "), html: n.html,
                                  summary: n.failureSummary})),
    })))"""


def violations(page, *, colour: bool = True) -> list[dict]:
    """axe's violations on ``page``, every impact, with each failing node; without the
    colour rules (``COLOUR_RULES``) if ``colour`` is false."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.add_script_tag(path=str(AXE_SCRIPT))
    return page.evaluate(_RUN, [] if colour else list(COLOUR_RULES))


def blocking(found: list[dict]) -> list[dict]:
    """The violations of serious or critical impact."""
    return [v for v in found if v["impact"] in BLOCKING]


def describe(found: list[dict], nodes_per_rule: int = 5) -> str:
    """A readable account: each rule, its impact and help, then its failing nodes."""
    lines: list[str] = []
    for v in found:
        lines.append(f"{v['id']} ({v['impact']}, {len(v['nodes'])} nodes): {v['help']}")
        for node in v["nodes"][:nodes_per_rule]:
            html = " ".join(node["html"].split())
            lines.append(f"    {node['target']}: {html[:160]}")
        if len(v["nodes"]) > nodes_per_rule:
            lines.append(f"    ... and {len(v['nodes']) - nodes_per_rule} more")
    return "\n".join(lines)
