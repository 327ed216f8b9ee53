"""Print notebook paths longest-running first, for nbval's two workers (``make nbval``).

Each committed notebook stores when each of its cells started and finished (nbclient's
``execution`` metadata); a notebook's run time is the sum of its cells' times. Two
workers that take the longest notebooks first finish close together: the short ones
fill the gaps at the end. A notebook with no stored times sorts last.

    python tools/longest_first.py notebooks/*.ipynb
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path


def stored_seconds(path: Path) -> float:
    """Seconds the notebook's code cells took when it was last executed (0 if unknown)."""
    total = 0.0
    for cell in json.loads(path.read_text())["cells"]:
        timing = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
            started = datetime.fromisoformat(timing["iopub.execute_input"])
            finished = datetime.fromisoformat(timing["shell.execute_reply"])
            total += (finished - started).total_seconds()
    return total


def longest_first(paths: list[Path]) -> list[Path]:
    """``paths`` sorted by stored run time, longest first; ties keep their name order."""
    return sorted(sorted(paths), key=stored_seconds, reverse=True)


if __name__ == "__main__":
    print(" ".join(str(path) for path in longest_first([Path(p) for p in sys.argv[1:]])))
