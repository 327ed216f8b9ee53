"""``python -m trainscale`` (``trainscale/__main__.py``): the headline numbers in a terminal.

Run as a reader runs it, in a subprocess; the printed numbers are pinned to
hand-worked values and to the package's own functions.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainscale import __main__ as summary
from trainscale import planner

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> str:
    """Stdout of ``python -m trainscale ARGS``, which must exit 0 and write no error."""
    done = subprocess.run(
        [sys.executable, "-m", "trainscale", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


@pytest.fixture(scope="module")
def printed() -> str:
    return run()


def block(text: str, chapter: str) -> str:
    """The block of ``text`` under the heading that starts with ``chapter`` ("09")."""
    match = re.search(rf"^{chapter} [^\n]+\n((?:  [^\n]*\n?)+)", text, re.M)
    assert match, f"no block for chapter {chapter}"
    return match.group(1)


@pytest.mark.parametrize(
    ("chapter", "expected"),
    [
        # 6 x 7e9 x (8 x 4 x 4096) = 5.505e15 FLOPs; / (8 x 1e15 x 0.4) = 1.720 s
        ("01", ["forward 2 + backward 4 = 6", "131,072 tokens: 5.51e+15 FLOPs, 1.72 s"]),
        # 2 + 2 + 4 + 4 + 4 bytes; 16 x 7e9 / 2**30 = 104.3 GiB, x 10 = 1,043.1 GiB
        ("02", ["= 16\n", "7B parameters 104.3 GiB, 70B parameters 1,043.1 GiB"]),
        # 2 (N-1)/N: 1 on 2, 1.75 on 8; 14 GB x 1.75 = 24.5 GB, / 100 GB/s = 0.245 s
        ("06", ["1 on 2, 1.75 on 8, 1.998 on 1,024", "24.5 GB sent per GPU, 0.245 s"]),
        # 16; 4 + 12/8 = 5.5; 2 + 14/8 = 3.75; 16/8 = 2
        ("07", ["DDP 16, ZeRO-1 5.5, ZeRO-2 3.75, ZeRO-3 / FSDP 2", "ZeRO-1 35.9 GiB"]),
        # 3/7 = 42.9 %, 3/15 = 20.0 %, interleaved 3/(2 x 8 + 3) = 15.8 %
        ("09", ["42.9% with 4 micro-batches, 20.0% with 12", "8 micro-batches: 15.8%"]),
        # 6 x 1e9 x 1e11 = 6e20; / (8 x 1e15 x 0.4) = 187,500 s = 2.17 days
        ("14", ["6ND = 6.0e+20 FLOPs, 187,500 s = 2.17 days"]),
        # 6 x 7e9 x 3000 / 312e12 = 40.4 %
        ("15", ["MFU 40.4%"]),
        # 1,024 sequences x 4,096 tokens = 4,194,304 tokens, Llama 2 70B's "4M tokens";
        # an "80 GB" H100 reports 81,559 MiB = 81,559 / 1,024 GiB = 79.65 GiB
        (
            "16",
            [
                "70B parameters on 8 nodes x 8 GPUs of 79.6 GiB, global batch 1,024 sequences"
                " (4,194,304 tokens)"
            ],
        ),
    ],
)
def test_headline_numbers_match_hand_worked_ones(
    printed: str, chapter: str, expected: list[str]
) -> None:
    text = block(printed, chapter)
    for phrase in expected:
        assert phrase in text


def test_planner_block_is_the_planners_own_pick(printed: str) -> None:
    layouts = planner.plan(
        planner.EXAMPLE_MODEL, planner.EXAMPLE_CLUSTER, planner.EXAMPLE_GLOBAL_BATCH
    )
    best = planner.top_layouts(layouts, count=summary.TOP_LAYOUTS)
    shown = [line.strip() for line in block(printed, "16").splitlines()[1:]]
    assert len(shown) == len(best) == summary.TOP_LAYOUTS
    for line, layout in zip(shown, best, strict=True):
        assert line.startswith(f"{layout.name}, {layout.settings}: step ")
        assert f"MFU {layout.mfu:.1%}" in line
    assert f"{len(layouts):,} layouts, {planner.verdict_counts(layouts)['fits']} fit" in printed


def test_every_chapter_block_is_labelled_in_order(printed: str) -> None:
    headings = re.findall(r"^(\d\d) ", printed, re.M)
    assert headings == ["01", "02", "06", "07", "09", "14", "15", "16"]
    assert printed.splitlines()[0].endswith(f"(trainscale {summary.__version__})")


def exit_output(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``main(args)`` for arguments that end the program."""
    with pytest.raises(SystemExit) as stopped:
        summary.main(args)
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def test_help_lists_the_packages_command_lines(capsys: pytest.CaptureFixture[str]) -> None:
    status, text, _ = exit_output(["--help"], capsys)
    assert status == 0
    assert text.startswith("usage: python -m trainscale")
    for command in (
        "python -m trainscale\n",
        "python -m trainscale.planner",
        "python -m trainscale.efficiency",
        "-m trainscale.train",
        "-m trainscale.workers.NAME",
    ):
        assert command in text
    for name in ("data_parallel", "collectives", "sharding", "tensor_parallel", "pipeline"):
        assert name in text
        assert (ROOT / "src" / "trainscale" / "workers" / f"{name}.py").exists()


@pytest.mark.parametrize("module", ["planner", "efficiency", "train"])
def test_help_says_planned_exactly_for_command_lines_that_do_not_exist_yet(module: str) -> None:
    path = ROOT / "src" / "trainscale" / f"{module}.py"
    if not path.exists():  # a package (the planner): its __main__.py
        path = ROOT / "src" / "trainscale" / module / "__main__.py"
    source = path.read_text()
    has_main = 'if __name__ == "__main__":' in source
    entry = re.search(rf"trainscale\.{module}\b.*\n((?:      .*\n)+)", summary.COMMANDS)
    assert entry, f"--help does not describe trainscale.{module}"
    assert ("(planned" in entry.group(1)) == (not has_main)


def test_the_planners_example_in_help_is_a_command_it_takes() -> None:
    from trainscale.planner import cli as planner_cli

    entry = re.search(r"python -m trainscale\.planner (.*)\n", summary.COMMANDS)
    assert entry, "--help shows no example of the planner's command line"
    argv = entry.group(1).replace("[", "").replace("]", "").split()
    assert planner_cli.parse(argv).laptop == 8


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    status, text, _ = exit_output(["--version"], capsys)
    assert (status, text.strip()) == (0, f"trainscale {summary.__version__}")


def test_unknown_argument_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = exit_output(["--no-such-flag"], capsys)
    assert status == 2
    assert "unrecognized arguments: --no-such-flag" in err
