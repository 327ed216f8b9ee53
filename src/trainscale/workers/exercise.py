"""Helpers for the "write it yourself" exercises: the reader's function on real ranks.

A chapter's exercise asks the reader to write one function in a notebook cell; a
checker in the chapter's worker module runs it on real gloo ranks and says what is
wrong, as a course's test suite would. Ranks are forked from a fork server that finds
workers by name (:func:`trainscale.distributed.run_ranks`), so a function defined in a
notebook cannot be sent as it is: :func:`reader_source` takes its source text, which
pickles, and each rank rebuilds the function with :func:`load_reader_function`.
:class:`ExerciseReport` collects what a checker found.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from trainscale.distributed import RankError


class ExerciseError(RuntimeError):
    """The reader's code did something the exercise does not allow (said how)."""


@dataclass
class ExerciseReport:
    """What a checker found: ``passed``, and one line per check or problem."""

    title: str
    passed: bool = True
    lines: list[str] = field(default_factory=list)

    def ok(self, line: str) -> None:
        """A check that passed."""
        self.lines.append(f"  ok: {line}")

    def fail(self, line: str) -> None:
        """A problem: the report fails, with ``line`` saying what is wrong."""
        self.passed = False
        self.lines.append(f"  PROBLEM: {line}")

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "not yet: see the problems above"
        return "\n".join([self.title, *self.lines, verdict])


def reader_source(function: Callable[..., object]) -> tuple[str, str]:
    """``function``'s source text (dedented) and name, to be sent to the ranks.

    A function defined in a notebook cannot be pickled to a rank; its source can,
    and each rank rebuilds it with :func:`load_reader_function`.
    """
    if not inspect.isfunction(function):
        raise ValueError(f"function must be a Python function, got {type(function).__name__}")
    return textwrap.dedent(inspect.getsource(function)), function.__name__


def load_reader_function(source: str, name: str, namespace: dict) -> Callable[..., object]:
    """Run ``source`` in a fresh ``namespace`` (the names it may use) and return ``name``."""
    scope = dict(namespace)
    exec(compile(source, "<your function>", "exec"), scope)
    return scope[name]


def rank_failure(error: RankError, timeout: float, hint: str) -> str:
    """One line saying why a run of the reader's code failed: the exception's last line,
    or, if it hung, ``hint`` (what usually makes ranks wait for each other forever)."""
    text = str(error)
    if "did not finish" in text:
        return f"the ranks did not finish within {timeout:g} s: {hint}"
    head = text.splitlines()[0].split(" (exit code")[0]
    last = [line for line in text.splitlines() if line.strip()][-1].strip()
    return f"{head}: {last}"
