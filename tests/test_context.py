"""context: chapter 10's formulas, pinned to hand-worked numbers."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale.collectives import tp_comm_to_compute
from trainscale.context import (
    DOCUMENT_LAYOUTS,
    attention_blocks_per_rank,
    attention_flops_per_rank,
    causal_pairs_per_rank,
    cp_beats_tp_local_tokens,
    cp_comm_to_compute,
    cp_hiding_threshold_tokens,
    cp_model_state_groups,
    document_ring_pairs,
    gradient_reduce_ranks,
    hybrid_bytes_per_rank,
    kv_block_bytes,
    ring_bytes_per_rank,
    ring_schedule,
    token_positions,
    ulysses_bytes_per_rank,
    ulysses_heads_per_rank,
    ulysses_kv_replicas,
)


def test_token_positions_by_hand():
    # 16 tokens on 4 ranks: contiguous slices of 4; zig-zag chunks of 2, rank r holds r and 7-r.
    assert token_positions(16, 4, 1) == [4, 5, 6, 7]
    assert token_positions(16, 4, 0, "zigzag") == [0, 1, 14, 15]
    assert token_positions(16, 4, 3, "zigzag") == [6, 7, 8, 9]


@given(st.integers(1, 8), st.integers(1, 5), st.sampled_from(["contiguous", "zigzag"]))
def test_every_token_is_held_by_exactly_one_rank(ranks, chunk, layout):
    seq = 2 * ranks * chunk
    held = sorted(p for r in range(ranks) for p in token_positions(seq, ranks, r, layout))
    assert held == list(range(seq))


def test_ring_schedule_by_hand():
    # Contiguous, 3 ranks: rank 1 holds its own keys, then rank 0's (seen), then rank 2's (hidden).
    assert ring_schedule(3)[1] == [(1, 1.0), (0, 1.0), (2, 0.0)]
    assert ring_schedule(3, "zigzag")[1] == [(1, 1.0), (0, 0.5), (2, 0.5)]


def test_blocks_per_rank_by_hand():
    assert attention_blocks_per_rank(4) == [1.0, 2.0, 3.0, 4.0]
    assert attention_blocks_per_rank(4, "zigzag") == [2.5] * 4  # (4 + 1) / 2


@given(st.integers(1, 12))
def test_both_layouts_do_the_same_total_work(ranks):
    total = ranks * (ranks + 1) / 2
    assert sum(attention_blocks_per_rank(ranks)) == total
    assert sum(attention_blocks_per_rank(ranks, "zigzag")) == total


def test_causal_pairs_by_hand():
    # 64 tokens on 4 ranks, L = 16: rank r sees r * 256 + 16 * 17 / 2 = 256 r + 136 pairs.
    assert causal_pairs_per_rank(64, 4) == [136, 392, 648, 904]
    # zig-zag, c = 8: chunk r sees 64 r + 36, chunk 7 - r sees 64 (7 - r) + 36: 520 in all.
    assert causal_pairs_per_rank(64, 4, "zigzag") == [520] * 4


def test_attention_flops_by_hand():
    # 4 h per pair: h = 32 gives 128 FLOPs per pair; rank 0 of 64 tokens on 4 ranks has 136 pairs.
    assert attention_flops_per_rank(64, 4, 32)[0] == 136 * 128
    assert attention_flops_per_rank(64, 4, 32, "zigzag") == [520 * 128] * 4


@given(st.integers(1, 6), st.integers(1, 6))
def test_pairs_total_the_causal_triangle(ranks, chunk):
    seq = 2 * ranks * chunk
    for layout in ("contiguous", "zigzag"):
        assert sum(causal_pairs_per_rank(seq, ranks, layout)) == seq * (seq + 1) // 2


def test_ring_bytes_by_hand():
    # b = 1, L = 16, h_kv = 32, 8 bytes: one block of K is 4,096 B.
    assert kv_block_bytes(16, 32, 8) == 4096
    assert ring_bytes_per_rank(16, 4, 32, 8) == 6 * 4096  # 2 (N - 1) blocks
    assert ring_bytes_per_rank(16, 4, 32, 8, backward=True) == 14 * 4096  # 2 (N - 1) + 2 N
    assert ring_bytes_per_rank(16, 1, 32, 8, backward=True) == 0


def test_ulysses_bytes_by_hand():
    # 4 tensors of 4,096 B, each keeping a quarter: 3/4 * 16,384 = 12,288 B.
    assert ulysses_bytes_per_rank(16, 4, 32, bytes_per_value=8) == 12288
    # grouped-query attention: keys and values 8 wide: 3/4 * 16 * 8 * (64 + 16) = 7,680.
    assert ulysses_bytes_per_rank(16, 4, 32, kv_hidden=8, bytes_per_value=8) == 7680


def test_ulysses_bytes_with_replicated_kv_heads_by_hand():
    # 4 ranks, 1 key-value head of 8 copied 4 times: K and V each 32 wide; 3/4 * 16 * 8 * (64 + 64).
    assert ulysses_bytes_per_rank(16, 4, 32, kv_hidden=8, bytes_per_value=8, kv_heads=1) == 12288
    # 2 key-value heads of 4 on 4 ranks, copied twice: K and V 16 wide; 3/4 * 16 * 8 * (64 + 32).
    assert ulysses_bytes_per_rank(16, 4, 32, kv_hidden=8, bytes_per_value=8, kv_heads=2) == 9216
    # 8 key-value heads on 4 ranks need no copy: as without kv_heads (7,680 above).
    assert ulysses_bytes_per_rank(16, 4, 32, kv_hidden=8, bytes_per_value=8, kv_heads=8) == 7680


@given(st.integers(1, 64), st.sampled_from([1, 2, 4, 8, 16]))
def test_one_replicated_kv_head_sends_what_an_all_gather_sends(local, ranks):
    # K and V of one head: (N - 1)/N of N copies = (N - 1) blocks each, the all-gather's bytes.
    ulysses = ulysses_bytes_per_rank(local, ranks, 64 * ranks, kv_hidden=64, kv_heads=1)
    queries_and_output = ulysses_bytes_per_rank(local, ranks, 64 * ranks, kv_hidden=1) - (
        ulysses_bytes_per_rank(local, ranks, 1, kv_hidden=1) / 2
    )
    assert ulysses - queries_and_output == pytest.approx(ring_bytes_per_rank(local, ranks, 64))


def test_ulysses_head_limit_is_the_query_heads():
    assert ulysses_heads_per_rank(32, 8) == 4
    assert ulysses_heads_per_rank(16, 16) == 1  # Llama 3 405B after TP 8: 128 / 8 query heads
    with pytest.raises(ValueError, match="heads must be divisible"):
        ulysses_heads_per_rank(6, 4)
    with pytest.raises(ValueError, match="heads must be divisible"):
        ulysses_heads_per_rank(16, 32)


def test_ulysses_kv_replicas_by_hand():
    assert ulysses_kv_replicas(8, 4) == 1  # two key-value heads per rank
    assert ulysses_kv_replicas(8, 8) == 1
    assert ulysses_kv_replicas(8, 16) == 2  # DeepSpeed's "4 kv heads and sp 8: replicate 2x"
    assert ulysses_kv_replicas(1, 16) == 16  # one head, on every rank: an all-gather
    with pytest.raises(ValueError, match="kv_heads must be divisible"):
        ulysses_kv_replicas(6, 4)
    with pytest.raises(ValueError, match="kv_heads"):
        ulysses_bytes_per_rank(16, 4, 32, kv_hidden=24, kv_heads=3)


def test_cp_comm_to_compute_by_hand():
    # g b peak mfu / (2 f L B) = 1 * 2 * 1e15 * 0.4 / (2 * 0.5 * 4096 * 50e9) = 8e14 / 2.048e14.
    assert cp_comm_to_compute(4096, 1e15, 0.4, 50e9) == pytest.approx(3.90625)
    assert cp_hiding_threshold_tokens(1e15, 0.4, 50e9) == pytest.approx(16000)
    assert cp_hiding_threshold_tokens(1e15, 0.4, 50e9, causal=False) == pytest.approx(8000)


def test_cp_beats_tp_at_nine_h_over_t_minus_one():
    # Causal, g = 1: L = 9 h / (t - 1) = 9 * 4096 / 7, whatever the GPU and link.
    crossing = cp_beats_tp_local_tokens(4096, 8, 1e15, 0.4, 50e9)
    assert crossing == pytest.approx(9 * 4096 / 7)
    ratio = cp_comm_to_compute(round(crossing), 1e15, 0.4, 50e9)
    assert ratio == pytest.approx(tp_comm_to_compute(8, 4096, 1e15, 0.4, 50e9), rel=1e-3)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: token_positions(10, 4, 0), "seq_len"),
        (lambda: token_positions(15, 3, 0, "zigzag"), "seq_len"),
        (lambda: token_positions(16, 4, 4), "rank"),
        (lambda: ring_schedule(4, "striped"), "layout"),
        (lambda: ring_bytes_per_rank(0, 4, 8), "local_tokens"),
        (lambda: cp_comm_to_compute(16, 1e15, 1.5, 50e9), "mfu"),
        (lambda: cp_beats_tp_local_tokens(4096, 1, 1e15, 0.4, 50e9), "shards"),
    ],
)
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_hybrid_bytes_by_hand():
    # 16 local tokens, Ulysses over 2, ring over 2; 4 query heads and 1 key-value head of 8,
    # float64. The key-value head is copied twice, so the all-to-alls send half of
    # 16 x (2 x 32 + 2 x 8 x 2) values x 8 B = 6,144 B. Then a rank holds 32 tokens of one
    # key-value head (8 wide): blocks of 32 x 8 x 8 = 2,048 B, passed 2 (R - 1) = 2 times
    # forward (4,096 B) and 2 (R - 1) + 2 R = 6 times backward (12,288 B).
    forward = hybrid_bytes_per_rank(16, 2, 2, 32, 8, 8, kv_heads=1)
    backward = hybrid_bytes_per_rank(16, 2, 2, 32, 8, 8, kv_heads=1, backward=True)
    assert forward == {"all-to-all": 6144, "ring": 4096}
    assert backward == {"all-to-all": 6144, "ring": 12288}
    # 2 key-value heads split over the 2 Ulysses ranks, no copy: 16 x (64 + 32) / 2 x 8 B.
    assert hybrid_bytes_per_rank(16, 2, 2, 32, 16, 8, kv_heads=2)["all-to-all"] == 6144


@given(st.integers(1, 64), st.integers(1, 8), st.sampled_from([8, 64, 4096]))
def test_hybrid_of_one_kind_is_that_kind(tokens, ranks, width):
    ring_only = hybrid_bytes_per_rank(tokens, 1, ranks, width)
    ulysses_only = hybrid_bytes_per_rank(tokens, ranks, 1, ranks * width)
    assert ring_only == {"all-to-all": 0, "ring": ring_bytes_per_rank(tokens, ranks, width)}
    assert ulysses_only == {
        "all-to-all": ulysses_bytes_per_rank(tokens, ranks, ranks * width),
        "ring": 0,
    }


def test_hybrid_refuses_a_key_width_that_does_not_split():
    with pytest.raises(ValueError, match="kv_hidden"):
        hybrid_bytes_per_rank(16, 4, 2, 32, 6)
    with pytest.raises(ValueError, match="ulysses_ranks"):
        hybrid_bytes_per_rank(16, 0, 2, 32)


def test_document_ring_pairs_by_hand():
    # Two documents of 6 and 2 tokens, zig-zag on 2 ranks (chunks of 2). Rank 0 holds
    # 0, 1 (document 0) and 6, 7 (document 1): 1 + 2 and 1 + 2 pairs among its own keys,
    # none with rank 1's keys 2..5. Rank 1 holds 2..5: with its own keys 1 + 2 + 3 + 4 = 10,
    # with rank 0's keys 0, 1 two each, 8. Totals 6 and 18: the busiest 1.5 x the mean.
    assert document_ring_pairs([6, 2], 2, "zigzag") == [[6, 0], [10, 8]]
    # Contiguous, two documents of 4: each rank holds one whole document, 1+2+3+4 pairs.
    assert document_ring_pairs([4, 4], 2, "contiguous") == [[10, 0], [10, 0]]
    # Each document cut into 4 chunks of 1: rank 0 holds 0, 3, 4, 7 (1 + 4 + 1 + 4 = 10
    # pairs), rank 1 holds 1, 2, 5, 6 (2 + 3 + 2 + 3 = 10).
    assert [sum(row) for row in document_ring_pairs([4, 4], 2, "per-document zigzag")] == [10, 10]


def _held(lengths, ranks, rank, layout):
    """Positions a rank holds, written out here for the per-document layout."""
    if layout != "per-document zigzag":
        return token_positions(sum(lengths), ranks, rank, layout)
    held, start = [], 0
    for length in lengths:
        chunk = length // (2 * ranks)
        for piece in (rank, 2 * ranks - 1 - rank):
            held += range(start + piece * chunk, start + (piece + 1) * chunk)
        start += length
    return held


@given(
    st.integers(1, 4),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.sampled_from(DOCUMENT_LAYOUTS),
)
def test_document_ring_pairs_count_the_mask(ranks, units, layout):
    # Document lengths in units of 2N, so that every layout applies.
    lengths = [2 * ranks * u for u in units]
    document = [d for d, length in enumerate(lengths) for _ in range(length)]
    got = document_ring_pairs(lengths, ranks, layout)
    for rank in range(ranks):
        for step in range(ranks):
            keys = _held(lengths, ranks, (rank - step) % ranks, layout)
            seen = sum(
                1
                for q in _held(lengths, ranks, rank, layout)
                for k in keys
                if k <= q and document[k] == document[q]
            )
            assert got[rank][step] == seen


@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from(["contiguous", "zigzag"]))
def test_one_document_is_the_causal_count(ranks, chunk, layout):
    seq = 2 * ranks * chunk
    totals = [sum(row) for row in document_ring_pairs([seq], ranks, layout)]
    assert totals == causal_pairs_per_rank(seq, ranks, layout)


def test_document_ring_pairs_refuse_bad_documents():
    with pytest.raises(ValueError, match="doc_lengths"):
        document_ring_pairs([], 2)
    with pytest.raises(ValueError, match="doc_lengths"):
        document_ring_pairs([6, 2], 2, "per-document zigzag")  # 6 is not a multiple of 4
    with pytest.raises(ValueError, match="doc_lengths"):
        document_ring_pairs([3, 2], 2, "zigzag")  # 5 tokens do not cut into 4 chunks
    with pytest.raises(ValueError, match="layout"):
        document_ring_pairs([4], 2, "striped")


def test_gradients_reduce_over_data_and_context_ranks():
    assert gradient_reduce_ranks(2, 2) == 4
    assert gradient_reduce_ranks(8, 16) == 128  # Llama 3's 128K stage: DP 8, CP 16
    with pytest.raises(ValueError, match="cp"):
        gradient_reduce_ranks(8, 0)


def test_cp_model_state_by_hand():
    # 1,000 parameters per GPU, DP 2 x CP 2: 2 + 2 + 12 bytes each. ZeRO shards over
    # 4 ranks: stage 1 the optimiser state (12,000 / 4), stage 2 the gradients too
    # (2,000 / 4), stage 3 the weights too; stage 0 keeps all 16,000 bytes, CP or not.
    expected = {
        0: {"weights": 2000, "gradients": 2000, "optimiser state": 12000},
        1: {"weights": 2000, "gradients": 2000, "optimiser state": 3000},
        2: {"weights": 2000, "gradients": 500, "optimiser state": 3000},
        3: {"weights": 500, "gradients": 500, "optimiser state": 3000},
    }
    for stage, parts in expected.items():
        assert cp_model_state_groups(1000, 2, 2, stage) == parts
    # Sharded over DP alone it would be twice that: 1,000 / 2 weights under stage 3.
    assert cp_model_state_groups(1000, 2, 1, 3)["weights"] == 1000
