"""tools/wordcount.py: the main-text word count behind each chapter's 3,000-word budget."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import wordcount

ROOT = Path(__file__).resolve().parents[1]

# Chapters whose main text is within the budget today, by name without the number (so
# renumbering the chapters keeps this list). A chapter brought under the budget joins
# it; none leaves it. The lead extends this list; the test holds every chapter on it.
WITHIN_BUDGET = {
    "one_training_step",
    "where_the_memory_goes",
    "data_parallelism",
    "collectives",
    "sharding_zero_fsdp",
    "tensor_parallelism",
    "pipeline_parallelism",
    "mixed_precision",
    "activation_checkpointing",
    "batch_size_and_learning_rate",
    "compute_budget",
    "measuring_efficiency",
    "planning_a_run",
    "context_parallelism",
    "expert_parallelism",
    "the_planned_run",
}

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _name(path: Path) -> str:
    """A notebook's name without its chapter number: 09_pipeline_parallelism -> pipeline..."""
    return re.sub(r"^\d+_", "", path.stem)


def test_plain_prose_counts_each_word_once():
    # "One", "step:", "forward,", "backward", "and", "the", "update." = 7; "—" is no word.
    assert wordcount.count_words("One step: forward, backward — and the update.") == 7


def test_headings_lists_and_tables_count_their_words_but_not_their_marks():
    # "Title" (1) + "first", "item" (2) + "a", "b" (2) + "1", "2" (2) = 7; "#", "-",
    # "|" and "---" hold no letter or digit.
    text = "# Title\n\n- first item\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert wordcount.count_words(text) == 7


def test_directives_and_code_listings_are_skipped_whole():
    text = (
        "Before it.\n"  # 2
        ":::{dropdown} How we checked it\nten words of checking that a reader opens on "
        "demand only\n:::\n"
        "```{admonition} Where this comes from\n:class: dropdown\nSources here.\n```\n"
        "```bash\npython -m trainscale.launch --nproc-per-node=8\n```\n"
        "After it.\n"  # 2
    )
    assert wordcount.count_words(text) == 4


def test_a_fence_closes_only_at_its_own_character_and_length():
    # The outer four-colon block holds a three-colon one and a backtick listing; a
    # shorter or other fence does not close it, so only "Out" and "here" count.
    text = "::::{margin}\n:::{note}\ninner\n:::\n```\ncode\n````\nstill inside\n::::\nOut here\n"
    assert wordcount.count_words(text) == 2


def test_an_unclosed_fence_runs_to_the_end_of_the_cell():
    assert wordcount.count_words("Two words\n```{note}\nnever closed, all skipped\n") == 2


def test_inline_math_is_one_word_and_display_math_none():
    # "The", "bubble", "is", formula, "here" = 5; the display formula adds nothing.
    text = "The bubble is $\\frac{K-1}{M+K-1}$ here\n\n$$\nT^* = \\frac{N-1}{N}\n$$\n"
    assert wordcount.count_words(text) == 5


def test_a_dollar_amount_is_not_math():
    # "It", "costs", "$5", "and", "$7", "a", "day" = 7: no closing dollar sign follows
    # "$5 " (the text after it starts with a space), so nothing is taken as math.
    assert wordcount.count_words("It costs $5 and $7 a day") == 7


def test_html_details_and_comments_are_skipped():
    text = "Shown.\n<details><summary>Answer</summary>\nhidden words\n</details>\n<!-- a note -->"
    assert wordcount.count_words(text) == 1


def test_hidden_cells_and_code_cells_are_not_counted(tmp_path):
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["One two\n", "three"]},
        {"cell_type": "markdown", "metadata": {"tags": ["remove-cell"]}, "source": "gone"},
        {"cell_type": "code", "metadata": {}, "source": "print('not prose')", "outputs": []},
        {"cell_type": "markdown", "metadata": {}, "source": "four"},
    ]
    path = tmp_path / "01_x.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert wordcount.notebook_words(path) == 4


def test_the_report_names_each_chapter_and_its_verdict(tmp_path):
    path = tmp_path / "03_long.ipynb"
    words = " ".join(["word"] * (wordcount.BUDGET + 5))
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": words}]}))
    assert "03_long" in wordcount.report([path])
    assert "over by 5" in wordcount.report([path])


def test_the_ratchet_names_only_chapters_that_exist():
    assert {_name(path) for path in NOTEBOOKS} >= WITHIN_BUDGET


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_main_text_words_per_chapter(path, record_property):
    """Every chapter's count is reported (pytest -rA, or the junit property); chapters
    on the ratchet list must stay within the budget."""
    words = wordcount.notebook_words(path)
    record_property("main_text_words", words)
    print(f"{path.stem}: {words:,} words of main text (budget {wordcount.BUDGET:,})")
    if _name(path) in WITHIN_BUDGET:
        assert words <= wordcount.BUDGET, (
            f"{path.stem} has {words:,} words of main text, over the budget of "
            f"{wordcount.BUDGET:,}: move sourcing and checks into asides or dropdowns"
        )
