"""A served copy of the built site and a headless Chromium, for tests a reader would do.

These tests run after the site is built (``make test`` builds it first). They use
the system's Chromium (Debian's ``chromium``; ``make test`` installs it where
missing) through Playwright, which downloads no browser of its own.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "_build" / "html"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium phones home at start-up; on a closed network those
    # requests fail, and offline readers do not want them either.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    """The system Chromium, or a test failure that says how to get one."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no Chromium found: install Debian's 'chromium' package (make test does)")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output readable
        pass


@pytest.fixture(scope="session")
def site_url() -> Iterator[str]:
    """The built site served on 127.0.0.1, on a port the OS picks."""
    if not (SITE / "index.html").exists():
        pytest.fail(f"{SITE} has no index.html: build the site first (make site-check)")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(
                executable_path=chromium_path(), args=CHROMIUM_ARGS
            )
        except Exception as error:  # any start-up failure becomes a clear reason
            pytest.fail(f"Chromium could not start: {error}")
        yield chromium
        chromium.close()
