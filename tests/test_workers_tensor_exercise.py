"""workers.tensor_exercise, beyond what chapter 8 shows when it runs the reference
solution: four typical wrong tensor-parallel MLPs fail on real ranks (one run of 4 gloo
ranks for all five functions), each with the PROBLEM line that says why; the inputs,
the shards, the one-process reference and the refusals of bad arguments need no
process."""

import pytest
import torch
import torch.distributed as dist

from trainscale.distributed import RankError
from trainscale.workers import tensor_exercise as ex


def gelu_after_the_sum(x, w_i, u_i):
    z = x @ w_i @ u_i
    dist.all_reduce(z)
    return torch.nn.functional.gelu(z)


def two_all_reduces(x, w_i, u_i):
    hidden = x @ w_i
    dist.all_reduce(hidden)  # sums different hidden units
    z = torch.nn.functional.gelu(hidden) @ u_i
    dist.all_reduce(z)
    return z


def gather_the_weights(x, w_i, u_i):
    w_up = [torch.empty_like(w_i) for _ in range(dist.get_world_size())]
    dist.all_gather(w_up, w_i)
    return torch.nn.functional.gelu(x @ torch.cat(w_up, dim=1))


def no_all_reduce(x, w_i, u_i):
    return torch.nn.functional.gelu(x @ w_i) @ u_i


@pytest.mark.slow
def test_the_reference_passes_and_four_wrong_mlps_say_why():
    functions = [
        ex.reference_parallel_mlp,
        gelu_after_the_sum,
        two_all_reduces,
        gather_the_weights,
        no_all_reduce,
    ]
    right, after, twice, gather, partial = (str(r) for r in ex.check_parallel_mlps(functions))
    assert right.endswith("passed") and "PROBLEM" not in right
    # 6 tokens x 8 values x 8 bytes (float64) = 384 bytes, once per rank.
    assert "each rank called dist.all_reduce once, on 384 bytes" in right
    assert "PROBLEM: on every rank, the output is GELU(X W_up W_down)" in after
    assert "ok: each rank called dist.all_reduce once" in after  # the communication was right
    assert "PROBLEM: on every rank, the output sums the hidden slices X W_i" in twice
    # Two calls: the 6 x 12 hidden slice (576 bytes) and the 6 x 8 output (384): 960.
    assert "PROBLEM: dist.all_reduce calls per rank [2, 2, 2, 2], [960, 960, 960, 960]" in twice
    assert "PROBLEM: on every rank, your parallel_mlp called dist.all_gather" in gather
    assert "the output is the rank's own partial output GELU(X W_i) U_i alone" in partial
    assert "PROBLEM: dist.all_reduce calls per rank [0, 0, 0, 0]" in partial
    wrong = (after, twice, gather, partial)
    assert all(text.endswith("not yet: see the problems above") for text in wrong)


def test_the_shards_put_back_together_are_the_whole_weights():
    x, w_up, w_down = ex.exercise_inputs()
    assert x.dtype == w_up.dtype == w_down.dtype == torch.float64
    blocks = [ex.shard(w_up, w_down, r, 4) for r in range(4)]
    assert [tuple(w.shape) for w, _ in blocks] == [(8, 12)] * 4  # 48 columns / 4 ranks
    assert torch.equal(torch.cat([w for w, _ in blocks], dim=1), w_up)
    assert torch.equal(torch.cat([v for _, v in blocks], dim=0), w_down)
    assert torch.equal(ex.exercise_inputs()[0], x)  # seeded: the same on every call


def test_the_reference_output_by_hand():
    # X = [1, -1], W_up = identity (2 hidden units), W_down = [[1], [1]]:
    # Z = GELU(1) + GELU(-1) = 0.841345 - 0.158655 = 0.682689 (Phi(1) - Phi(-1)).
    x = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    w_up = torch.eye(2, dtype=torch.float64)
    w_down = torch.ones(2, 1, dtype=torch.float64)
    assert ex.reference_output(x, w_up, w_down).item() == pytest.approx(0.682689, abs=1e-6)


def test_each_known_mistake_is_named_and_a_right_output_passes():
    x, w_up, w_down = ex.exercise_inputs()
    assert ex._output_problem(ex.reference_output(x, w_up, w_down), 2, 4, 0) is None
    mistakes = ex.known_mistakes(x, w_up, w_down, 2, 4)
    assert len(mistakes) == 4
    for output, why in mistakes:
        assert ex._output_problem(output, 2, 4, 0) == f"the output {why}"
    noisy = ex.reference_output(x, w_up, w_down) + 1e-3
    assert ex._output_problem(noisy, 2, 4, 0) == pytest.approx(1e-3)  # unexplained: how far
    assert "not a tensor of (6, 8)" in ex._output_problem(x[:, :4], 0, 4, 0)


def test_the_report_groups_ranks_without_processes():
    # Rank 1 alone is off by 1e-3; the others are right; one all-reduce of 384 bytes each.
    x, w_up, w_down = ex.exercise_inputs()
    z = ex.reference_output(x, w_up, w_down)
    found = [{"output": z + 1e-3 * (r == 1), "calls": 1, "bytes": 384} for r in range(4)]
    text = str(ex._report(found, 0, "title"))
    assert "PROBLEM: on ranks [1], the output differs from Z = GELU(X W_up) W_down" in text
    assert "by up to 0.001" in text and "ok: each rank called dist.all_reduce once" in text


def test_a_hang_is_reported_with_a_hint(monkeypatch):
    def hangs(*args, **kwargs):
        raise RankError("ranks [1, 2, 3] did not finish within 3 s")

    monkeypatch.setattr(ex, "run_ranks", hangs)
    (report,) = ex.check_parallel_mlps([ex.reference_parallel_mlp], timeout=3)
    assert "did not finish within 3 s: a rank waits in an all_reduce" in str(report)


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="ranks"):
        ex.check_parallel_mlp(ex.reference_parallel_mlp, ranks=1)
    with pytest.raises(ValueError, match="ranks must divide the MLP width 48"):
        ex.check_parallel_mlp(ex.reference_parallel_mlp, ranks=5)
    with pytest.raises(ValueError, match="function"):
        ex.check_parallel_mlp(print)
    with pytest.raises(ValueError, match="functions"):
        ex.check_parallel_mlps([])
    _, w_up, w_down = ex.exercise_inputs()
    with pytest.raises(ValueError, match=r"rank must be in 0 \.\. 3"):
        ex.shard(w_up, w_down, 4, 4)
