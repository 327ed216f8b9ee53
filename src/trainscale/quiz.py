"""Check-yourself questions with immediate feedback and no kernel.

Each answer is a ``<details>`` element: clicking it opens the verdict and the
reason. That is plain HTML, so it works on the static website, on GitHub, in
JupyterLab, and in an untrusted notebook where scripts are not allowed to run.
Where scripts do run (the book's website), a short script adds a running score:
the first answer a reader opens for each question counts, and "n of m answered
correctly" follows the questions.

The order of the choices is a seeded shuffle of the order they were written in,
one per question (the seed is the question's own text), so the correct answer is
not always the first, and the page is the same on every run and machine. The
chapters keep the quiz cell's source out of sight (removed on the website,
collapsed in JupyterLab): it lists every choice with ``True`` or ``False`` beside it.
"""

from __future__ import annotations

import html
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

LETTERS = "ABCDEFGH"

SCORE_SCRIPT = """<script>
(function () {
  var quizzes = document.querySelectorAll("ol.trainscale-quiz:not([data-scored])");
  quizzes.forEach(function (quiz) {
    quiz.setAttribute("data-scored", "");
    var questions = quiz.querySelectorAll(":scope > li");
    var score = quiz.nextElementSibling;
    var answered = 0, right = 0;
    function show() {
      score.textContent = right + " of " + questions.length + " answered correctly" +
        (answered < questions.length ? " (" + (questions.length - answered) + " to go)" : "");
    }
    questions.forEach(function (question) {
      question.querySelectorAll("details").forEach(function (choice) {
        choice.addEventListener("toggle", function () {
          if (!choice.open || question.hasAttribute("data-answered")) return;
          question.setAttribute("data-answered", "");
          answered += 1;
          if (choice.classList.contains("right")) right += 1;
          show();
        });
      });
    });
    score.hidden = false;
    show();
  });
})();
</script>"""
"""The running score: plain JavaScript, no library; it only reads which choice a
reader opened first (``class="right"`` marks the correct one) and writes the count."""


@dataclass(frozen=True)
class Choice:
    """One answer: its ``text``, whether it is ``correct``, and ``why``."""

    text: str
    correct: bool
    why: str


@dataclass(frozen=True)
class Question:
    """A multiple-choice question with exactly one correct choice (at most 8 choices)."""

    prompt: str
    choices: tuple[Choice, ...]

    def __post_init__(self) -> None:
        right = sum(choice.correct for choice in self.choices)
        if not 2 <= len(self.choices) <= len(LETTERS) or right != 1:
            raise ValueError(
                f"choices must hold 2 to {len(LETTERS)} answers with exactly 1 correct, "
                f"got {len(self.choices)} answers with {right} correct"
            )

    def shuffled(self) -> tuple[Choice, ...]:
        """The choices in this question's own seeded order (the same on every run)."""
        order = list(self.choices)
        random.Random(f"trainscale quiz: {self.prompt}").shuffle(order)
        return tuple(order)


def _inline(text: str) -> str:
    """Escape ``text`` for HTML, turning `backticks` into <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def quiz_html(questions: Sequence[Question]) -> str:
    """The quiz as an HTML fragment: a numbered list of questions, choices shuffled,
    then a score line that stays hidden unless the score script runs."""
    if not questions:
        raise ValueError("questions must hold at least 1 question, got 0")
    items = []
    for question in questions:
        answers = []
        for letter, choice in zip(LETTERS, question.shuffled(), strict=False):
            verdict = "Correct." if choice.correct else "Not quite."
            kind = "right" if choice.correct else "wrong"
            answers.append(
                f'<details class="{kind}" style="margin:0.2em 0"><summary>{letter}. '
                f"{_inline(choice.text)}</summary><p><strong>{verdict}</strong> "
                f"{_inline(choice.why)}</p></details>"
            )
        items.append(f"<li><p>{_inline(question.prompt)}</p>{''.join(answers)}</li>")
    score = '<p class="trainscale-quiz-score" aria-live="polite" hidden></p>'
    return f'<ol class="trainscale-quiz">{"".join(items)}</ol>{score}{SCORE_SCRIPT}'


def correct_letters(questions: Sequence[Question]) -> str:
    """The letter of the correct choice of each question, as the reader sees them."""
    return "".join(LETTERS[[c.correct for c in q.shuffled()].index(True)] for q in questions)


def quiz(questions: Sequence[Question]):
    """Display-ready quiz (an ``IPython.display.HTML``); click an answer to check it."""
    from IPython.display import HTML

    return HTML(quiz_html(questions))
