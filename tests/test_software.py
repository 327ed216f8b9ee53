"""The software stack as an input: the record, its presets and how the planner reads it."""

import json
from importlib import resources

import pytest

from trainscale import planner as P
from trainscale.software import (
    DEFAULT_SOFTWARE,
    FIELDS,
    SOFTWARE,
    Software,
    software,
)

BASE = {"name": "mine", "title": "my stack", "fused_attention": True, "dropout": False}


def _make(**changes: object) -> Software:
    return Software(**{**BASE, "gradient_reduce_dtype": "bf16", **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"gradient_reduce_dtype": "fp8"}, "gradient_reduce_dtype", "'bf16', 'fp16', 'fp32'"),
        ({"fused_attention": 1}, "fused_attention", "True or False"),
        ({"dropout": None}, "dropout", "True or False"),
        ({"zero_stages": (0, 4)}, "zero_stages", "(0, 1, 2, 3)"),
        ({"zero_stages": ()}, "zero_stages", "ZeRO stages 0-3"),
        ({"zero_stages": (0,), "pipeline_zero_stages": (0, 1)}, "pipeline_zero_stages", "(0,)"),
        ({"overlap_grad_reduce": "yes"}, "overlap_grad_reduce", "True or False"),
        ({"interleaving_min_stages": 1}, "interleaving_min_stages", ">= 2"),
        ({"name": ""}, "name", "non-empty"),
    ],
)
def test_a_bad_field_names_itself_and_what_it_allows(changes, field, allowed):
    with pytest.raises(ValueError, match=field) as error:
        _make(**changes)
    assert allowed in str(error.value)


def test_the_overlap_the_code_documents_becomes_the_planners_shares():
    # Megatron-LM 2021: the gradient all-reduce after the backward, synchronous TP.
    assert SOFTWARE["megatron-lm-2021"].overlap_shares(8, 0) == (0.0, 0.0)
    # 2022: the backward's TP collectives under the weight-gradient GEMMs.
    assert SOFTWARE["megatron-lm-2022"].overlap_shares(8, 0) == (0.0, 1.0)
    # DeepSpeed's pipeline engine reduces after the flush; without a pipeline: unknown.
    deepspeed = SOFTWARE["deepspeed-megatron"]
    assert deepspeed.overlap_shares(12, 1) == (0.0, None)
    assert deepspeed.overlap_shares(1, 3) == (None, None)
    # FSDP2: reduce-scatter, gathers and prefetch documented as overlapped; TP is not.
    assert SOFTWARE["torchtitan-fsdp2"].overlap_shares(1, 3) == (1.0, 0.0)
    assert DEFAULT_SOFTWARE.overlap_shares(4, 3) == (None, None)  # unknown: the range


def test_an_engine_refuses_what_its_code_asserts():
    deepspeed = SOFTWARE["deepspeed-megatron"]
    assert deepspeed.layout_problems(1, 1, 3) == []
    assert "ZeRO-2 with pipeline" in deepspeed.layout_problems(4, 1, 2)[0]
    assert "does not interleave" in deepspeed.layout_problems(4, 2, 1)[0]
    assert "has no ZeRO-1" in SOFTWARE["megatron-lm-2021"].layout_problems(1, 1, 1)[0]
    # Megatron's interleaving asserts, recorded: PP > 2, and (2022) m a multiple of PP.
    assert SOFTWARE["megatron-lm-2021"].interleaving_problems(2, 8, 6) != []
    assert SOFTWARE["megatron-lm-2022"].interleaving_problems(8, 3, 12) != []
    assert SOFTWARE["megatron-lm-2022"].interleaving_problems(8, 3, 64) == []
    assert SOFTWARE["megatron-core-te"].interleaving_problems(2, 8, 6) == []


def test_every_preset_gives_every_field_a_source():
    for stack in SOFTWARE.values():
        assert set(stack.sources) == set(FIELDS), stack.name
        assert all(isinstance(text, str) and text for text in stack.sources.values())
    assert software("meta-llama3") is SOFTWARE["meta-llama3"]
    with pytest.raises(ValueError, match="software must be one of"):
        software("megatron")


def test_every_published_run_names_a_preset_that_exists():
    text = resources.files("trainscale").joinpath("data/published_runs.json").read_text()
    names = {row["software"] for row in json.loads(text)}
    assert names <= set(SOFTWARE)
    runs = {run.name: run.software.name for run in P.published_runs()}
    assert runs["BLOOM 176B on 384 A100s"] == "deepspeed-megatron"
    assert runs["Llama 3 405B on 8,192 H100s, 8K tokens"] == "meta-llama3"


def test_a_changed_field_is_named_and_sourced_to_the_caller():
    changed = SOFTWARE["meta-llama3"].replace(gradient_reduce_dtype="bf16")
    assert changed.gradient_bytes == 2 and SOFTWARE["meta-llama3"].gradient_bytes == 4
    assert changed.name == "meta-llama3 (gradient_reduce_dtype=bf16)"
    assert changed.sources["gradient_reduce_dtype"] == "given by the caller"
    assert SOFTWARE["meta-llama3"].replace(dropout=False) is SOFTWARE["meta-llama3"]
    with pytest.raises(ValueError, match="changes must be fields"):
        DEFAULT_SOFTWARE.replace(colour="red")


def test_the_planner_reads_the_software_not_a_citation():
    args = (P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 64, 8, 4, 2, 1, "selective", 1)
    plain = P.evaluate(*args)
    assert plain == P.evaluate(*args, software="planner-default")
    refused = P.evaluate(*args, software="deepspeed-megatron", virtual_stages=2)
    assert refused.verdict == "invalid" and "does not interleave" in refused.notes[-1]
    # no dropout masks: less activation memory, the same weights
    lean = P.evaluate(*args, software=DEFAULT_SOFTWARE.replace(dropout=False))
    assert lean.memory_parts["activations"] < plain.memory_parts["activations"]
    assert lean.memory_parts["weights"] == plain.memory_parts["weights"]
    # a model's own dropout wins over the software's
    assert P.LONG_CONTEXT_MODEL.under(DEFAULT_SOFTWARE).dropout is False
    assert P.EXAMPLE_MODEL.under(SOFTWARE["megatron-lm-2021"]).fused_attention is False


def test_a_published_run_can_be_estimated_on_another_stack():
    bloom = next(run for run in P.published_runs() if run.name.startswith("BLOOM"))
    own = P.estimate_run(bloom)
    assert P.estimate_run(bloom, software="deepspeed-megatron") == own  # its own stack
    # with fp32 gradients (what DeepSpeed's bf16 optimiser accumulates) the same layout
    # holds twice the gradient bytes
    fp32 = P.estimate_run(bloom, software=bloom.software.replace(gradient_reduce_dtype="fp32"))
    assert fp32.layout.memory_parts["gradients"] == 2 * own.layout.memory_parts["gradients"]
    with pytest.raises(ValueError, match="software must be one of"):
        P.estimate_run(bloom, software="deepspeed")
