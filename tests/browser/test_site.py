"""Open every page of the built site in a real browser, as a reader would.

Each page must load with no failed request, no request to another site, and no
console error of ours; its math must be typeset, its images must load, axe-core must
find nothing serious or critical on it, it must link to the back matter, and every
slider must change the figure it drives, with no kernel behind the page.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import axe
import pytest
import yaml
from conftest import ROOT, SITE
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

# Console messages that are not ours and do no harm, each with where it comes from.
KNOWN_NOISE = (
    # pydata-sphinx-theme, on a first visit with no saved light/dark preference.
    "Got invalid theme mode",
    # sphinx-thebe's script is included twice by Jupyter Book's launch buttons.
    "Identifier 'THEBE_JS_URL' has already been declared",
    # The widget manager calls MathJax 2's MathJax.Hub.Queue; the site runs MathJax 3.
    "MathJax.Hub",
    # The vendored html-manager 1.0.x now and then hands a Lumino message to a view it has
    # already detached, when a Stack's page changes under a loaded machine (1 full browser
    # run in about 5 here); the figure still changes, which
    # _check_sliders asserts. Upstream's message handling there: ipywidgets PR #3536.
    "(reading 'processLuminoMessage')",
)
SCREENSHOTS = ROOT / "screenshots"
MAX_PAGE_BYTES = 4 * 2**20  # raw HTML of one page, widgets' precomputed figures included


def _toc_pages() -> list[str]:
    """Every page of the table of contents, as a path of the built site."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return [f"{name}.html" for name in files]


PAGES = _toc_pages()


def _is_chapter(path: str) -> bool:
    """A numbered chapter (notebooks/NN_name.html), not an appendix (notebooks/a1_...)."""
    return re.match(r"notebooks/\d+_", path) is not None


# The back matter every page links to (from the table of contents in its sidebar).
BACK_MATTER = [p for p in PAGES if p.startswith("book/") and p != "book/intro.html"]

# Pages on which axe also checks colours (axe.COLOUR_RULES, the slow part of its run): every
# page that is not a chapter, and the first chapter, which shows everything a chapter
# styles (code, outputs, a collapsed cell, a slider, a quiz). AXE_EVERY_RULE=1 checks
# colours on every page (about 4 CPU seconds more per chapter).
COLOUR_PAGES = {p for p in PAGES if not p.startswith("notebooks/")} | {
    next(p for p in PAGES if _is_chapter(p))
}


@dataclass
class Visit:
    """What happened while a page loaded."""

    failed: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _open(browser, url: str, base: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    visit = Visit()
    page.on("requestfailed", lambda r: visit.failed.append(f"{r.url} ({r.failure})"))
    page.on(
        "response",
        lambda r: visit.failed.append(f"{r.url} ({r.status})") if r.status >= 400 else None,
    )
    page.on(
        "request",
        lambda r: (
            visit.external.append(r.url)
            if not r.url.startswith((base, "data:", "blob:", "about:"))
            else None
        ),
    )

    def error(text: str) -> None:
        if not any(noise in text for noise in KNOWN_NOISE):
            visit.errors.append(text)

    page.on("console", lambda m: error(f"{m.text} at {m.location}") if m.type == "error" else None)
    page.on("pageerror", lambda e: error(str(e)))
    page.goto(url, wait_until="networkidle")
    return page, visit


def _visible_figure(slider_box) -> str:
    """The accessible label and drawing of the figure a widget shows right now."""
    return slider_box.evaluate(
        """box => {
            const shown = Array.from(box.querySelectorAll('svg[role="img"]'))
                .filter(svg => svg.getClientRects().length > 0);
            return shown.map(s => s.getAttribute('aria-label') + s.innerHTML.length).join('|');
        }"""
    )


def _settle(page) -> None:
    """Wait for MathJax's first typesetting (its startup promise) and for every slider's
    widget to show its figure: the two things that finish after the page's load."""
    page.wait_for_function(
        "() => !window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)"
    )
    page.evaluate("() => window.MathJax && window.MathJax.startup.promise.then(() => true)")
    page.wait_for_function(
        """() => Array.from(document.querySelectorAll('.widget-vbox:has(> .widget-slider)'))
            .every(box => Array.from(box.querySelectorAll('svg[role="img"]'))
                .some(svg => svg.getClientRects().length > 0))""",
        timeout=15_000,
    )


def _check_loaded(page, visit: Visit) -> None:
    """No failed or outside request, no console error of ours, images and math rendered."""
    assert visit.failed == [], "failed requests"
    assert visit.external == [], "requests to other sites"
    assert visit.errors == [], "console errors"
    broken = page.evaluate(
        "() => Array.from(document.images)"
        ".filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
    )
    assert broken == [], "images that did not load"
    math = page.locator("span.math, div.math").count()
    typeset = page.locator("mjx-container").count()
    assert typeset >= math, f"{math} formulas on the page, {typeset} typeset"


def _check_sliders(page) -> None:
    """Every slider, moved with the keyboard (End, Home, ArrowRight), changes its figure."""
    page.wait_for_selector('[role="slider"]', timeout=15_000)
    boxes = page.locator(".widget-vbox:has(> .widget-slider)")
    assert boxes.count() >= 1, "every chapter has at least one widget"
    for b in range(boxes.count()):
        box = boxes.nth(b)
        handles = box.locator('[role="slider"]')
        for h in range(handles.count()):
            handle = handles.nth(h)
            name = handle.get_attribute("aria-label")
            assert name, "every slider has an accessible name"
            before = _visible_figure(box)
            assert before, f"widget {b} shows no figure"
            handle.focus()
            handle.press("End")
            end = _visible_figure(box)
            handle.press("Home")
            home = _visible_figure(box)
            assert end != home, f"slider '{name}' did not change the figure"
            handle.press("ArrowRight")
            assert _visible_figure(box) != home, f"arrow key on '{name}' changed nothing"


# Code blocks and outputs too wide for the column, which the theme has not yet made
# reachable by keyboard (it gives each a tab stop 0.3 s after the page last changes).
_UNREACHABLE_SCROLLERS = """() => Array.from(document.querySelectorAll(
        'pre, .cell_output > .output, .jp-RenderedHTMLCommon, .pst-scrollable-table-container'))
    .filter(el => el.getClientRects().length > 0 && el.tabIndex !== 0
        && (el.scrollWidth > el.clientWidth || el.scrollHeight > el.clientHeight)).length"""


def _check_back_matter_linked(page, path: str) -> None:
    """The page's navigation links to every other back-matter page: cheat sheet,
    glossary, notation, running on a CPU, references."""
    linked = page.evaluate(
        "() => Array.from(document.querySelectorAll('nav a[href]')).map(a => a.href)"
    )
    base = page.url.rsplit("/", path.count("/") + 1)[0]
    missing = [p for p in BACK_MATTER if p != path and f"{base}/{p}" not in linked]
    assert missing == [], f"{path} does not link to the back matter"


def _check_accessible(page, path: str) -> None:
    """axe-core finds no serious or critical violation on the page as it is shown, once
    the theme has caught up with the last change to the page (or 5 s have passed)."""
    with contextlib.suppress(PlaywrightTimeout):  # if not, axe names them below
        page.wait_for_function(f"() => ({_UNREACHABLE_SCROLLERS})() === 0", timeout=5_000)
    colour = path in COLOUR_PAGES or os.environ.get("AXE_EVERY_RULE") == "1"
    blocking = axe.blocking(axe.violations(page, colour=colour))
    assert blocking == [], "accessibility violations (axe-core):\n" + axe.describe(blocking)


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_from_this_site_and_its_sliders_work_without_a_kernel(browser, site_url, path):
    """One visit per page: everything loads from this site, axe-core finds nothing
    serious, the back matter is linked, then every slider is moved."""
    page, visit = _open(browser, f"{site_url}/{path}", site_url)
    try:
        _settle(page)
        _check_loaded(page, visit)
        _check_accessible(page, path)
        _check_back_matter_linked(page, path)
        if path.startswith("notebooks/"):
            SCREENSHOTS.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / f"{Path(path).stem}.png"))
        if _is_chapter(path):  # every chapter has a slider; an appendix need not
            _check_sliders(page)
            assert visit.errors == [], "console errors after moving the sliders"
    finally:
        page.close()


