"""The capstone training script: deterministic data, checkpoints, and a crash that changes nothing.

The last tests start the real script under ``torchrun`` (two gloo processes),
once straight through and once with a rank killed mid-run and restarted by
torchrun, and require the two runs to end with bitwise equal weights.
"""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from trainscale import schedule, train
from trainscale.transformer import GPTConfig, gpt

# --------------------------------------------------------------------------- the data


def test_the_same_step_always_gets_the_same_batch():
    first = train.global_batch(seed=3, step=7, sequences=16, seq_len=32, vocab=64, strides=4)
    again = train.global_batch(seed=3, step=7, sequences=16, seq_len=32, vocab=64, strides=4)
    assert first.shape == (16, 33) and first.dtype == torch.int64
    assert torch.equal(first, again)
    other_step = train.global_batch(seed=3, step=8, sequences=16, seq_len=32, vocab=64, strides=4)
    other_seed = train.global_batch(seed=4, step=7, sequences=16, seq_len=32, vocab=64, strides=4)
    assert not torch.equal(first, other_step)
    assert not torch.equal(first, other_seed)


@given(
    seed=st.integers(0, 2**32),
    step=st.integers(0, 10**9),
    sequences=st.integers(1, 40),
    seq_len=st.integers(1, 40),
    vocab=st.integers(2, 1000),
    data=st.data(),
)
def test_every_row_counts_up_by_one_stride(seed, step, sequences, seq_len, vocab, data):
    strides = data.draw(st.integers(1, vocab - 1))
    batch = train.global_batch(seed, step, sequences, seq_len, vocab, strides)
    assert batch.shape == (sequences, seq_len + 1)
    assert batch.min() >= 0 and batch.max() < vocab
    steps = (batch[:, 1:] - batch[:, :-1]) % vocab  # the stride of each row, at every position
    assert torch.equal(steps, steps[:, :1].expand_as(steps))
    assert steps.min() >= 1 and steps.max() <= strides


@given(
    world_size=st.integers(1, 5),
    grad_accum=st.integers(1, 4),
    per_micro=st.integers(1, 3),
    step=st.integers(0, 1000),
)
def test_ranks_and_micro_steps_cover_the_global_batch_once(world_size, grad_accum, per_micro, step):
    rows = world_size * grad_accum * per_micro
    batch = train.global_batch(0, step, rows, 8, 64, 4)
    kept = batch.clone()
    pieces = []
    for rank in range(world_size):
        for micro in range(grad_accum):
            inputs, targets = train.micro_batch(batch, rank, world_size, grad_accum, micro)
            assert inputs.shape == targets.shape == (per_micro, 8)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets: inputs moved by one
            pieces.append(torch.cat([inputs, targets[:, -1:]], dim=1))
    assert torch.equal(torch.cat(pieces), batch)  # in order, each row exactly once
    assert torch.equal(batch, kept)  # the global batch is left as it was


def test_the_hand_worked_slice():
    # 2 ranks x 2 micro-steps x 3 rows = 12 rows: rank 1, micro-step 0 owns rows 6, 7, 8.
    batch = torch.arange(12 * 4).reshape(12, 4)
    inputs, targets = train.micro_batch(batch, rank=1, world_size=2, grad_accum=2, micro_step=0)
    assert inputs[:, 0].tolist() == [24, 28, 32]
    assert torch.equal(targets, batch[6:9, 1:])


def test_the_loss_floor():
    # ln 4 / 32: only the first of 32 targets is uncertain, among 4 equally likely strides.
    assert train.loss_floor(32, 4) == pytest.approx(0.04332169878499658, rel=1e-15)
    assert train.loss_floor(10, 1) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": -1}, "seed"),
        ({"step": 1.5}, "step"),
        ({"sequences": 0}, "sequences"),
        ({"seq_len": 0}, "seq_len"),
        ({"vocab": 1, "strides": 1}, "vocab"),
        ({"strides": 64}, "strides"),
        ({"strides": 0}, "strides"),
    ],
)
def test_bad_data_arguments_are_named(kwargs, name):
    arguments = {"seed": 0, "step": 0, "sequences": 4, "seq_len": 8, "vocab": 64, "strides": 4}
    with pytest.raises(ValueError, match=rf"^{name} must"):
        train.global_batch(**{**arguments, **kwargs})


def test_bad_slices_are_named():
    batch = train.global_batch(0, 0, 8, 4, 64, 4)
    with pytest.raises(ValueError, match=r"^rank must be in"):
        train.micro_batch(batch, 2, 2, 2, 0)
    with pytest.raises(ValueError, match=r"^micro_step must be in"):
        train.micro_batch(batch, 0, 2, 2, 2)
    with pytest.raises(ValueError, match=r"^batch must have a multiple of"):
        train.micro_batch(batch, 0, 3, 1, 0)
    with pytest.raises(ValueError, match=r"^world_size must"):
        train.micro_batch(batch, 0, 0, 1, 0)


# --------------------------------------------------------------------------- the model


def test_the_model_is_the_books_decoder_with_fused_attention_and_an_untied_head():
    # The model itself (parameter counts, causality, recomputation) is tested in
    # test_transformer.py; here, that the flags describe it.
    assert train.model_config(train.parse_args([])) == GPTConfig(
        vocab=64, context=32, d_model=64, layers=2, heads=4, tied=False, attention="sdpa"
    )
    flags = ["--width", "48", "--heads", "3", "--seq-len", "8", "--checkpoint-activations"]
    config = train.model_config(train.parse_args(flags))
    assert (config.d_model, config.heads, config.context) == (48, 3, 8)
    assert config.recompute == "full"


