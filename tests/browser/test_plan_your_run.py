"""The "Plan your run" page on the built site, offline, in headless Chromium.

The page runs ``trainscale.planner`` under Pyodide in a Web Worker. Here: it loads with
every request served by this site (anything else is refused and counted), the default plan
appears, a changed input changes the plan and the address, a bad input gets the command
line's message beside its field, and the page's plan for each model preset is what
``python -m trainscale.planner --json`` gives for the same flags.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlparse

import pytest
from conftest import ROOT

from trainscale.planner import cli

PAGE = "book/plan_your_run.html"
SCREENSHOTS = ROOT / "screenshots"
DONE = "() => ['done', 'error'].includes(document.getElementById('plan-app').dataset.state)"
PLAN_TIMEOUT = 240_000  # ms: Pyodide's start and a plan, on a loaded 2-core machine
KNOWN_NOISE = ("Got invalid theme mode", "Identifier 'THEBE_JS_URL' has already been declared")
PRESETS = ["70b", *cli.MODEL_PRESETS, "gpt-22b-on-8-a100s-selective-recompute"]
"""The model presets (the book's example and the model shapes), and one published run."""


class Visit:
    """A page of the site in Chromium, with every request that would leave it refused."""

    def __init__(self, browser, base: str, path: str):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.external: list[str] = []
        self.failed: list[str] = []
        self.errors: list[str] = []
        page = self.page
        page.route(lambda url: not url.startswith(base), self._refuse)
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url} ({r.failure})"))
        page.on("response", lambda r: r.status >= 400 and self.failed.append(r.url))
        page.on("console", lambda m: m.type == "error" and self._error(m.text))
        page.on("pageerror", lambda e: self._error(str(e)))
        page.goto(f"{base}/{path}")
        self.wait()

    def _refuse(self, route) -> None:
        self.external.append(route.request.url)
        route.abort()

    def _error(self, text: str) -> None:
        if not any(noise in text for noise in KNOWN_NOISE):
            self.errors.append(text)

    def wait(self) -> str:
        self.page.wait_for_function(DONE, timeout=PLAN_TIMEOUT)
        return self.page.evaluate("document.getElementById('plan-app').dataset.state")

    def best(self) -> list[str]:
        return self.page.locator(".plan-table .plan-pick").all_inner_texts()

    def plan(self, **fields: str) -> str:
        """Fill ``fields`` (flag names without ``--``, ``_`` for ``-``) and press Plan."""
        for name, value in fields.items():
            self.page.fill(f"#plan__{name}", value)
        self.page.click("#plan-go")
        return self.wait()

    def clean(self) -> None:
        assert self.external == [], "requests that would leave the site"
        assert self.failed == [], "failed requests"
        assert self.errors == [], "console errors"


@pytest.fixture(scope="module")
def visit(browser, site_url):
    seen = Visit(browser, site_url, PAGE)
    yield seen
    seen.page.close()


def test_the_page_plans_offline_and_answers_its_form(visit):
    page = visit.page
    assert page.evaluate("document.getElementById('plan-app').dataset.state") == "done"
    default = cli.plan_json(["--model", "70b"])
    assert visit.best() == [layout["name"] for layout in default["best"]]
    _same_plan(page.evaluate("window.planShown"), default, "the default plan")
    assert page.locator(".plan-command code").inner_text() == default["command"]["text"]
    assert page.locator(".plan-bar").count() == 2  # memory against capacity, step time
    report = page.locator(".plan-text code").text_content()
    assert default["text"][0] in report and default["command"]["text"] in report
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "plan_your_run.png"), full_page=True)

    # A changed input changes the plan, and the address carries it.
    assert visit.plan(nodes="2", global_batch="256") == "done"
    changed = cli.plan_json(["--model", "70b", "--nodes", "2", "--global-batch", "256"])
    assert visit.best() == [layout["name"] for layout in changed["best"]]
    assert changed["best"] != default["best"]
    query = parse_qs(urlparse(page.url).query)
    assert query == {"model": ["70b"], "nodes": ["2"], "global-batch": ["256"]}

    # A bad input: the command line's message, beside its field.
    assert visit.plan(nodes="0") == "error"
    expected = cli.plan_json(["--model", "70b", "--nodes", "0", "--global-batch", "256"])
    assert page.locator("#plan__nodes_error").inner_text() == expected["error"]
    assert page.get_attribute("#plan__nodes", "aria-invalid") == "true"

    # The address alone brings the plan back: a shared link.
    page.goto(page.url.split("?")[0] + "?model=llama-3-8b&nodes=2")
    assert visit.wait() == "done"
    assert page.input_value("#plan__nodes") == "2"
    again = cli.plan_json(["--model", "llama-3-8b", "--nodes", "2"])
    assert visit.best() == [layout["name"] for layout in again["best"]]
    visit.clean()


def _same(page: object, here: object, where: str = "") -> None:
    """``page`` equals ``here`` but for the last bits of floats: Pyodide's libm (musl)
    and this machine's (glibc) may round ``log``, ``exp`` and ``pow`` differently."""
    if isinstance(here, float) and isinstance(page, float):
        assert math.isclose(page, here, rel_tol=1e-12, abs_tol=1e-300), where
    elif isinstance(here, dict):
        assert isinstance(page, dict) and page.keys() == here.keys(), where
        for key in here:
            _same(page[key], here[key], f"{where}/{key}")
    elif isinstance(here, list):
        assert isinstance(page, list) and len(page) == len(here), where
        for i, (a, b) in enumerate(zip(page, here, strict=True)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert page == here, where


def _same_plan(page: dict, here: dict, name: str) -> None:
    """The page's plan is the command line's (:func:`_same`), but for trainscale.train's
    own argument checks, which need torch: on the page the command is the first layout
    the capstone's stack holds (that check needs no torch), unchecked, with a note
    saying so; the command line runs the argument checks too."""
    page, here = json.loads(json.dumps(page)), json.loads(json.dumps(here))
    place = page["command"]["layout"]
    unchecked = cli.UNCHECKED.format(place=place)
    assert page["command"].pop("checked") is False
    assert page["notes"][-1] == unchecked
    if here["command"]["layout"] != place:  # the capstone refuses it: the page cannot know
        for key in ("command", "notes", "text", "fits"):
            page.pop(key), here.pop(key, None)
    else:
        assert page.pop("notes")[:-1] == here["notes"]
        here["command"].pop("checked")
        at = page["text"].index(f"note: {unchecked}")
        page["text"][at : at + (1 if here.pop("notes") else 2)] = []  # and its blank line
    _same(page, here, name)


NARROW = ["--virtual-stages", "1", "--context-parallel", "1"]
"""Each preset is compared with the search narrowed to one interleaving depth and no
context parallelism, to keep the test short; the 70B example's default plan is compared
whole above."""


def test_the_page_s_plan_is_the_command_line_s_for_each_model_preset(visit):
    argvs = [["--model", name, *NARROW] for name in PRESETS]
    with ThreadPoolExecutor(1) as pool:  # this process plans while the page's worker does
        ours = pool.submit(lambda: [cli.plan_json(argv) for argv in argvs])
        pages = visit.page.evaluate("all => Promise.all(all.map(window.planWith))", argvs)
        heres = ours.result()
    for name, page, here in zip(PRESETS, pages, heres, strict=True):
        _same_plan(page, here, name)
    visit.clean()
