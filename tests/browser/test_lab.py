"""Open a chapter in JupyterLab, run it all, and move a slider, as a reader would.

JupyterLab serves a temporary copy of the notebook (so autosave never touches the
committed one) on 127.0.0.1, with a random token, and is stopped with its kernels
at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT
from playwright.sync_api import TimeoutError as PlaywrightTimeout

CHAPTER = "01_one_training_step.ipynb"
RUN_ALL_SECONDS = 240  # the chapter runs in well under a minute on 2 quiet cores


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def lab(tmp_path: Path):
    """A JupyterLab server on 127.0.0.1 over a copy of one chapter: yields its URL."""
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / CHAPTER, root / CHAPTER)
    port, token = _free_port(), secrets.token_hex(16)
    jupyter = Path(sys.executable).with_name("jupyter")
    server = subprocess.Popen(
        [
            str(jupyter),
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--allow-root",  # CI runs as root
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # one process group: the server and its kernels
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config")},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start")
                time.sleep(0.5)
        yield f"{base}/lab/tree/{CHAPTER}?token={token}"
    finally:
        _stop_group(server)


def _stop_group(server: subprocess.Popen) -> None:
    """Stop the server and every kernel it started (they share its process group)."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(20)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


KERNEL_IDLE = '.jp-Notebook-ExecutionIndicator[data-status="idle"]'
STARTED = """() => Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
    .some(prompt => /\\[(\\*|\\d+)\\]/.test(prompt.textContent))"""
"""Whether any cell is queued, running or done: its prompt reads [*] or [n]."""


def _run_all(page) -> None:
    """Run All Cells from the menu, again if no cell started within 30 s: a fresh
    environment's first kernel can take a while to connect, and a Run All sent
    before then is lost."""
    for attempt in range(3):
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            page.wait_for_function(STARTED, timeout=30_000)
            return
        except PlaywrightTimeout:
            if attempt == 2:
                raise
            page.keyboard.press("Escape")  # close the menu if it is still open


def test_run_all_then_move_a_slider(browser, lab):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(lab, wait_until="domcontentloaded")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        page.locator(".jp-Notebook").first.click()  # focus the notebook, not the file browser
        with contextlib.suppress(PlaywrightTimeout):  # _run_all tries again if it was not
            page.wait_for_selector(KERNEL_IDLE, timeout=60_000)
        _run_all(page)
        # The quiz is the last cell: its answers appear when the run has finished.
        page.wait_for_selector(".jp-OutputArea-output details", timeout=RUN_ALL_SECONDS * 1000)
        errors = page.locator(".jp-OutputArea-output[data-mime-type*='error']").count()
        assert errors == 0, "a cell raised an error"
        handle = page.locator('.jp-OutputArea [role="slider"]').last
        handle.scroll_into_view_if_needed()

        def shown() -> str:
            return page.evaluate(
                """() => Array.from(document.querySelectorAll('.jp-OutputArea svg[role="img"]'))
                    .filter(s => s.getClientRects().length > 0)
                    .map(s => s.getAttribute('aria-label')).join('|')"""
            )

        before = shown()
        handle.focus()
        handle.press("Home")
        after = shown()
        assert before and after and before != after, "moving the slider changed nothing"
        (ROOT / "screenshots").mkdir(exist_ok=True)
        page.screenshot(path=str(ROOT / "screenshots" / "jupyterlab.png"))
    except Exception:  # what the page showed when it failed, for the person reading CI
        (ROOT / "screenshots").mkdir(exist_ok=True)
        page.screenshot(path=str(ROOT / "screenshots" / "jupyterlab-failed.png"))
        raise
    finally:
        page.close()
