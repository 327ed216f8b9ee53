"""``python -m trainscale.planner``: presets, explicit sizes, bad flags, and commands that run."""

import dataclasses
import json
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest

from trainscale import planner, train
from trainscale.memory import GIB
from trainscale.planner import cli as planner_cli
from trainscale.published import published_runs


def test_every_published_run_and_the_books_example_are_presets():
    found = planner_cli.presets()
    assert found["70b"].model == planner.EXAMPLE_MODEL
    assert found["70b"].global_batch == planner.EXAMPLE_GLOBAL_BATCH
    titles = {preset.title for preset in found.values()}
    assert {run.name for run in published_runs()} <= titles
    # the book's example, the model shapes, and no two runs sharing a name
    assert len(found) == len(published_runs()) + 1 + len(planner_cli.MODEL_PRESETS)


def test_preset_names_are_the_titles_in_lower_case_words():
    assert planner_cli.preset_name("GPT 1.7B on 32 A100s") == "gpt-1.7b-on-32-a100s"
    assert (
        planner_cli.preset_name("Llama 3 405B on 8,192 H100s, 8K tokens")
        == "llama-3-405b-on-8192-h100s-8k-tokens"
    )


def test_a_preset_brings_its_cluster_and_batch_and_flags_override_them():
    run = published_runs()[0]  # GPT 1.7B on 32 A100s: 4 nodes of 8, batch 512
    request = planner_cli.parse(["--model", planner_cli.preset_name(run.name)])
    assert (request.cluster.gpus, request.gpu, request.global_batch) == (32, "A100-80GB", 512)
    assert request.model == planner.published_model(run)
    changed = planner_cli.parse(["--model", "70b", "--seq-len", "8192", "--nodes", "2"])
    assert (changed.model.seq_len, changed.model.layers, changed.cluster.nodes) == (8192, 80, 2)


def test_explicit_sizes_make_the_model_and_the_gpu_sets_the_node():
    sizes = "--params 7e9 --layers 32 --hidden 4096 --heads 32 --seq-len 4096 --vocab 32000"
    request = planner_cli.parse([*sizes.split(), "--gpu", "A100-80GB", "--nodes", "2"])
    assert request.model == planner.Model(7e9, 32, 4096, 32, 4096, 32000)
    assert (request.cluster.gpus_per_node, request.cluster.gpus) == (8, 16)
    assert request.cluster.peak_flops == 312e12
    assert request.cluster.inter_node_bandwidth == 50e9  # the default, 400 Gb/s per GPU
    assert request.global_batch == planner.EXAMPLE_GLOBAL_BATCH


SIZES = ["--params", "7e9", "--layers", "32", "--hidden", "4096", "--heads", "32"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--model", "71b"], "--model"),
        (SIZES, "--seq-len, --vocab missing"),
        (["--model", "70b", "--layers", "0"], "--layers"),
        (["--model", "70b", "--hidden", "1000"], "--hidden must be a multiple of --heads=64"),
        (["--model", "70b", "--params", "1e6"], "--params must exceed"),
        (["--model", "70b", "--gpu", "Z80"], "--gpu"),
        (["--model", "70b", "--nodes", "0"], "--nodes"),
        (["--model", "70b", "--nodes", "1.5"], "--nodes"),
        (["--model", "70b", "--gpus-per-node", "0"], "--gpus-per-node"),
        (["--model", "70b", "--inter-node-bandwidth", "-1"], "--inter-node-bandwidth"),
        (["--model", "70b", "--global-batch", "0"], "--global-batch"),
        (["--model", "70b", "--top", "0"], "--top"),
        (["--model", "70b", "--laptop", "0"], "--laptop"),
    ],
)
def test_bad_inputs_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(ValueError, match=flag):
        planner_cli.parse(argv)
    assert planner_cli.main(argv) == 2
    assert flag in capsys.readouterr().err


def test_an_unknown_flag_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        planner_cli.main(["--no-such-flag"])
    assert stopped.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def _shape(tp: int, pp: int, dp: int) -> SimpleNamespace:
    return SimpleNamespace(tp=tp, pp=pp, dp=dp)


@pytest.mark.parametrize(
    ("planned", "ranks", "laptop"),
    [
        ((8, 4, 2), 8, (2, 2, 2)),  # 2, 2, 2: one factor to each dimension
        ((8, 4, 2), 4, (2, 2, 1)),  # no factor left for DP
        ((4, 1, 2), 8, (4, 1, 2)),  # TP 2, DP 2, then TP 4 (DP is full)
        ((1, 1, 64), 8, (1, 1, 8)),  # data parallelism only
        ((8, 4, 2), 6, (3, 2, 1)),  # 6 = 3 x 2: TP 3 (largest factor first), PP 2
        ((1, 1, 1), 2, (1, 1, 2)),  # nothing to keep: the rest goes to DP
    ],
)
def test_the_laptop_keeps_the_kinds_of_parallelism(planned, ranks, laptop):
    shape = planner_cli.laptop_shape(_shape(*planned), ranks)
    assert shape == laptop
    assert shape[0] * shape[1] * shape[2] == ranks


