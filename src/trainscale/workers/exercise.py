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

import torch
import torch.distributed as dist

from trainscale.distributed import RankError

POINT_TO_POINT = ("send", "isend")
"""The sends of ``torch.distributed`` (receives send nothing)."""

COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
)
"""The collectives of ``torch.distributed`` a reader's code might call."""


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


def _contribution(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor this rank puts into a call of ``dist.<name>``: the input, which is the
    second argument of the ``*_single``/``*_tensor``/``reduce_scatter`` forms (their
    first is the output) and the first of the others."""
    second = name in ("reduce_scatter", "all_gather") or name.endswith(("_single", "_tensor"))
    key = "input_tensor" if name.startswith("all_gather") else "input"
    tensor = kwargs.get(key) if second else kwargs.get("tensor")
    if tensor is None and len(args) > int(second):
        tensor = args[int(second)]
    return tensor if isinstance(tensor, torch.Tensor) else None


def watch_communication(
    sent: dict[str, int],
    refuse: tuple[str, ...] = (),
    why: str = "{name}",
    allow: tuple[str, ...] | None = None,
) -> None:
    """Make every send and collective of ``torch.distributed`` count, in ``sent``, the
    bytes this rank puts into it, under the function's name (a call whose input is a
    list counts no bytes, only the call, as ``sent[name + " calls"]``); a function
    named in ``refuse`` raises :class:`ExerciseError` with ``why`` (formatted with
    ``name``) instead; with ``allow``, every send and collective not named there is
    refused. For a rank's process only: it patches the module for good.
    """
    from torch.distributed import distributed_c10d

    if allow is not None:
        refuse = tuple(n for n in (*POINT_TO_POINT, *COLLECTIVES) if n not in allow)

    busy = [False]  # send() calls isend(): count the outer call only

    def counted(name: str, original: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            if name in refuse:
                raise ExerciseError(why.format(name=name))
            outer = not busy[0]
            if outer:
                sent[f"{name} calls"] = sent.get(f"{name} calls", 0) + 1
                tensor = _contribution(name, args, kwargs)
                if tensor is not None:
                    sent[name] = sent.get(name, 0) + tensor.numel() * tensor.element_size()
            busy[0] = True
            try:
                return original(*args, **kwargs)
            finally:
                busy[0] = not outer

        return call

    names = [n for n in (*POINT_TO_POINT, *COLLECTIVES) if hasattr(distributed_c10d, n)]
    originals = {name: getattr(distributed_c10d, name) for name in names}
    for module in (dist, distributed_c10d):
        for name in names:
            setattr(module, name, counted(name, originals[name]))
