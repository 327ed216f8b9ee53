"""quiz: check-yourself questions whose answers open without a kernel or scripts."""

import pytest

from trainscale.quiz import Choice, Question, quiz_html


def test_quiz_reveals_answers_without_scripts():
    question = Question(
        "Bytes per parameter?",
        (Choice("16", True, "2+2+4+4+4."), Choice("`8`", False, "Adam state is missing.")),
    )
    page = quiz_html([question])
    assert page.count("<details") == 2 and "<script" not in page
    assert "<code>8</code>" in page and "Correct." in page and "Not quite." in page


def test_question_needs_exactly_one_correct_choice():
    with pytest.raises(ValueError, match="exactly 1 correct"):
        Question("?", (Choice("a", True, ""), Choice("b", True, "")))
    with pytest.raises(ValueError, match="questions"):
        quiz_html([])