@pytest.fixture(scope="module")
def example() -> SimpleNamespace:
    """The 70B worked example, planned once: the request, the best shapes, the CLI's output."""
    argv = ["--model", "70b", "--top", "3", "--laptop", "8"]
    request = planner_cli.parse(argv)
    assert request.virtual_stages == planner.INTERLEAVING  # every depth, by default
    layouts = planner.plan(
        *(request.model, request.cluster, request.global_batch),
        virtual_stages=request.virtual_stages,
        software=request.software,
    )
    lines, fits = planner_cli.report(request)
    best = planner.top_layouts(layouts, 3)
    return SimpleNamespace(
        request=request, layouts=layouts, best=best, text="\n".join(lines), fits=fits
    )


def _train_argv(command: str) -> list[str]:
    """The arguments after ``-m trainscale.train`` of a printed command."""
    words = shlex.split(command.replace("\\\n", " "))
    return words[words.index("trainscale.train") + 1 :]


def _commands(text: str) -> list[str]:
    """The printed commands: each starts a paragraph and ends at the next blank line."""
    return [block for block in text.split("\n\n") if "-m trainscale.train" in block]


def test_the_report_lists_the_planners_best_shapes_and_commands(example):
    assert example.fits
    for place, layout in enumerate(example.best, start=1):
        cp = f"CP {layout.cp} x " if layout.cp > 1 else ""
        shape = f"TP {layout.tp} x {cp}PP {layout.pp} x DP {layout.dp}"
        assert f"{place:>3}  {shape} " in example.text
        low, high = planner.mfu_range(example.request.model, example.request.cluster, layout)
        assert f"{layout.mfu:.1%} ({low:.1%}-{high:.1%})" in example.text
    assert f"{len(example.layouts):,} layouts tried" in example.text
    counts = planner.verdict_counts(example.layouts)
    # 70B on 64 H100s, every depth: each rule's rejections, counted and printed
    assert counts["out of memory"] > counts["fits"] > 0
    rules = ", ".join(f"{counts[v]:,} {v}" for v in planner.VERDICTS[1:])
    assert f"rejected: {rules}" in example.text
    assert any(lay.virtual_stages > 1 for lay in example.best)  # an interleaved layout leads
    cluster, laptop = _commands(example.text)
    assert cluster.startswith("torchrun --nnodes=8 --nproc-per-node=8 --rdzv-backend=c10d")
    assert "--rdzv-endpoint=$HEAD_NODE:29500" in cluster
    assert laptop.startswith("python -m trainscale.launch --nproc-per-node=8 -m trainscale.train")
    assert "torchrun" not in laptop  # its stores would listen on every interface
    assert "keeps every listener on 127.0.0.1" in example.text


def _commanded(example: SimpleNamespace) -> planner.Layout:
    """The layout whose command the CLI prints: the fastest the capstone can run, among
    the planned ones or, if none, among those planned on its own stack."""
    place, _, _ = planner_cli._runnable(example.best, example.request)
    if place is not None:
        return example.best[place]
    best = planner_cli._runner_best(example.request)
    place, _, _ = planner_cli._runnable(best, example.request)
    return best[place]


def test_the_printed_command_fits_on_the_capstones_own_stack(example):
    # The planner's default stack fuses element-wise ops and the loss; the capstone runs
    # them eagerly (torchtitan-2024's preset), which keeps more: its command is for a
    # layout that fits there, and a faster one that does not is named with its memory.
    chosen = _commanded(example)
    request = example.request
    runner = planner_cli.on_the_runner(chosen, request.model, request.cluster)
    assert runner.verdict == "fits"
    for place, layout in enumerate(example.best):
        if layout is chosen:
            break
        needs = planner_cli.on_the_runner(layout, request.model, request.cluster)
        if needs.verdict != "fits":
            assert f"cannot run layout {place + 1} as planned: on its stack" in example.text
            assert f"{needs.memory_bytes / GIB:.1f} GiB per GPU" in example.text


