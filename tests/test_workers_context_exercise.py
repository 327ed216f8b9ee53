"""workers.context_exercise, beyond what notebook 14 shows when it runs the reference
solution on 4 real ranks: typical wrong solutions fail by themselves and on real ranks,
each with a message that says what is wrong; the source travels as text; bad arguments
are refused before any rank starts."""

import pytest

from trainscale.context import token_positions
from trainscale.workers import context_exercise as ex


def zigzag(seq_len, ranks, rank):
    chunk = seq_len // (2 * ranks)
    early, late = rank, 2 * ranks - 1 - rank
    return [
        *range(early * chunk, (early + 1) * chunk),
        *range(late * chunk, (late + 1) * chunk),
    ]


def contiguous(seq_len, ranks, rank):
    local = seq_len // ranks
    return list(range(rank * local, (rank + 1) * local))


def striped(seq_len, ranks, rank):  # chunks r and r + N: every token once, work uneven
    chunk = seq_len // (2 * ranks)
    late = rank + ranks
    return [*range(rank * chunk, (rank + 1) * chunk), *range(late * chunk, (late + 1) * chunk)]


def mirrored_in_half(seq_len, ranks, rank):  # chunks r and N - 1 - r: tokens held twice
    chunk = seq_len // (2 * ranks)
    late = ranks - 1 - rank
    return [*range(rank * chunk, (rank + 1) * chunk), *range(late * chunk, (late + 1) * chunk)]


def late_chunk_first(seq_len, ranks, rank):
    return (
        zigzag(seq_len, ranks, rank)[seq_len // (2 * ranks) :]
        + zigzag(seq_len, ranks, rank)[: seq_len // (2 * ranks)]
    )


def test_the_reference_solution_and_a_correct_one_pass_by_themselves():
    assert ex.check_alone(ex.reference_positions) == []
    assert ex.check_alone(zigzag) == []


def test_causal_pairs_by_hand():
    # Rank 0 of 4 on 16 tokens holds 0, 1, 14, 15: it sees 1 + 2 + 15 + 16 = 34 keys;
    # every rank does, and all four hold 16 x 17 / 2 = 136 pairs between them.
    pairs = [ex.causal_pairs(token_positions(16, 4, r, "zigzag")) for r in range(4)]
    assert pairs == [34, 34, 34, 34]


def test_the_contiguous_split_is_named():
    problems = ex.check_alone(contiguous)
    assert problems and all("contiguous split" in p for p in problems if "pairs" in p)
    # On 1 rank both splits agree; 4 tokens on 2 ranks: rank 0 holds 0, 1 (1 + 2 = 3
    # visible pairs), rank 1 holds 2, 3 (3 + 4 = 7).
    assert problems[0].startswith("4 tokens on 2 ranks: visible (query, key) pairs per rank [3, 7]")


def test_a_striped_split_is_told_to_mirror_the_late_chunk():
    problems = ex.check_alone(striped)
    assert problems and "2c - 1 - r" in problems[0] and "not equal" in problems[0]


def test_tokens_held_twice_are_listed_with_the_missing_ones():
    (first, *_) = ex.check_alone(mirrored_in_half)
    assert first == (
        "2 tokens on 1 rank: positions [0] are held more than once and [1] by no rank;"
        " every token belongs to exactly one rank"
    )


def test_the_right_tokens_in_another_order_are_told_so():
    problems = ex.check_alone(late_chunk_first)
    assert "another order" in problems[0]


def test_wrong_counts_ranges_types_and_exceptions_are_reported():
    assert "each rank holds seq_len / ranks = 2" in ex.check_alone(lambda s, n, r: [0])[0]
    assert "outside 0 .. 1" in ex.check_alone(lambda s, n, r: [r + 5, r + 6])[0]
    assert "whole numbers" in ex.check_alone(lambda s, n, r: [0.0, 1.0])[0]
    assert "raised ZeroDivisionError" in ex.check_alone(lambda s, n, r: [1 // 0])[0]


def test_source_text_is_loaded_by_name():
    found = ex.load_positions("def f(s, n, r):\n    return [r]\n", "f")
    assert found(4, 2, 1) == [1]
    with pytest.raises(ValueError, match="'g'"):
        ex.load_positions("def f(s, n, r):\n    return [r]\n", "g")


def test_bad_arguments_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="ranks"):
        ex.check_zigzag(zigzag, ranks=1)
    with pytest.raises(ValueError, match="local_seq"):
        ex.check_zigzag(zigzag, local_seq=7)


def test_a_split_the_ring_cannot_run_is_not_sent_to_the_ranks(capsys):
    assert ex.check_zigzag(lambda s, n, r: [r]) is False
    assert "not run on 4 ranks" in capsys.readouterr().out


@pytest.mark.slow
def test_on_real_ranks_the_contiguous_split_is_exact_but_unbalanced(capsys):
    assert ex.check_zigzag(contiguous) is False
    out = capsys.readouterr().out
    assert "(within 1e-12): True" in out
    assert "pairs per rank [136, 392, 648, 904]: balanced False" in out


@pytest.mark.slow
def test_on_real_ranks_tokens_held_twice_give_wrong_attention(capsys):
    assert ex.check_zigzag(mirrored_in_half) is False
    out = capsys.readouterr().out
    assert "(within 1e-12): False" in out
    assert "some token is held twice or by no rank" in out
