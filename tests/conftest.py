"""Shared test settings: headless matplotlib and a fixed hypothesis profile."""

from pathlib import Path

import matplotlib
import pytest
from hypothesis import HealthCheck, settings

# Draw without a screen in this process only; an environment variable would
# leak into nbval's kernels and change how notebooks display figures.
matplotlib.use("Agg")

# Deterministic, bounded property tests: the same examples on every run and machine.
settings.register_profile(
    "book",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("book")


BROWSER_TESTS = Path(__file__).resolve().parent / "browser"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the browser tests ``browser``: they need a built site and Chromium, so a
    plain ``pytest`` deselects them (``addopts`` in pyproject.toml) and ``make browser``
    selects them with ``-m browser``."""
    for item in items:
        if BROWSER_TESTS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.browser)