def test_the_printed_commands_parse_with_the_capstones_own_checks(example):
    if "--tp" not in train.parser().format_help():
        pytest.skip("trainscale.train does not take --tp yet (issue 14, section 1)")
    cluster, laptop = (_train_argv(c) for c in _commands(example.text))
    best = _commanded(example)
    assert cluster == planner_cli.train_flags(best, example.request.model, 989e12)
    config = train.parse_args(cluster)
    assert config.layout(64).sizes == (
        best.pp,
        1,
        best.dp,
        best.cp,
        best.tp,
    )  # pp, rep, shard, cp, tp
    assert (config.micro_batch, config.grad_accum) == (best.micro_batch, best.accumulation)
    assert (config.layers, config.width, config.heads) == (80, 8192, 64)
    tiny = train.parse_args(laptop)
    kept = planner_cli.laptop_degrees(best, 8)  # every kind the plan uses, scaled down
    assert tiny.layout(8).sizes == (kept["pp"], 1, kept["dp"], kept["cp"], kept["tp"])
    used = [k for k in ("tp", "cp", "pp", "dp") if getattr(best, k) > 1]
    dropped = [k.upper() for k in used if kept[k] == 1]
    assert len(used) - len(dropped) == min(len(used), 3)  # 8 = 2 x 2 x 2: three kept at most
    assert not dropped or f"the plan's kinds of parallelism but {', '.join(dropped)}" in (
        example.text
    )
    assert planner_cli.refusal(laptop, 8) is None
    assert "multiply to the number of ranks, 4" in planner_cli.refusal(laptop, 4)


def test_zero_0_replicates_and_interleaving_asks_for_its_schedule(example):
    best = example.best[0]
    replicated = dataclasses.replace(best, zero_stage=0, virtual_stages=2)
    flags = planner_cli.train_flags(replicated, example.request.model, 1e15)
    assert flags[flags.index("--dp-replicate") + 1] == str(best.dp)
    assert "--dp-shard" not in flags
    assert flags[flags.index("--pp-schedule") + 1 :][:3] == ["interleaved", "--virtual-stages", "2"]


def test_nothing_fits_says_so_with_status_1(capsys):
    assert planner_cli.main(["--model", "70b", "--nodes", "1", "--gpus-per-node", "1"]) == 1
    out = capsys.readouterr().out
    # one GPU: the nearest layout runs out of memory, and more GPUs would help
    assert "no layout fits. The nearest, TP 1 x PP 1 x DP 1" in out
    assert "out of memory: " in out and "more GPUs (--nodes)" in out


def test_a_batch_too_small_for_the_pipeline_names_the_bubble_not_the_gpus(capsys):
    argv = ["--model", "70b", "--global-batch", "3", "--virtual-stages", "1"]
    argv += ["--context-parallel", "1"]  # CP would let 3 sequences use more GPUs
    assert planner_cli.main(argv) == 1
    out = capsys.readouterr().out
    # 3 sequences: DP 1 or 3; DP 1 leaves TP 8 x PP 8 with 3 micro-batches, bubble
    # (8 - 1) / (3 + 8 - 1) = 70 % of the busy time, 68 % of the step as priced
    assert "The nearest, TP 8 x PP 8 x DP 1" in out
    assert "bubble too large: pipeline idle 68% of the step with 3 micro-batches" in out
    assert "a larger --global-batch" in out and "add GPUs" not in out
    # with interleaving (the default), V 8 shrinks the bubble and 12 layouts fit (the
    # capstone runs none of them: 80 layers over 64 chunks), so no "nothing fits"
    planner_cli.main(["--model", "70b", "--global-batch", "3", "--context-parallel", "1"])
    out = capsys.readouterr().out
    assert "12 fit" in out and "no layout fits" not in out


def test_more_gpus_than_any_layout_can_use_names_nodes(capsys):
    assert planner_cli.main(["--model", "70b", "--nodes", "3e6"]) == 1
    out = capsys.readouterr().out
    # 24,000,000 GPUs > 1,024 (DP) x 64 (TP) x 82 (PP) x 4 (CP) = 21,495,808
    assert "at most 21,495,808" in out and "x CP 4" in out
    # 1,024 (DP) x 64 (TP) x 82 (PP) x 4 (CP: 4,096 tokens, 1,024 each) = 21,495,808 GPUs
    # can be used, so 1e6 nodes are searched; 2e6 nodes, 16M GPUs... with CP 1 only:
    # 1,024 x 64 x 82 = 5,373,952 < 8,000,000 GPUs
    assert planner_cli.main(["--model", "70b", "--nodes", "1e6", "--context-parallel", "1"]) == 1
    out = capsys.readouterr().out
    assert "--nodes: 8,000,000 GPUs are more than any layout can use, at most 5,373,952" in out
    assert "layouts tried" not in out  # refused before the search


