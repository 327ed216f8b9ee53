"""Shared test settings: headless matplotlib and a fixed hypothesis profile."""

import matplotlib
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
