"""tools/plan_page.py and the "Plan your run" page's contract with the command line.

No network here: the Pyodide download's check is tried on bytes made up for it. The page
itself runs in tests/browser/test_plan_your_run.py.
"""

from __future__ import annotations

import importlib.util
import re
import zipfile
from pathlib import Path

import pytest

from trainscale.figures.style import MEMORY_COLOURS, TIME_COLOURS
from trainscale.planner import arguments

ROOT = Path(__file__).resolve().parents[1]
PAGE_JS = (ROOT / "book" / "_extra" / "plan" / "page.js").read_text()
_spec = importlib.util.spec_from_file_location("plan_page", ROOT / "tools" / "plan_page.py")
plan_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_page)  # type: ignore[union-attr]


def test_the_page_ships_the_planner_s_own_files_and_none_that_need_torch():
    files = plan_page.planner_files()
    package = ROOT / "src" / "trainscale"
    names = {f.relative_to(package).as_posix() for f in files}
    assert {"planner/cli.py", "planner/search.py", "memory.py", "data/published_runs.json"} <= names
    # Modules that run tensors, draw figures or train stay out.
    assert not names & {"train.py", "transformer.py", "experts.py", "precision.py"}
    assert not any(name.startswith(("figures/", "workers/")) for name in names)


def test_the_planner_s_zip_is_the_same_for_the_same_tree(tmp_path):
    first = plan_page.pack_planner(tmp_path / "a.zip").read_bytes()
    second = plan_page.pack_planner(tmp_path / "b.zip").read_bytes()
    assert first == second
    with zipfile.ZipFile(tmp_path / "a.zip") as archive:
        assert "trainscale/planner/cli.py" in archive.namelist()
        source = archive.read("trainscale/planner/cli.py")
    assert source == (ROOT / "src" / "trainscale" / "planner" / "cli.py").read_bytes()


def test_a_tarball_that_is_not_the_registry_s_is_refused():
    with pytest.raises(SystemExit, match="sha512"):
        plan_page._check(b"not pyodide")


def test_every_field_of_the_form_is_a_flag_of_the_command_line():
    fields = re.findall(r'^\s*\["(--[a-z-]+)", "', PAGE_JS, flags=re.MULTILINE)
    assert len(fields) >= 15
    flags = {option for action in arguments.parser()._actions for option in action.option_strings}
    assert set(fields) <= flags
    assert {"--no-gated-mlp"} <= flags  # the form's unticked checkbox on your own shape


def test_the_page_colours_each_part_as_the_book_s_figures_do():
    colours = dict(re.findall(r'"([a-z -]+)": "(#[0-9A-Fa-f]{6})"', PAGE_JS))
    for part, colour in {**MEMORY_COLOURS, **TIME_COLOURS}.items():
        assert colours[part].lower() == colour.lower(), part


def test_without_the_registry_the_build_says_what_it_needs(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(plan_page.urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit, match=r"could not fetch .*npm registry"):
        plan_page.fetch_pyodide(tmp_path / "pyodide")