def test_list_models(capsys):
    assert planner_cli.main(["--list-models"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[0] == "70b"
    shapes = listed[1 : 1 + len(planner_cli.MODEL_PRESETS)]
    assert [line.split()[0] for line in shapes] == list(planner_cli.MODEL_PRESETS)
    assert len(listed) == len(published_runs()) + 1 + len(planner_cli.MODEL_PRESETS)


@pytest.mark.slow  # a second Python
def test_python_m_trainscale_planner_runs_the_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "trainscale.planner", "--list-models"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("70b ")


def test_an_interleaved_layout_keeps_its_schedule_on_the_laptop(example):
    interleaved = dataclasses.replace(example.best[0], virtual_stages=2)
    flags = planner_cli.laptop_flags(interleaved, 8, peak_flops=1e11)
    after = flags[flags.index("--pp-schedule") + 1 :]
    assert after[:3] == ["interleaved", "--virtual-stages", "2"]
    assert flags[flags.index("--layers") + 1] == "4"  # one layer per stage and chunk: 2 x 2
    assert flags[flags.index("--grad-accum") + 1] == "4"  # a multiple of PP 2
    assert flags[-2:] == ["--peak-flops", "1e+11"]
    if "--tp" in train.parser().format_help():
        assert planner_cli.refusal(flags, 8) is None
    with pytest.raises(ValueError, match="peak_flops"):
        planner_cli.laptop_flags(interleaved, 8, peak_flops=0)


def test_a_llama_shaped_model_is_built_by_the_capstone_as_planned():
    # The capstone takes grouped-query attention and a gated MLP of its own width
    # (issue 24): the command says so, no note is needed, and the runner builds the shape.
    request = planner_cli.parse(["--model", "llama-3-70b", "--top", "1"])
    llama = request.model
    assert planner_cli._shape_note(llama) == []
    assert planner_cli._shape_note(planner.EXAMPLE_MODEL) == []
    plans = planner.plan(llama, request.cluster, request.global_batch)
    layout = planner.top_layouts(plans, 1)[0]
    flags = planner_cli.train_flags(layout, llama, 989e12)
    assert flags[flags.index("--kv-heads") + 1] == "8"
    assert flags[flags.index("--ffn") + 1] == "28672"
    config = train.model_config(train.parse_args(flags))
    assert (config.mlp, config.norm, config.position, config.bias) == (
        "swiglu",
        "rmsnorm",
        "rope",
        False,
    )


def test_a_published_run_is_shown_next_to_the_planners_range_for_it():
    run = next(r for r in published_runs() if r.name == "GPT 22B on 8 A100s, full recompute")
    name = planner_cli.preset_name(run.name)
    request = planner_cli.parse(["--model", name, "--top", "1"])
    assert request.published == run
    estimate = planner.estimate_run(run)
    text = "\n".join(planner_cli.report(request)[0])
    assert (
        f"the published layout, TP {run.tp} x PP {run.pp} x DP {run.dp}: estimated MFU"
        f" {estimate.mfu:.1%} (range {estimate.mfu_low:.1%}-{estimate.mfu_high:.1%}),"
    ) in text
    assert f"published {planner.reported_mfu(run):.1%} (6N)" in text
    # where its shape ranks at its own settings, and in the search the user asked for
    assert f"its shape ranks {estimate.rank} at the run's own settings; in this search, " in text
    assert planner_cli.parse(["--model", name, "--global-batch", "8"]).published is None


def test_a_context_parallel_layout_asks_for_ring_attention_and_experts_are_noted(example):
    best = dataclasses.replace(example.best[0], cp=1)
    split = dataclasses.replace(best, cp=2)
    flags = planner_cli.train_flags(split, example.request.model, 1e15)
    assert flags[flags.index("--cp") + 1] == "2"
    assert "--cp" not in planner_cli.train_flags(best, example.request.model, 1e15)
    moe = dataclasses.replace(
        example.request.model, params=400e9, experts=8, top_k=2, expert_ffn_hidden=4096
    )
    assert "8 experts" in " ".join(planner_cli._shape_note(moe))


def test_the_software_is_a_flag_and_its_fields_can_be_changed(capsys):
    # The book's example plans on the planner's default stack; a published run on its own.
    assert planner_cli.parse(["--model", "70b"]).software is planner.DEFAULT_SOFTWARE
    llama = planner_cli.preset_name("Llama 3 405B on 16,384 H100s, 8K tokens")
    own = planner_cli.parse(["--model", llama])
    assert own.software is planner.SOFTWARE["meta-llama3"] and own.published is not None
    # A changed field names itself; it is no longer the published run's stack.
    changed = planner_cli.parse(["--model", llama, "--gradient-reduce-dtype", "bf16"])
    assert changed.software.gradient_reduce_dtype == "bf16" and changed.published is None
    picked = planner_cli.parse(
        ["--model", "70b", "--software", "torchtitan-fsdp2", "--dropout", "--no-fused-attention"]
    )
    assert picked.software.dropout and not picked.software.fused_attention
    assert picked.software.gradient_reduce_dtype == "fp32"  # the preset's own
    assert picked.software.name.startswith("torchtitan-fsdp2 (")
    # fp32 gradients: twice the gradient bytes on the GPU of the same layout
    lay = planner.evaluate(planner.EXAMPLE_MODEL, planner.EXAMPLE_CLUSTER, 64, 8, 4, 2, 1)
    fp32 = planner.evaluate(
        *(planner.EXAMPLE_MODEL, planner.EXAMPLE_CLUSTER, 64, 8, 4, 2, 1),
        software=picked.software,
    )
    assert fp32.memory_parts["gradients"] == 2 * lay.memory_parts["gradients"]
    with pytest.raises(SystemExit):
        planner_cli.parse(["--model", "70b", "--software", "megatron"])
    assert "--software" in capsys.readouterr().err
    text = "".join(planner_cli.parser().format_help().split())  # wrapped at hyphens
    assert all(name in text for name in planner.SOFTWARE)
    assert "--no-dropout" in text and "--gradient-reduce-dtype" in text
    assert "thefastestthatdoesnot" in text  # the report's parts, in its epilog


def test_405b_on_16384_h100s_finds_metas_shape():
    """Llama 3 405B's preset, as the command line plans it (every interleaving depth, on
    Meta's stack). Without context parallelism, which Meta's 8K-token stage did not use,
    TP 8 x PP 16 x DP 128, the shape Meta trained with, ranks first. With CP searched
    (the default), the same shape with CP 2 over half the DP ranks ranks first: the same
    global batch in twice the micro-batches per pipeline, so a smaller bubble (the cause
    Meta gives for its MFU falling from 8K to 16K GPUs)."""
    llama = planner_cli.preset_name("Llama 3 405B on 16,384 H100s, 8K tokens")
    request = planner_cli.parse(["--model", llama, "--context-parallel", "1"])
    args = (request.model, request.cluster, request.global_batch)
    layouts = planner.plan(
        *args,
        virtual_stages=request.virtual_stages,
        software=request.software,
        context_parallel=request.context_parallel,
    )
    top = planner.top_layouts(layouts, 5)
    assert top[0].shape == (8, 16, 128)
    # one interleaving depth, the old default, leaves it out of the table
    flat = planner.plan(*args, software=request.software, context_parallel=(1,))
    assert (8, 16, 128) not in [lay.shape for lay in planner.top_layouts(flat, 5)]
    every = planner.plan(*args, virtual_stages=request.virtual_stages, software=request.software)
    first = planner.top_layouts(every, 1)[0]
    assert (first.tp, first.cp, first.pp, first.dp) == (8, 2, 16, 64)
    assert first.bubble < top[0].bubble
    # so issue 20's target, Meta's shape among the first five by default, is missed (the
    # appendix prints its rank): the CP-2 shape holds whole fp32 gradients (ZeRO-1), Meta's
    # reduce-scatters them after every micro-batch (ZeRO-2) to fit
    shapes = [lay.shape for lay in planner.top_layouts(every, len(every))]
    rank = shapes.index((8, 16, 128)) + 1
    assert rank > 5
    metas = next(lay for lay in planner.top_layouts(every, len(every)) if lay.shape == (8, 16, 128))
    assert (first.zero_stage, metas.zero_stage) == (1, 2)
    # the command line names it as the fastest shape without context parallelism
    ranked = planner.top_layouts(every, len(every))
    plain = planner_cli.without_context_parallel(ranked, 5)[0]
    assert plain.startswith(f"without context parallelism, the fastest is number {rank}:")
    assert "TP 8 x PP 16 x DP 128, ZeRO-2" in plain


def test_a_full_shape_describes_mixtral_and_counts_its_parameters():
    argv = "--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --gated-mlp"
    argv += " --experts 8 --experts-per-token 2 --vocab 32000 --seq-len 4096"
    model = planner_cli.parse(argv.split()).model
    # per layer 2 h^2 + 2 h (h/32) 8 + 8 experts x 3 h ffn = 33,554,432 + 8,388,608
    # + 1,409,286,144 = 1,451,229,184; x 32 + 2 x 32,000 x 4,096 = 46,701,477,888
    assert model.params == 46_701_477_888
    assert (model.kv_heads, model.ffn_hidden, model.gated_mlp) == (8, 14336, True)
    assert (model.experts, model.top_k) == (8, 2)
    # Mixtral's count adds what the shape leaves out: the routers, 32 x 4,096 x 8 =
    # 1,048,576, and the norms, 32 x 2 x 4,096 + 4,096 = 266,240: 1,314,816 in all
    assert planner.MOE_MODEL.params - model.params == 1_314_816
    assert planner.MOE_MODEL.active_params - model.active_params == 1_314_816


def test_llama_and_mixtral_presets_carry_the_shapes_of_their_sources(capsys):
    found = planner_cli.presets()
    # Dubey et al. Table 3 and the model cards: 8,030,261,248, 70,553,706,496,
    # 405,853,388,800 parameters (norms included)
    counts = {name: found[name].model.params for name in ("llama-3-8b", "llama-3-70b")}
    assert counts == {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496}
    big = found["llama-3-405b"].model
    assert (big.params, big.layers, big.hidden, big.kv_heads) == (405_853_388_800, 126, 16384, 8)
    assert found["llama-3-405b"].software is planner.SOFTWARE["meta-llama3"]
    assert found["mixtral-8x7b"].model == planner.MOE_MODEL
    assert planner_cli.main(["--list-models"]) == 0
    listed = capsys.readouterr().out
    assert "Llama 3 70B (arXiv 2407.21783, Table 3)" in listed
    assert "Mixtral 8x7B (arXiv 2401.04088)" in listed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-heads", "5"], "--kv-heads must divide --heads=64, got 5"),
        (["--experts-per-token", "2"], "--experts-per-token needs --experts"),
        (
            ["--experts", "8", "--experts-per-token", "9"],
            "--experts-per-token must be in [1, --experts = 8]",
        ),
        (["--ffn", "0"], "--ffn must be"),
    ],
)
def test_a_bad_shape_names_its_flag(argv, message):
    with pytest.raises(ValueError) as error:
        planner_cli.parse(["--model", "70b", *argv])
    assert message in str(error.value)