def _parameter_names() -> list[str]:
    """The names of the default model's parameters, as a full checkpoint lists them."""
    return [name for name, _ in gpt(train.model_config(train.parse_args([]))).named_parameters()]


# --------------------------------------------------------------------------- arguments, folders


def test_the_defaults_are_valid():
    args = train.parse_args([])
    assert (args.parallel, args.steps, args.micro_batch, args.grad_accum) == ("ddp", 100, 8, 1)
    assert train.tokens_per_step(args, world_size=2) == 2 * 1 * 8 * 32 == 512


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--parallel", "zero3"], "--parallel"),
        (["--steps", "0"], "--steps"),
        (["--steps", "5", "--warmup", "5"], "--warmup"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--lr", "0"], "--lr"),
        (["--lr-floor", "1.5"], "--lr-floor"),
        (["--clip", "-1"], "--clip"),
        (["--clip", "inf"], "--clip"),
        (["--weight-decay", "nan"], "--weight-decay"),
        (["--width", "30"], "--width"),
        (["--strides", "64"], "--strides"),
        (["--peak-flops", "0"], "--peak-flops"),
        (["--ckpt-every", "0"], "--ckpt-every"),
        (["--fail-at-step", "-2"], "--fail-at-step"),
    ],
)
def test_bad_flags_are_named(argv, flag):
    with pytest.raises(ValueError, match=f"^{flag} must"):
        train.parse_args(argv)


def test_only_complete_checkpoints_count(tmp_path):
    assert train.latest_checkpoint(tmp_path) is None
    assert train.latest_checkpoint(tmp_path / "missing") is None
    assert train.latest_checkpoint(None) is None
    for name in ("step_00000003", "step_00000012", "step_00000015.partial", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_00000020").write_text("a file, not a checkpoint folder")
    assert train.checkpoint_path(tmp_path, 12) == tmp_path / "step_00000012"
    assert [s for s, _ in train.complete_checkpoints(tmp_path)] == [3, 12]
    assert train.latest_checkpoint(tmp_path) == (12, tmp_path / "step_00000012")


def test_clipping_scales_the_global_norm_down_and_reports_it_before():
    model = torch.nn.Linear(2, 1, bias=False)
    for clip, after in ((0.0, [3.0, 4.0]), (1.0, [0.6, 0.8]), (10.0, [3.0, 4.0])):
        model.weight.grad = torch.tensor([[3.0, 4.0]])
        assert train._grad_norm(model, clip) == 5.0  # sqrt(3^2 + 4^2), before clipping
        assert model.weight.grad.flatten().tolist() == pytest.approx(after, rel=1e-6)


# --------------------------------------------------------------------------- one process


@pytest.fixture
def one_rank(monkeypatch):
    """A process group of this process alone, so the training loop runs in the test."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(tmp_path: Path, name: str, *flags: str) -> dict:
    argv = [
        *("--steps", "6", "--warmup", "1", "--ckpt-every", "3", "--micro-batch", "2"),
        *("--ckpt-dir", str(tmp_path / name), "--final-weights", str(tmp_path / f"{name}.pt")),
        *flags,
    ]
    return train.train(train.parse_args(argv), 0, 1, torch.device("cpu"))


IN_PROCESS = {
    "ddp": ["--parallel", "ddp", "--grad-accum", "2", "--clip", "0"],
    "fsdp": ["--parallel", "fsdp", "--bf16", "--checkpoint-activations"],
}


@pytest.mark.slow  # two short training runs with checkpoints, in this process
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, one_rank, capsys, parallel):
    straight = _train(tmp_path, "a", *IN_PROCESS[parallel])
    assert straight["resumed_from"] is None and straight["steps"] == 6
    assert [s for s, _ in train.complete_checkpoints(tmp_path / "a")] == [3, 6]  # keep 2
    # Start again from the checkpoint taken after step 3, next to an unfinished save.
    shutil.copytree(tmp_path / "a" / "step_00000003", tmp_path / "b" / "step_00000003")
    (tmp_path / "b" / "step_00000006.partial").mkdir()
    resumed = _train(tmp_path, "b", *IN_PROCESS[parallel])
    assert resumed == {**straight, "resumed_from": 3}  # the same final loss, norm and lr
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert list(a) == list(b) == _parameter_names()
    assert all(torch.equal(a[name], b[name]) for name in a)
    out = capsys.readouterr().out
    assert "attempt 0: resumed from step 3 (checkpoint step_00000003)" in out
    last = f"step     6/6 | loss {straight['loss']:.4f} | grad norm {straight['grad_norm']:.4f}"
    assert out.count(last) == 2  # logged by both runs
    assert f"lr {schedule.learning_rate(5, 3e-3, 1, 6):.2e} | " in out


def test_a_checkpoint_of_another_run_is_refused(tmp_path, one_rank):
    _train(tmp_path, "a", "--steps", "2", "--parallel", "fsdp", "--clip", "0")
    with pytest.raises(ValueError, match="written with seed=0, but this run has seed=1"):
        _train(tmp_path, "a", "--steps", "2", "--parallel", "fsdp", "--seed", "1")


# --------------------------------------------------------------------------- real runs
# The crash-and-restart run under torchrun (two ranks, rank 1 killed mid-run, elastic
# restart from the last checkpoint, bitwise-equal final weights) is chapter 13's "check
# it for real" cell, which nbval re-runs and compares line by line; it is not run again
# here. The tests above cover the same checkpoint round trip in one process, bf16 included.
