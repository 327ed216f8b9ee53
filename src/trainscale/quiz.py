"""Check-yourself questions with immediate feedback and no kernel.

Each answer is a ``<details>`` element: clicking it opens the verdict and the
reason. That is plain HTML, so it works on the static website, on GitHub, in
JupyterLab, and in an untrusted notebook where scripts are not allowed to run.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """One answer: its ``text``, whether it is ``correct``, and ``why``."""

    text: str
    correct: bool
    why: str


@dataclass(frozen=True)
class Question:
    """A multiple-choice question with exactly one correct choice."""

    prompt: str
    choices: tuple[Choice, ...]

    def __post_init__(self) -> None:
        right = sum(choice.correct for choice in self.choices)
        if len(self.choices) < 2 or right != 1:
            raise ValueError(
                f"choices must hold at least 2 answers with exactly 1 correct, "
                f"got {len(self.choices)} answers with {right} correct"
            )


def _inline(text: str) -> str:
    """Escape ``text`` for HTML, turning `backticks` into <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def quiz_html(questions: list[Question]) -> str:
    """The quiz as an HTML fragment: a numbered list of questions."""
    if not questions:
        raise ValueError("questions must hold at least 1 question, got 0")
    items = []
    for question in questions:
        answers = []
        for letter, choice in zip("ABCDEFGH", question.choices, strict=False):
            verdict = "Correct." if choice.correct else "Not quite."
            answers.append(
                f'<details style="margin:0.2em 0"><summary>{letter}. {_inline(choice.text)}'
                f"</summary><p><strong>{verdict}</strong> {_inline(choice.why)}</p></details>"
            )
        items.append(f"<li><p>{_inline(question.prompt)}</p>{''.join(answers)}</li>")
    return f'<ol class="trainscale-quiz">{"".join(items)}</ol>'


def quiz(questions: list[Question]):
    """Display-ready quiz (an ``IPython.display.HTML``); click an answer to check it."""
    from IPython.display import HTML

    return HTML(quiz_html(questions))