def test_explain_says_why_a_layout_ranks_where_it_does_and_what_limits_it(example):
    lines, _ = planner_cli.report(planner_cli.parse(["--model", "70b", "--explain", "1,1,64"]))
    text = "\n".join(lines)
    shapes = [lay.shape for lay in planner.top_layouts(example.layouts, len(example.layouts))]
    place = shapes.index((1, 1, 64)) + 1  # pure data parallelism over 64 GPUs
    assert f"explain TP 1 x PP 1 x DP 64:\n  its shape ranks {place} of {len(shapes)}" in text
    # no TP: the 70B model's state needs ZeRO-3 and its activations full recomputation
    assert "ZeRO-3, full recompute" in text
    assert "limiting term: recomputation" in text
    first = example.best[0].name.replace("\u00d7", "x")
    assert f"against the first, {first}" in text and "most of it recomputation" in text


def test_explain_names_the_rule_a_layout_breaks_and_the_term_behind_it():
    one_node = ["--model", "70b", "--nodes", "1"]
    lines, _ = planner_cli.report(planner_cli.parse([*one_node, "--explain", "8,1,1"]))
    text = "\n".join(lines)
    # 70B on 8 GPUs: 16 bytes per parameter over TP 8 alone is 130 GiB per GPU of state
    assert "explain TP 8 x PP 1 x DP 1:\n  rejected: its nearest setting" in text
    assert "out of memory: " in text and "the largest part of its memory: optimiser state" in text
    lines, _ = planner_cli.report(planner_cli.parse(["--model", "70b", "--explain", "64,1,1"]))
    assert "TP across nodes: TP 64 spans nodes of 8 GPUs" in "\n".join(lines)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("8,4", "--explain must be TP,PP,DP[,CP,EP,V]"),
        ("8,4,4", "must be the cluster's 64 GPUs, got 8 x 1 x 4 x 4 = 128"),
        ("8,4,2,1,1,0", "--explain's V must be"),
        ("8,x,2", "--explain must be whole numbers"),
    ],
)
def test_a_bad_explain_names_the_flag(spec, message):
    with pytest.raises(ValueError) as error:
        planner_cli.parse(["--model", "70b", "--explain", spec])
    assert message in str(error.value)


