"""Words of main text per chapter: the count behind the book's 3,000-word budget.

The budget (issue #25, CONTRIBUTING.md) limits what a reader must read to follow a
chapter, not what the chapter holds: provenance and checks go in asides and
dropdowns, which a reader opens when they want them. So the count is:

1. **Markdown cells only.** Code, its outputs and raw cells are not counted. A markdown
   cell tagged ``remove-cell`` or ``remove-input`` (not shown on the site) is skipped.
2. **Outside fenced blocks.** Every block fenced by three or more backticks or colons
   is skipped whole, its opening and closing lines included: MyST directives
   (``{dropdown}``, ``{admonition}``, ``{margin}``, ``{note}``, ``{aside}``, ...) and
   code listings alike. A block closes at a line of the same character, at least as
   long as its opening fence, and nothing else, as in MyST; an unclosed block runs to
   the end of its cell. Also skipped: HTML ``<details>...</details>`` (a dropdown) and
   HTML comments.
3. **Math.** Display math (``$$...$$``) counts as no words; each inline formula
   (``$...$``) counts as one word, however long.
4. **Words.** What is left is split at whitespace; a piece counts as one word if it
   holds at least one letter or digit (so ``--``, ``|``, ``-`` and ``#`` do not count,
   and ``2(N-1)/N`` or ``{cite}`key``` is one word). Headings, list items, tables and
   link texts are counted like any other text.

Run ``python tools/wordcount.py [notebook ...]`` (default: every notebook under
``notebooks/``) to print each chapter's count and whether it is within the budget.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BUDGET = 3000
"""Most words of main text a chapter may have (issue #25)."""

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^[ \t]{0,3}(`{3,}|:{3,})")
_DETAILS = re.compile(r"<details\b.*?</details\s*>", re.S | re.I)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\$)[^$\n]+?(?<![\\\s])\$")
_WORDLIKE = re.compile(r"[^\W_]")  # a letter or a digit, in any script
_HIDDEN_TAGS = {"remove-cell", "remove-input"}


def _outside_fences(text: str) -> str:
    """``text`` without its fenced blocks (directives and code listings)."""
    kept: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
            else:
                kept.append(line)
        elif (
            match
            and match.group(1)[0] == fence[0]
            and len(match.group(1)) >= len(fence)
            and not line.strip()[len(match.group(1)) :].strip()
        ):
            fence = None
    return "\n".join(kept)


def main_text(markdown: str) -> str:
    """The part of one markdown cell that counts as main text (rules 2 and 3)."""
    text = _outside_fences(markdown)
    text = _COMMENT.sub(" ", _DETAILS.sub(" ", text))
    text = _DISPLAY_MATH.sub(" ", text)
    return _INLINE_MATH.sub(" formula ", text)


def count_words(markdown: str) -> int:
    """Words of main text in one markdown cell's source (rules 2 to 4)."""
    return sum(1 for piece in main_text(markdown).split() if _WORDLIKE.search(piece))


def notebook_words(path: Path) -> int:
    """Words of main text in the notebook at ``path``: its shown markdown cells (rule 1)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    total = 0
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        if _HIDDEN_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        source = cell["source"]
        total += count_words(source if isinstance(source, str) else "".join(source))
    return total


def report(paths: list[Path]) -> str:
    """One line per notebook: its words of main text and whether they fit the budget."""
    lines = [f"{'chapter':40s} {'words':>6s}  budget {BUDGET:,}"]
    for path in paths:
        words = notebook_words(path)
        verdict = "within" if words <= BUDGET else f"over by {words - BUDGET:,}"
        lines.append(f"{path.stem:40s} {words:6,d}  {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    given = [Path(arg) for arg in sys.argv[1:]]
    print(report(given or sorted((ROOT / "notebooks").glob("*.ipynb"))))
