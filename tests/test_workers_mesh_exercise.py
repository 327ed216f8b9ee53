"""workers.mesh_exercise, beyond what notebook 16 shows when it runs the reference solution
on 8 real ranks: typical wrong solutions fail by themselves and on real ranks, each with a
message naming the layout, the rank, the group, expected and got; bad arguments are refused
before any rank starts."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import train
from trainscale.workers import mesh_exercise as ex


def transposed(sizes, rank):  # the first dimension varies fastest: rows and columns swapped
    names = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    strides = [1]
    for size in sizes[:-1]:
        strides.append(strides[-1] * size)
    coords = [rank // s % n for s, n in zip(strides, sizes, strict=True)]
    groups = {}
    for d, name in enumerate(names):
        first = rank - coords[d] * strides[d]
        groups[name] = [first + i * strides[d] for i in range(sizes[d])]
    first = rank - coords[1] * strides[1] - coords[2] * strides[2]
    groups["dp"] = [
        first + i * strides[1] + j * strides[2] for i in range(sizes[1]) for j in range(sizes[2])
    ]
    return groups


def off_by_one(sizes, rank):  # ranks counted from 1
    return {
        name: [r + 1 for r in ranks] for name, ranks in ex.reference_groups(sizes, rank).items()
    }


def raising(sizes, rank):
    raise KeyError("tp")


def test_the_dimension_names_are_the_capstones():
    assert ex.DIMS == train.DIMS


def test_the_reference_solution_passes_by_itself():
    assert ex.check_alone(ex.reference_groups) == []


def test_groups_by_hand():
    # TP 2 x PP 2 x DP 2 on 8 ranks, mesh [pp, dp_replicate, dp_shard, cp, tp] = [2, 1, 2, 1, 2]:
    # rank 5 = (pp 1, dp_shard 0, tp 1): tp neighbours 4, 5; dp_shard 5, 7; stage partner 1, 5.
    got = ex.array_groups((2, 1, 2, 1, 2), 5)
    assert got == {
        "pp": [1, 5],
        "dp_replicate": [5],
        "dp_shard": [5, 7],
        "cp": [5],
        "tp": [4, 5],
        "dp": [5, 7],
    }
    # HSDP 2 x 2 with CP 2, [1, 2, 2, 2, 1]: the data-parallel group of rank 3 skips the CP
    # ranks: 1, 3, 5, 7 (replicate strides 4, shard strides 2).
    assert ex.array_groups((1, 2, 2, 2, 1), 3)["dp"] == [1, 3, 5, 7]


@given(
    st.lists(st.integers(1, 3), min_size=5, max_size=5),
    st.integers(0, 242),
)
def test_the_reference_agrees_with_the_array_on_any_mesh(sizes, rank):
    rank %= math.prod(sizes)
    assert ex.reference_groups(sizes, rank) == ex.array_groups(sizes, rank)


def test_a_transposed_solution_is_told_the_last_dimension_varies_fastest():
    first, *_ = ex.check_alone(transposed)
    assert first == (
        "pp 2 x dp_shard 2 x tp 2 (sizes [2, 1, 2, 1, 2]), rank 0, 'pp': expected [0, 4],"
        " got [0, 1] (the first dimension varies fastest here; in the mesh the last, tp, does)"
    )


def test_an_off_by_one_solution_names_rank_group_expected_and_got():
    first, *_ = ex.check_alone(off_by_one)
    assert first.startswith("pp 2 x dp_shard 2 x tp 2 (sizes [2, 1, 2, 1, 2]), rank 0, 'pp'")
    assert "expected [0, 4], got [1, 5]" in first


def test_a_raising_solution_says_what_it_raised():
    problems = ex.check_alone(raising)
    assert problems[0] == "mesh_groups([2, 1, 2, 1, 2], 0) raised KeyError: 'tp'"
    assert len(problems) == len(ex.LAYOUTS)


def test_missing_groups_wrong_types_and_another_order_are_reported():
    assert (
        "no group for ['dp']"
        in ex.check_alone(
            lambda s, r: {k: v for k, v in ex.reference_groups(s, r).items() if k != "dp"}
        )[0]
    )
    assert "not a dict" in ex.check_alone(lambda s, r: [0])[0]
    assert (
        "another order"
        in ex.check_alone(lambda s, r: {k: v[::-1] for k, v in ex.reference_groups(s, r).items()})[
            0
        ]
    )


def test_bad_arguments_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="sizes must hold 5 sizes"):
        ex.array_groups((2, 2), 0)
    with pytest.raises(ValueError, match=r"rank must be in 0 \.\. 7"):
        ex.array_groups((2, 1, 2, 1, 2), 8)
    with pytest.raises(ValueError, match="same number of ranks"):
        ex.check_mesh_groups(ex.reference_groups, [(2, 1, 1, 1, 1), (2, 1, 2, 1, 1)])


@pytest.mark.slow
def test_on_real_ranks_the_reference_passes_and_a_transposed_solution_fails():
    assert ex.check_mesh_groups(ex.reference_groups).passed
    report = ex.check_mesh_groups(transposed)
    assert not report.passed
    text = str(report)
    assert (
        "on 8 gloo ranks: pp 2 x dp_shard 2 x tp 2 (sizes [2, 1, 2, 1, 2]), rank 0, 'pp':"
        " expected [0, 4], got [0, 1]" in text
    )


@pytest.mark.slow
def test_on_real_ranks_a_raising_solution_fails_without_hanging_the_others():
    report = ex.check_mesh_groups(raising)
    assert not report.passed
    assert "on 8 gloo ranks: mesh_groups([2, 1, 2, 1, 2], 0) raised KeyError: 'tp'" in str(report)