# --------------------------------------------------------------------------- --json

SMALL = ["--model", "gpt-22b-on-8-a100s-selective-recompute"]  # 480 layouts: fast


def test_json_is_the_text_report_as_data(capsys):
    assert planner_cli.main([*SMALL, "--json"]) == 0
    printed = capsys.readouterr().out
    data = json.loads(printed)  # strict JSON: no NaN anywhere (main passes allow_nan=False)
    request = planner_cli.parse(SMALL)
    assert (data["text"], data["fits"]) == (planner_cli.report(request)[0], True)
    best = planner.top_layouts(
        planner.plan(
            request.model,
            request.cluster,
            request.global_batch,
            software=request.software,
            virtual_stages=request.virtual_stages,
        ),
        count=request.top,
    )
    assert [lay["name"] for lay in data["best"]] == [
        lay.name.replace("\u00d7", "x") for lay in best
    ]
    first, layout = data["best"][0], best[0]
    assert first["mfu"] == layout.mfu
    assert first["mfu_range"] == list(
        planner.mfu_range(request.model, request.cluster, layout, software=request.software)
    )
    # The parts add up to the totals, as Layout's do.
    assert sum(first["memory_parts"].values()) == pytest.approx(first["memory_bytes"])
    assert sum(first["times"].values()) == pytest.approx(first["step_seconds"])
    assert list(first["times"]) == list(planner.TIME_PARTS)
    assert sum(data["verdicts"].values()) == data["layouts_tried"]
    assert all(lay["verdict"] != "fits" and lay["problems"] for lay in data["rejected"])
    reasons = [lay["verdict"] for lay in data["rejected"]]  # one layout per reason
    assert sorted(reasons) == sorted(v for v, n in data["verdicts"].items() if n and v != "fits")
    assert data["command"]["checked"] and data["command"]["text"] in "\n".join(data["text"])
    assert data["request"]["cluster"]["memory_bytes"] == request.cluster.memory_bytes