def test_page_weights_stay_light():
    """Each page's weight, raw and gzipped, written to _build/page-weights.txt."""
    lines = ["page                                          raw KiB   gzip KiB"]
    for path in PAGES:
        raw = (SITE / path).read_bytes()
        packed = gzip.compress(raw, compresslevel=6)
        lines.append(f"{path:44s} {len(raw) / 1024:8.0f} {len(packed) / 1024:9.0f}")
        assert len(raw) < MAX_PAGE_BYTES, f"{path} weighs {len(raw):,} bytes"
    report = "\n".join(lines)
    (SITE.parent / "page-weights.txt").write_text(report + "\n")
    print(report)


@pytest.mark.parametrize("path", [p for p in PAGES if _is_chapter(p)][:1])
def test_quiz_keeps_a_running_score_and_hides_its_answer_key(browser, site_url, path):
    """Where scripts run, the first answer opened per question counts; the quiz cell's
    source (every choice with True/False beside it) is not on the page at all."""
    page, visit = _open(browser, f"{site_url}/{path}", site_url)
    try:
        assert "Choice(" not in page.content(), "the quiz's answer key is on the page"
        quiz = page.locator("ol.trainscale-quiz")
        score = page.locator("p.trainscale-quiz-score")
        questions = quiz.locator(":scope > li")
        total = questions.count()
        assert total >= 2
        assert score.inner_text() == f"0 of {total} answered correctly ({total} to go)"
        # a <details> element's toggle event, which updates the score, is queued: wait for it
        questions.nth(0).locator("details.right > summary").click()
        expect(score).to_have_text(re.compile(rf"^1 of {total} answered correctly"))
        questions.nth(1).locator("details.wrong > summary").first.click()
        questions.nth(1).locator("details.right > summary").click()  # a second try: no credit
        expect(score).to_have_text(
            f"1 of {total} answered correctly" + (f" ({total - 2} to go)" if total > 2 else "")
        )
        assert visit.errors == [], "console errors"
    finally:
        page.close()


def test_axe_reports_what_a_reader_would_trip_over(browser):
    """The checker itself: on a page with three known faults it names each, with its
    nodes, and leaves out the colour rule when told to."""
    page = browser.new_page()
    try:
        page.set_content(
            '<html lang="en"><head><title>t</title></head><body><main>'
            '<img src="data:image/gif;base64,R0lGODlhAQABAAAAACw=">'  # no alt: critical
            '<button aria-label="Close">Open the menu</button>'  # name hides its text
            '<p style="color:#bbb;background:#fff">faint text</p>'  # contrast 1.9: serious
            "</main></body></html>"
        )
        found = axe.blocking(axe.violations(page))
        assert {v["id"] for v in found} == {
            "image-alt",
            "label-content-name-mismatch",
            "color-contrast",
        }
        report = axe.describe(found)
        assert "image-alt (critical, 1 nodes)" in report
        assert "Open the menu" in report
        without_colour = axe.blocking(axe.violations(page, colour=False))
        assert {v["id"] for v in without_colour} == {"image-alt", "label-content-name-mismatch"}
    finally:
        page.close()
