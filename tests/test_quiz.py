"""quiz: check-yourself questions whose answers open without a kernel; a score where scripts run."""

import re
from collections import Counter

import pytest

from trainscale.quiz import LETTERS, Choice, Question, correct_letters, quiz_html


def _question(prompt: str, choices: int = 3) -> Question:
    return Question(
        prompt,
        tuple(Choice(f"choice {k}", k == 0, f"because {k}") for k in range(choices)),
    )


def test_quiz_reveals_answers_without_scripts():
    question = Question(
        "Bytes per parameter?",
        (Choice("16", True, "2+2+4+4+4."), Choice("`8`", False, "Adam state is missing.")),
    )
    page = quiz_html([question])
    assert page.count("<details") == 2
    assert "<code>8</code>" in page and "Correct." in page and "Not quite." in page
    # the score line is hidden until the script runs, so without scripts nothing is missing
    assert '<p class="trainscale-quiz-score" aria-live="polite" hidden></p>' in page


def test_each_question_has_its_own_seeded_order_the_same_on_every_run():
    questions = [_question(f"question {n}?", 4) for n in range(40)]
    first = quiz_html(questions)
    assert quiz_html(questions) == first
    letters = correct_letters(questions)
    assert len(letters) == 40 and set(letters) <= set("ABCD")
    # written with the correct answer first, it no longer always comes first
    counts = Counter(letters)
    assert max(counts.values()) <= 20, counts
    shown = re.findall(r'<details class="(right|wrong)"[^>]*><summary>([A-H])\.', first)
    assert "".join(letter for kind, letter in shown if kind == "right") == letters


def test_shuffling_keeps_every_choice_once():
    question = _question("which?", 5)
    assert sorted(question.shuffled(), key=lambda c: c.text) == list(question.choices)


def test_the_score_script_counts_first_answers_only():
    page = quiz_html([_question("q?")])
    script = page[page.index("<script>") :]
    assert 'hasAttribute("data-answered")' in script  # a second answer does not count
    assert 'classList.contains("right")' in script


def test_question_needs_exactly_one_correct_choice():
    with pytest.raises(ValueError, match="exactly 1 correct"):
        Question("?", (Choice("a", True, ""), Choice("b", True, "")))
    with pytest.raises(ValueError, match="choices must hold 2 to 8"):
        Question("?", tuple(Choice(str(k), k == 0, "") for k in range(len(LETTERS) + 1)))
    with pytest.raises(ValueError, match="questions"):
        quiz_html([])
