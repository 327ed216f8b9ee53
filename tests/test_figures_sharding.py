"""figures.sharding: ZeRO's memory bars and the FSDP timeline of chapter 05."""

import pytest

from trainscale import figures
from trainscale.sharding import fsdp_moments


def test_figures_draw():
    parts = {"weights": 1.0, "gradients": 1.0, "optimiser state": 6.0}
    fig = figures.zero_stage_bars({"DDP": parts, "ZeRO-1": parts}, 74.5, "test")
    assert len(fig.axes[0].patches) == 6
    fig = figures.fsdp_timeline(fsdp_moments(3), ["a", "b", "c"], upto=2)
    assert fig.axes[0].get_title().startswith("One FSDP step")
    with pytest.raises(ValueError, match="upto"):
        figures.fsdp_timeline(fsdp_moments(3), ["a", "b", "c"], upto=7)
