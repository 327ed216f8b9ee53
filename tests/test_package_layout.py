"""The package's layout: one test file per module, and no module imports one from a higher layer
(nor, inside the planner and the capstone's packages, one later in its order)."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "trainscale"
TESTS = Path(__file__).resolve().parent

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: argument checks; the package root only carries the version.
    ("_checks", "__init__"),
    # 1: formulas and the model, one module per chapter idea.
    (
        "compute",
        "hardware",
        "memory",
        "collectives",
        "sharding",
        "pipeline",
        "precision",
        "checkpointing",
        "schedule",
        "batch_size",
        "transformer",
        "software",
        "published",
        "reliability",
        "context",
        "experts.*",
    ),
    # 2: simulations and measurements in one process.
    ("parallel", "loss_scaling", "stability", "efficiency"),
    # 3: real processes.
    ("distributed", "workers.*"),
    # 4: what a reader sees.
    ("figures.*", "widgets", "quiz"),
    # 5: what puts it all together.
    ("planner.*", "train.*", "launch", "__main__"),
)
"""Layers, lowest first: a module may import modules of its own layer or lower ones."""

PLANNER_ORDER: tuple[str, ...] = (
    "planner.inputs",
    "planner.unknowns",
    "planner.memory",
    "planner.traffic",
    "planner.kernels",
    "planner.layout",
    "planner.step",
    "planner.search",
    "planner.calibration",
    "planner.__init__",
    "planner.commands",
    "planner.arguments",
    "planner.explain",
    "planner.cli",
    "planner.__main__",
)
"""The planner package's modules in the order of chapter 16's sections, from what the
planner is given to its command line: a module may import only those before it (the
package's ``__init__`` re-exports the model for chapter 16; the command line builds on it)."""

TRAIN_ORDER: tuple[str, ...] = (
    "train.shapes",
    "train.config",
    "train.data",
    "train.parity",
    "train.stages",
    "train.parallelize",
    "train.checkpoints",
    "train.loop",
    "train.estimate",
    "train.full_size",
    "train.cli",
    "train.__init__",
    "train.__main__",
)
"""The capstone's package in torchtitan's split by concern, inner layers first: the model
shapes, the flags and the layout, the data, parity, the stages on the meta device, the
parallelisms, the checkpoints, the loop, the command line; the package's ``__init__``
re-exports them and ``__main__`` runs the command line."""

PACKAGE_ORDERS = {"planner": PLANNER_ORDER, "train": TRAIN_ORDER}
"""The packages whose modules keep an order, by package."""

PACKAGE_TEST_FILES = {
    "planner": "test_planner.py",
    "experts": "test_experts.py",
    "train": "test_train.py",
}
"""Packages whose modules share one test file: the planner was one module until it was
split by chapter 16's sections, and ``tests/test_planner.py`` tests it through the
package's names; the capstone's likewise (``train.py`` became ``trainscale/train/``),
through ``tests/test_train.py``. A module of such a package with a test file of its own
(``planner.cli`` -> ``test_planner_cli.py``) is tested there instead."""

SHARED_TEST_FILES = {
    "planner.commands": "test_planner_cli.py",  # the commands the command line prints
    "planner.arguments": "test_planner_cli.py",  # the command line's flags and presets
    "planner.explain": "test_planner_cli.py",  # --explain
    "planner.__main__": "test_planner_cli.py",  # runs python -m trainscale.planner
    "train.__main__": "test_train.py",  # runs python -m trainscale.train
}
"""Modules tested in another module's test file, and why."""

ALLOWED_UPWARD_IMPORTS: dict[tuple[str, str], str] = {}
"""Known upward imports, ``(importer, imported): why``. Empty: the package keeps its
layers. Add an entry only with the reason and a plan to remove it; any other upward
import fails the test."""


def _module_name(path: Path) -> str:
    """``src/trainscale/figures/style.py`` -> ``"figures.style"``."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _modules() -> list[str]:
    return sorted(_module_name(path) for path in PACKAGE.rglob("*.py"))


def layer_of(module: str) -> int:
    """The layer of a module name relative to the package (``"figures.style"``)."""
    for level, members in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and module.startswith(member[:-1])):
                return level
    raise KeyError(f"{module} has no layer: add it to LAYERS")


def _resolve(dotted: str) -> str | None:
    """``"trainscale.figures.style"`` -> ``"figures.style"``; the package's modules only.

    A name that is a package means its ``__init__``; a name that is neither a module
    nor a package (``trainscale.__version__``) means the module that defines it.
    """
    parts = dotted.split(".")
    if parts[0] != "trainscale":
        return None
    parts = parts[1:]
    while parts:
        path = PACKAGE.joinpath(*parts)
        if path.with_suffix(".py").is_file():
            return ".".join(parts)
        if (path / "__init__.py").is_file():
            return ".".join(parts) + ".__init__"
        parts = parts[:-1]
    return "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}


def imported_names(source: str, module: str) -> set[str]:
    """Every ``trainscale`` name ``source`` imports at run time, anywhere in the module
    (functions included), but not under ``if TYPE_CHECKING:``. ``module`` (``"figures.style"``)
    resolves relative imports."""
    names: set[str] = set()
    package = ["trainscale", *module.split(".")[:-1]]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.update(f"{stem}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return {name for name in names if name == "trainscale" or name.startswith("trainscale.")}


def imported_modules(source: str, module: str) -> set[str]:
    """The package's modules that ``source`` (the text of ``module``) imports at run time."""
    found = {_resolve(name) for name in imported_names(source, module)}
    return {name for name in found if name is not None and name != module}


def upward_imports() -> set[tuple[str, str]]:
    """Every ``(importer, imported)`` pair of the package where ``imported`` sits higher."""
    pairs = set()
    for module in _modules():
        source = PACKAGE.joinpath(*module.split(".")).with_suffix(".py").read_text()
        for imported in imported_modules(source, module):
            if layer_of(imported) > layer_of(module):
                pairs.add((module, imported))
    return pairs


def expected_test_file(module: str) -> str:
    """``_checks`` -> ``test_checks.py``, ``figures.style`` -> ``test_figures_style.py``."""
    return "test_" + "_".join(part.strip("_") for part in module.split(".")) + ".py"


def covering_test_file(module: str) -> str:
    """The test file that tests ``module``: :data:`SHARED_TEST_FILES`, else its own
    (:func:`expected_test_file`) if it exists, else its package's (:data:`PACKAGE_TEST_FILES`),
    else its own (missing)."""
    if module in SHARED_TEST_FILES:
        return SHARED_TEST_FILES[module]
    own = expected_test_file(module)
    package = module.split(".")[0]
    if not (TESTS / own).is_file() and "." in module and package in PACKAGE_TEST_FILES:
        return PACKAGE_TEST_FILES[package]
    return own


def defined_names(module: str) -> set[str]:
    """The names ``module`` defines at its top level (functions, classes, assignments)."""
    tree = ast.parse(PACKAGE.joinpath(*module.split(".")).with_suffix(".py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names - {"__all__"}


def later_imports(order: tuple[str, ...]) -> set[tuple[str, str]]:
    """Every ``(importer, imported)`` pair inside one package where ``imported`` comes at
    or after ``importer`` in ``order`` (:data:`PACKAGE_ORDERS`): a cycle, or a reach
    outward from an inner layer."""
    position = order.index
    pairs = set()
    for module in order:
        source = PACKAGE.joinpath(*module.split(".")).with_suffix(".py").read_text()
        for imported in imported_modules(source, module):
            if imported in order and position(imported) >= position(module):
                pairs.add((module, imported))
    return pairs


def later_planner_imports() -> set[tuple[str, str]]:
    """Every ``(importer, imported)`` pair inside the planner package where ``imported``
    comes at or after ``importer`` in :data:`PLANNER_ORDER`."""
    return later_imports(PLANNER_ORDER)


# --- one test file per module -------------------------------------------------------------


def test_every_module_has_its_own_test_file():
    modules = [m for m in _modules() if not m.endswith("__init__")]
    missing = [
        f"{m} -> tests/{covering_test_file(m)}"
        for m in modules
        if not (TESTS / covering_test_file(m)).is_file()
    ]
    assert missing == []


def test_a_shared_test_file_names_something_of_each_module_it_tests():
    # A module mapped to another's test file must at least be reached from there: one of
    # the names it defines appears in that file (the planner's through ``P.NAME``).
    modules = [m for m in _modules() if not m.endswith("__init__")]
    shared = [m for m in modules if covering_test_file(m) != expected_test_file(m)]
    assert "planner.kernels" in shared and "planner.commands" in shared
    unreached = []
    for module in shared:
        if module.endswith("__main__"):
            continue  # defines nothing; SHARED_TEST_FILES says where it is run
        text = (TESTS / covering_test_file(module)).read_text()
        if not any(re.search(rf"\b{re.escape(name)}\b", text) for name in defined_names(module)):
            unreached.append(f"{module} -> tests/{covering_test_file(module)}")
    assert unreached == []


def test_shared_test_files_are_kept_for_modules_without_their_own():
    assert covering_test_file("planner.kernels") == "test_planner.py"
    assert covering_test_file("planner.cli") == "test_planner_cli.py"
    assert covering_test_file("planner.__main__") == "test_planner_cli.py"
    assert covering_test_file("memory") == "test_memory.py"
    assert covering_test_file("figures.style") == "test_figures_style.py"
    assert covering_test_file("figures.nonexistent") == "test_figures_nonexistent.py"


def test_test_file_names_follow_the_modules():
    assert expected_test_file("_checks") == "test_checks.py"
    assert expected_test_file("__main__") == "test_main.py"
    assert expected_test_file("memory") == "test_memory.py"
    assert expected_test_file("figures.data_parallel") == "test_figures_data_parallel.py"
    assert expected_test_file("workers.pipeline") == "test_workers_pipeline.py"


def test_the_package_has_only_the_subpackages_the_rules_know():
    folders = {_module_name(p).split(".")[0] for p in PACKAGE.rglob("*/*.py")}
    assert folders == {"figures", "workers", "planner", "experts", "train"}


# --- the layers -----------------------------------------------------------------------------


def test_every_module_has_a_layer():
    assert {m: layer_of(m) for m in _modules()}  # raises KeyError naming a module without one


def test_no_module_imports_one_from_a_higher_layer():
    assert upward_imports() - ALLOWED_UPWARD_IMPORTS.keys() == set()


def test_every_allowed_upward_import_is_still_needed():
    assert ALLOWED_UPWARD_IMPORTS.keys() <= upward_imports()


# --- the planner package's order --------------------------------------------------------------


def test_the_planner_order_names_every_module_of_the_package():
    assert sorted(PLANNER_ORDER) == [m for m in _modules() if m.startswith("planner.")]


def test_no_planner_module_imports_one_later_in_the_order():
    assert later_planner_imports() == set()


@pytest.mark.parametrize("package", sorted(PACKAGE_ORDERS))
def test_each_ordered_package_names_its_modules_and_keeps_its_order(package):
    order = PACKAGE_ORDERS[package]
    assert sorted(order) == [m for m in _modules() if m.startswith(f"{package}.")]
    assert later_imports(order) == set()


def test_the_capstones_order_is_what_its_modules_import():
    # Not vacuous: the loop builds on the layout, the data and the checkpoints; the
    # layout reaches chapter 8's tensor-parallel plan, one layer down.
    source = PACKAGE.joinpath("train", "loop.py").read_text()
    imported = imported_modules(source, "train.loop")
    assert {"train.config", "train.data", "train.parallelize", "train.checkpoints"} <= imported
    plan = imported_modules(
        PACKAGE.joinpath("train", "parallelize.py").read_text(), "train.parallelize"
    )
    assert "workers.tensor_parallel" in plan
    source = "def f():\n    from trainscale.train.loop import train\n    return train\n"
    position = TRAIN_ORDER.index
    reached = imported_modules(source, "train.config")
    assert [m for m in reached if position(m) > position("train.config")] == ["train.loop"]


def test_the_planner_order_is_what_its_modules_import():
    # Not vacuous: the modules do import each other, the later ones the earlier ones.
    source = PACKAGE.joinpath("planner", "step.py").read_text()
    imported = imported_modules(source, "planner.step")
    assert {"planner.inputs", "planner.kernels", "planner.traffic"} <= imported
    cli = imported_modules(PACKAGE.joinpath("planner", "cli.py").read_text(), "planner.cli")
    assert {"planner.__init__", "planner.commands"} <= cli


def test_a_planner_import_against_the_order_would_be_caught():
    # The model's inputs reaching forward to the search, inside a function.
    source = "def f():\n    from trainscale.planner.search import plan\n    return plan\n"
    imported = imported_modules(source, "planner.inputs")
    order = PLANNER_ORDER.index
    assert [m for m in imported if order(m) > order("planner.inputs")] == ["planner.search"]


def test_imports_are_found_in_functions_but_not_under_type_checking():
    source = """
from typing import TYPE_CHECKING
import torch
from trainscale import memory, figures
from trainscale.figures.style import svg_text
import trainscale.distributed as dist
if TYPE_CHECKING:
    from trainscale.planner import Layout
else:
    from trainscale import quiz

def draw():
    from trainscale.widgets import slider
    from . import pipeline
    from .style import PALETTE
"""
    assert imported_modules(source, "figures.schedule") == {
        "memory",
        "figures.__init__",
        "figures.style",
        "distributed",
        "quiz",
        "widgets",
        "figures.pipeline",
    }


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("_checks", 0),
        ("transformer", 1),
        ("experts.__init__", 1),
        ("experts.routing", 1),
        ("efficiency", 2),
        ("workers.__init__", 3),
        ("workers.sharding", 3),
        ("figures.__init__", 4),
        ("figures.style", 4),
        ("__main__", 5),
        ("planner.__init__", 5),
        ("planner.kernels", 5),
        ("planner.__main__", 5),
        ("train.__init__", 5),
        ("train.loop", 5),
    ],
)
def test_layers_by_hand(module, layer):
    assert layer_of(module) == layer


def test_a_new_upward_import_would_be_caught():
    # A formula module (layer 1) reaching up to the planner (layer 5) inside a function.
    source = "def f():\n    from trainscale import planner\n    return planner\n"
    imported = imported_modules(source, "compute")
    assert [m for m in imported if layer_of(m) > layer_of("compute")] == ["planner.__init__"]