def test_json_bad_input_names_the_flag_with_the_command_line_s_message(capsys):
    assert planner_cli.main(["--model", "70b", "--nodes", "0"]) == 2
    message = capsys.readouterr().err.strip().removeprefix("python -m trainscale.planner: error: ")
    assert planner_cli.plan_json(["--model", "70b", "--nodes", "0"]) == {
        "error": message,
        "flag": "--nodes",
    }
    words = planner_cli.plan_json(["--model", "70b", "--nodes", "two"])  # argparse's own
    assert words == {"error": "argument --nodes: invalid float value: 'two'", "flag": "--nodes"}
    missing = planner_cli.plan_json(["--layers", "2"])
    assert missing["flag"] == "--hidden" and missing["error"].startswith("without --model")
    assert planner_cli.plan_json(["--model", "70b", "--zero-stages", "1,5"])["flag"] == (
        "--zero-stages"
    )


def test_max_tp_and_zero_stages_narrow_the_search():
    argv = ["--model", "llama-3-8b", "--max-tp", "2", "--zero-stages", "1,3"]
    data = planner_cli.plan_json(argv)
    assert data["request"]["max_tp"] == 2 and data["request"]["zero_stages"] == [1, 3]
    shown = data["best"] + data["rejected"]
    assert shown and all(lay["tp"] <= 2 and lay["zero_stage"] in (1, 3) for lay in shown)
    assert planner_cli.parse(["--model", "70b"]).zero_stages is None  # default: the software's


def test_list_models_as_json_names_every_preset_gpu_and_stack():
    data = planner_cli.plan_json(["--list-models", "--json"])
    assert list(data["models"]) == list(planner_cli.presets())
    assert data["models"]["70b"]["model"]["layers"] == planner.EXAMPLE_MODEL.layers
    assert data["default_gpu"] in data["gpus"]
    assert "meta-llama3" in data["software"]


@pytest.mark.parametrize(
    ("planned", "ranks", "laptop", "dropped"),
    [
        ((4, 2, 8, 1), 8, (2, 2, 2, 1), []),  # TP, CP and PP each get a factor
        ((4, 2, 8, 1), 4, (2, 2, 1, 1), ["PP"]),  # no factor left for PP: said
        ((1, 8, 8, 1), 8, (1, 4, 2, 1), []),  # the third factor to the one furthest below
    ],
)
def test_the_laptop_keeps_context_parallelism_or_says_what_it_drops(
    planned, ranks, laptop, dropped
):
    tp, cp, pp, dp = planned
    layout = SimpleNamespace(tp=tp, cp=cp, pp=pp, dp=dp, ep=1, virtual_stages=1)
    layout.zero_stage, layout.recompute = 1, "none"
    degrees = planner_cli.laptop_degrees(layout, ranks)
    assert tuple(degrees.values()) == laptop
    assert planner_cli.laptop_drops(layout, ranks) == dropped
    flags = planner_cli.laptop_flags(layout, ranks)
    config = train.parse_args(flags)
    assert config.layout(ranks).cp == laptop[1]
    assert config.seq_len % (2 * laptop[1]) == 0
    lines = "\n".join(planner_cli._laptop_lines(layout, ranks))
    assert ("but " + ", ".join(dropped)) in lines if dropped else "the same kinds" in lines


TINY_PLAN = [
    *("--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512"),
    *("--gated-mlp", "--seq-len", "128", "--vocab", "1024", "--nodes", "1"),
    *("--global-batch", "16", "--top", "1"),
]
"""A Llama-shaped model small enough for a fake-world step in a second or two."""


def test_check_memory_runs_the_printed_command_under_torchs_tracker(capsys):
    assert planner_cli.main([*TINY_PLAN, "--check-memory"]) == 0
    out = capsys.readouterr().out
    assert "the command's step under torch's tracker: TP" in out
    assert "the tracker's total fits the GPU's 79.6 GiB" in out


def test_check_memory_refuses_a_command_its_gpu_cannot_hold():
    request = planner_cli.parse([*TINY_PLAN, "--check-memory"])
    (layout,) = planner.top_layouts(
        planner.plan(request.model, request.cluster, request.global_batch), 1
    )
    small = dataclasses.replace(request.cluster, memory_bytes=2**20)  # a 1 MiB GPU
    lines, holds = planner_cli._tracked_lines(layout, dataclasses.replace(request, cluster=small))
    assert not holds
    assert lines[-2] == "  the tracker's total does not fit the GPU's 0.0 GiB"
    assert lines[-1] == "refused: the command would run out of memory"


