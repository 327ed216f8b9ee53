"""workers.experts_exercise, beyond what chapter 11 shows when it runs the reference
solution: three typical wrong dispatches fail on real ranks (one run of 4 gloo ranks for
all four functions), each with the PROBLEM line that says why; the inputs, the plain
reference and the refusals of bad arguments need no process."""

import pytest
import torch
import torch.distributed as dist

from trainscale.distributed import RankError
from trainscale.workers import experts_exercise as ex


def grouped_by_source(tokens, expert_of_token, experts_per_rank):
    # Right exchange, but the rows are left as all_to_all_single leaves them.
    n = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    per_expert = torch.bincount(expert_of_token, minlength=n * experts_per_rank)
    counts = torch.empty_like(per_expert)
    dist.all_to_all_single(counts, per_expert)
    send = per_expert.view(n, -1).sum(dim=1).tolist()
    receive = counts.view(n, -1).sum(dim=1).tolist()
    rows = tokens.new_empty(sum(receive), tokens.shape[1])
    dist.all_to_all_single(rows, tokens[order], receive, send)
    return rows


def no_counts(tokens, expert_of_token, experts_per_rank):
    # Assumes a rank receives as many rows from each rank as it sends to it.
    n = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)
    send = torch.bincount(expert_of_token // experts_per_rank, minlength=n).tolist()
    rows = torch.empty_like(tokens)
    dist.all_to_all_single(rows, tokens[order], send, send)
    return rows


def gather_all(tokens, expert_of_token, experts_per_rank):
    everything = [torch.empty_like(tokens) for _ in range(dist.get_world_size())]
    dist.all_gather(everything, tokens)
    return tokens


@pytest.mark.slow
def test_the_reference_passes_and_three_wrong_dispatches_say_why():
    functions = [ex.reference_dispatch, grouped_by_source, no_counts, gather_all]
    right, order, counts, gather = (str(r) for r in ex.check_dispatches(functions))
    assert right.endswith("passed") and "PROBLEM" not in right
    # 11, 9, 14, 12 rows of 4 float64 values: 32 bytes a row, 352, 288, 448, 384 bytes.
    assert "[352, 288, 448, 384] bytes (32 a row)" in right
    assert "PROBLEM: rank 1 received the right rows in another order: grouped by source" in order
    assert "twice: the counts, then the rows" in order  # the exchange itself was right
    assert "PROBLEM: rank 0's all_to_all_single of the rows was told to receive" in counts
    assert "exchange the counts first" in counts
    assert "PROBLEM: your dispatch called dist.all_gather" in gather
    assert all(text.endswith("not yet: see the problems above") for text in (order, counts, gather))


def test_the_inputs_are_uneven_and_leave_an_expert_without_rows():
    inputs = [ex.exercise_inputs(r, 4) for r in range(4)]
    assert [len(x) for x, _ in inputs] == [11, 9, 14, 12]  # 8 + (5r + 3) mod 7
    loads = torch.bincount(torch.cat([e for _, e in inputs]), minlength=8).tolist()
    assert loads[5] == 0  # weight (5 x 5 + 3) mod 7 = 0
    assert len(set(loads)) > 2
    again = ex.exercise_inputs(2, 4)
    assert torch.equal(again[0], inputs[2][0]) and torch.equal(again[1], inputs[2][1])


def test_expected_rows_by_hand():
    # 2 ranks, 2 experts each. Rank 0's rows go to experts [3, 0, 1, 0], rank 1's to [1, 2].
    # Rank 0 holds experts 0, 1: expert 0 gets rows 1, 3 of rank 0; expert 1 gets row 2 of
    # rank 0, then row 0 of rank 1. Rank 1 (experts 2, 3): row 1 of rank 1, row 0 of rank 0.
    experts = [[3, 0, 1, 0], [1, 2]]
    assert ex.expected_rows(experts, 0, 2) == [(0, 1), (0, 3), (0, 2), (1, 0)]
    assert ex.expected_rows(experts, 1, 2) == [(1, 1), (0, 0)]


def test_a_hang_is_reported_with_a_hint(monkeypatch):
    def hangs(*args, **kwargs):
        raise RankError("ranks [1, 2, 3] did not finish within 3 s")

    monkeypatch.setattr(ex, "run_ranks", hangs)
    (report,) = ex.check_dispatches([ex.reference_dispatch], timeout=3)
    assert "did not finish within 3 s: a rank waits in an all_to_all_single" in str(report)


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="ranks"):
        ex.check_dispatch(ex.reference_dispatch, ranks=1)
    with pytest.raises(ValueError, match="function"):
        ex.check_dispatch(print)
    with pytest.raises(ValueError, match=r"rank must be in 0 \.\. 3"):
        ex.exercise_inputs(4, 4)
    with pytest.raises(ValueError, match="functions"):
        ex.check_dispatches([])
