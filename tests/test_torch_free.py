"""The planner's core imports and plans with the standard library alone (no torch, no numpy).

Chapter 16's web page runs :mod:`trainscale.planner` under Pyodide, which has neither
torch nor numpy. Here a fresh interpreter with both made unimportable plans the same
layouts as this one, which has them; and the dtype sizes the model state is counted in
(:data:`trainscale.memory.DTYPE_BYTES`) are torch's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from trainscale.memory import DTYPE_BYTES, StateDtypes, state_bytes_per_param
from trainscale.planner import arguments
from trainscale.planner import cli as planner_cli

# Small presets that still reach every kind of layout: dense with GQA (Llama 3 8B), a
# published run with its own stack (GPT 22B), and a mixture of experts (expert parallelism).
PRESETS = ("llama-3-8b", "gpt-22b-on-8-a100s-selective-recompute", "mixtral-8x7b")

PLANS = """
import dataclasses, json, math
from trainscale import planner
from trainscale.planner import arguments
from trainscale.planner import cli as planner_cli

def number(x):
    return None if isinstance(x, float) and math.isnan(x) else x

def plans(names):
    out = {}
    for name in names:
        request = arguments.parse(["--model", name])
        layouts = planner.plan(
            request.model, request.cluster, request.global_batch,
            software=request.software, virtual_stages=request.virtual_stages,
        )
        best = planner.top_layouts(layouts, count=5)
        out[name] = {
            "verdicts": planner.verdict_counts(layouts),
            "best": [
                {k: (dict(v) if isinstance(v, dict) else number(v))
                 for k, v in dataclasses.asdict(lay).items()}
                for lay in best
            ],
            "ranges": [planner.mfu_range(request.model, request.cluster, lay,
                                         software=request.software) for lay in best],
        }
    return json.dumps(out, sort_keys=True)
"""

BLOCK = """
import sys
for name in ("torch", "numpy"):
    sys.modules[name] = None  # `import torch` now raises ImportError
"""


def _in_fresh_interpreter(code: str) -> str:
    """Run ``code`` in a new interpreter where torch and numpy cannot be imported."""
    script = textwrap.dedent(BLOCK) + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_planner_plans_without_torch_or_numpy_exactly_as_with_them():
    namespace: dict = {}
    exec(PLANS, namespace)  # the same function, here with torch imported
    here = namespace["plans"](PRESETS)
    code = (
        PLANS
        + f"""
print(plans({PRESETS!r}))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy") and sys.modules[m])
assert not loaded, loaded
"""
    )
    there = _in_fresh_interpreter(code).strip()
    assert json.loads(there) == json.loads(here)


def test_the_command_line_parses_without_torch():
    # A bad value gets the same message as with torch.
    code = """
from trainscale.planner import arguments
from trainscale.planner import cli as planner_cli
try:
    arguments.parse(["--model", "70b", "--nodes", "0"])
except ValueError as error:
    print(error)
"""
    with pytest.raises(ValueError) as here:
        arguments.parse(["--model", "70b", "--nodes", "0"])
    assert _in_fresh_interpreter(code).strip() == str(here.value)


@pytest.mark.parametrize("name", list(DTYPE_BYTES))
def test_dtype_sizes_are_torch_s(name):
    dtype = getattr(torch, name)
    assert dtype.is_floating_point
    assert DTYPE_BYTES[name] == torch.finfo(dtype).bits // 8


def test_a_torch_dtype_counts_as_its_name():
    by_name = StateDtypes(weights="float16", gradients="float32", gradient_copy="float32")
    by_dtype = StateDtypes(
        weights=torch.float16, gradients=torch.float32, gradient_copy=torch.float32
    )
    # 2 + 4 + 4 (copy) + 4 (master) + 4 + 4 = 22 bytes per parameter, either way.
    assert state_bytes_per_param(by_name) == state_bytes_per_param(by_dtype)
    assert sum(state_bytes_per_param(by_dtype).values()) == 22


def test_the_command_line_s_json_is_the_same_without_torch_but_for_the_capstone_s_check():
    # plan_json is what chapter 16's web page runs. Without torch, trainscale.train's own
    # checks cannot run: the command is layout 1's, marked unchecked, with a note saying so.
    argv = ["--model", PRESETS[1]]
    here = planner_cli.plan_json(argv)
    code = (
        f"import json\nfrom trainscale.planner import cli\nprint(json.dumps(cli.plan_json({argv})))"
    )
    there = json.loads(_in_fresh_interpreter(code))
    assert here["notes"] == [] and here["command"]["checked"]  # the capstone runs layout 1
    unchecked = planner_cli.UNCHECKED.format(place=1)
    assert there.pop("notes") == [unchecked] and not there["command"].pop("checked")
    split = [line.startswith("to train layout 1") for line in here["text"]].index(True)
    assert there["text"] == [*here["text"][:split], f"note: {unchecked}", "", *here["text"][split:]]
    for key in ("notes", "text"):
        here.pop(key), there.pop(key, None)
    here["command"].pop("checked")
    assert there == here