def test_the_command_comes_from_further_down_the_runners_ranking_if_needed(monkeypatch):
    # the runner's own fastest layout for the book's 70B, found by scanning its ranking
    request = planner_cli.parse(["--model", "70b", "--top", "1"])
    rank, layout, _ = planner_cli._first_runnable(request)
    assert rank == 1 and layout == planner_cli._runner_best(request)[0]
    # when none of the layouts shown runs, the command is for the first one that does
    monkeypatch.setattr(planner_cli, "_runner_best", lambda request: [])
    text = "\n".join(planner_cli.report(request)[0])
    assert "note: the fastest layout trainscale.train runs is number 1 on its stack" in text
    assert f"to train layout 1, {layout.name.replace(chr(215), 'x')}" in text
    # three sequences on 64 GPUs: no layout the runner can hold runs (DP 1, and an
    # interleaved pipeline needs a multiple of its stages in micro-batches)
    few = planner_cli.parse(["--model", "70b", "--global-batch", "3"])
    assert planner_cli._first_runnable(few) is None


def test_a_layout_the_runners_engine_refuses_is_noted_with_its_reason():
    # ZeRO-2 with a pipeline: Meta's stack runs it, the capstone's (torchtitan's) refuses
    request = planner_cli.parse(["--model", "70b", "--software", "meta-llama3"])
    args = (request.model, request.cluster, request.global_batch, 8, 2, 4)
    layout = planner.evaluate(*args, zero_stage=2, software=request.software)
    assert layout.verdict == "fits"
    place, notes, _ = planner_cli._runnable([layout], request)
    assert place is None
    assert notes[0].endswith("refuses ZeRO-2 with pipeline parallelism")
    assert "nan" not in notes[0]


def test_without_context_parallelism_is_named_only_when_every_shape_shown_splits_the_sequence():
    request = planner_cli.parse(["--model", "70b"])
    layouts = planner_cli._search(request, request.software)
    ranked = planner.top_layouts(layouts, len(layouts))
    assert planner_cli.without_context_parallel(ranked, 5) == []  # CP 1 shapes among them
    split = [lay for lay in ranked if lay.cp > 1]
    assert planner_cli.without_context_parallel(split, 5)[0].startswith("every fitting shape")


def test_a_gpu_count_no_layout_can_split_names_the_rules_and_the_flags():
    # 83 nodes of 8: the prime 83 divides no head count, no batch of 1,024, and is over the
    # 82 stages of 80 layers
    lines, found = planner_cli.report(planner_cli.parse(["--model", "70b", "--nodes", "83"]))
    assert not found
    text = "\n".join(lines)
    assert "no split of the 664 GPUs into TP x CP x PP x DP" in text
    assert "TP divides the 64 heads, DP the 1,024 sequences, PP at most 82 stages" in text
    assert "--nodes or --global-batch" in text and "add GPUs" not in text


def test_gpt3_175b_is_a_preset_and_its_command_pads_and_unties_as_it_must():
    # Brown et al. Table 2.1: 96 x (12 x 12,288^2) + 50,257 x 12,288 (tied) + 2,048 x 12,288
    # (learned positions) = 173,946,175,488 + 617,558,016 + 25,165,824 = 174,588,899,328
    gpt3 = planner_cli.presets()["gpt-3-175b"].model
    assert gpt3 == planner.GPT3_175B and gpt3.params == 174_588_899_328
    assert (gpt3.layers, gpt3.hidden, gpt3.heads, gpt3.seq_len) == (96, 12288, 96, 2048)
    request = planner_cli.parse(["--model", "gpt-3-175b"])
    args = (request.model, request.cluster, request.global_batch)
    split = planner.evaluate(*args, 4, 8, 16, virtual_stages=6)
    flags = planner_cli.train_flags(split, gpt3, 989e12)
    # 50,257 padded to a multiple of 128 x 4 = 512: 99 x 512 = 50,688; untied with TP or PP
    assert flags[flags.index("--vocab") + 1] == "50688" and "--tied" not in flags
    notes = " ".join(planner_cli._shape_note(gpt3, split))
    assert "untied (0.4% more parameters)" in notes and "padded to 50,688" in notes
    assert train.parse_args(flags).vocab == 50688  # the capstone takes it
    whole = planner.evaluate(*args, 1, 1, 512, zero_stage=3)
    flags = planner_cli.train_flags(whole, gpt3, 989e12)
    assert "--tied" in flags and flags[flags.index("--vocab") + 1] == "50257"
    assert planner_cli._shape_note(gpt3, whole) == []
