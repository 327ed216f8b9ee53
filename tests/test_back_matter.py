"""The back matter (book/): in the table of contents, the cheat sheet stored executed, the
glossary covering the terms the chapters use and linking each to a chapter."""

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BACK_MATTER = ["book/cheat_sheet", "book/glossary", "book/notation", "book/running_on_a_cpu"]


def _glossary() -> dict[str, str]:
    """Each glossary term and its definition (the indented lines below it)."""
    text = (ROOT / "book" / "glossary.md").read_text()
    body = text[text.index("```{glossary}") : text.rindex("```")].splitlines()[1:]
    entries: dict[str, str] = {}
    term = None
    for line in body:
        if line and not line.startswith(" "):
            term = line.strip()
            entries[term] = ""
        elif term is not None:
            entries[term] += line.strip() + " "
    return entries


def test_the_back_matter_is_in_the_table_of_contents():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    back = next(part for part in toc["parts"] if part["caption"] == "Back matter")
    files = [chapter["file"] for chapter in back["chapters"]]
    assert [f for f in files if f in BACK_MATTER] == BACK_MATTER


def test_the_cheat_sheet_is_stored_run_in_order_without_errors():
    notebook = json.loads((ROOT / "book" / "cheat_sheet.ipynb").read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1))
    for index, cell in enumerate(code[1:], start=1):  # the first cell only imports
        assert cell["outputs"], f"code cell {index} stored without its output"
        for output in cell["outputs"]:
            assert output["output_type"] != "error"
            assert output.get("name") != "stderr", f"code cell {index} wrote to stderr"


def test_the_glossary_defines_the_terms_the_chapters_use_undefined():
    # The terms issue #25 names; each is one entry (or part of one, e.g. "HFU and MFU").
    wanted = [
        "GEMM", "Roofline", "Arithmetic intensity", "SM", "Tile", "Wave quantisation",
        "HFU", "MFU", "GQA", "SwiGLU", "RMSNorm", "RoPE", "ZeRO stages", "FSDP", "HSDP",
        "Tensor parallelism", "Sequence parallelism", "Pipeline parallelism",
        "Context parallelism", "Expert parallelism", "Bubble", "Micro-batch",
        "Gradient accumulation", "All-reduce", "Reduce-scatter", "All-gather", "All-to-all",
        "busbw", "NVLink", "InfiniBand", "DeviceMesh", "DTensor", "DCP", "Rank", "Replica",
        "Straggler",
    ]  # fmt: skip
    terms = " | ".join(_glossary())
    missing = [term for term in wanted if not re.search(rf"\b{re.escape(term)}\b", terms)]
    assert missing == []


def test_every_glossary_entry_is_short_and_links_where_it_is_taught():
    for term, definition in _glossary().items():
        assert "{doc}`" in definition or "`trainscale." in definition, term
        sentences = re.sub(r"\{doc\}`[^`]*`|`[^`]*`|\$[^$]*\$", "x", definition)
        assert len(re.findall(r"[.!?](\s|$)", sentences)) <= 4, f"{term}: keep it short"


def test_every_chapter_opens_with_a_margin_note_linking_the_back_matter():
    # besides the sidebar, each chapter's first cell points at every back-matter page
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        margin = first[first.index(":::{margin}") :]
        linked = re.findall(r"<\.\./(book/\w+)>", margin)
        assert sorted(linked) == sorted(BACK_MATTER), path.name
