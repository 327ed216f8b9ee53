"""workers.tensor_parallel: chapter 8's DTensor worker. Notebook 06 runs it on 4 real
ranks and checks its outputs against the unsplit layers, and the transformer block's
collectives and kept bytes with and without sequence parallelism; here, its layers
against the one-process attention, the block's kept bytes in one process against a
hand count, its two plans, and the splits it refuses before any communication."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from trainscale import memory
from trainscale.parallel import (
    attention_by_heads,
    multi_head_attention,
)
from trainscale.workers import tensor_parallel as workers


def test_attention_module_equals_multi_head_attention():
    _, attention = workers.layers()
    x = workers.layer_input()
    weights = [getattr(attention, n).weight.T for n in "qkvo"]
    expected = multi_head_attention(x, *weights, 8).detach()
    assert torch.allclose(attention(x).detach(), expected, atol=1e-6)
    assert torch.allclose(attention_by_heads(x, *weights, 8, 4).detach(), expected, atol=1e-6)


def test_worker_rejects_splits_dtensor_cannot_make():
    with pytest.raises(ValueError, match="heads"):
        workers.worker(0, 3, ffn=63, heads=8)
    with pytest.raises(ValueError, match="ffn"):
        workers.worker(0, 4, ffn=62)


def test_attention_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        workers.Attention(16, 8, kind="flash")


def test_worker_rejects_a_block_sequence_it_cannot_split():
    with pytest.raises(ValueError, match="block_seq"):
        workers.worker(0, 4, block_seq=6)


def test_block_is_float64_and_the_same_on_every_call():
    first, second = workers.block(), workers.block()
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert a.dtype == torch.float64, name
        assert torch.equal(a, b), name
    assert first.attention.kind == "naive"  # so that autograd keeps the softmax output


def test_block_keeps_korthikanti_count_without_dropout_in_float64():
    # s = 8, b = 2, h = 16, a = 8: sbh = 256, a s^2 b = 1,024. Without dropout the
    # formula's rows leave 32 sbh + 2 as^2b = 10,240 bytes in 16-bit; float64 is 4x:
    # 40,960; the two layer norms add a mean and a 1/sigma per token, 2 x 2 x 16 x 8 = 512.
    layer, x = workers.block(), workers.block_input().requires_grad_(True)
    with workers.saved_tensors(layer) as kept:
        layer(x)
    assert sum(row[1] for row in kept) == 41_472
    assert sum(row[1] for row in kept) == memory.saved_activation_bytes(layer, x)
    assert {row[2] for row in kept} == {"plain"}


def test_block_plans_differ_only_where_sequence_parallelism_splits_the_stream():
    tp, sp = workers.block_plan(False), workers.block_plan(True)
    assert set(sp) - set(tp) == {"attention_norm", "mlp_norm"}
    assert all(isinstance(sp[name], SequenceParallel) for name in ("attention_norm", "mlp_norm"))
    for name in ("attention.o", "mlp.down"):
        assert tp[name].output_layouts == (Replicate(),)  # all-reduce
        assert sp[name].output_layouts == (Shard(1),)  # reduce-scatter
    with pytest.raises(ValueError, match="sequence_parallel"):
        workers.block_plan("yes")


def test_collective_sizes_notes_only_collectives_and_changes_no_result():
    with workers.CollectiveSizes() as mode:
        y = torch.arange(4.0) * 2 + 1
    assert mode.sizes == []
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]
