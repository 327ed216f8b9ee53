"""workers.tensor_parallel: chapter 06's DTensor worker. Notebook 06 runs it on 4 real
ranks and checks its outputs against the unsplit layers; here, its layers against the
one-process attention, and the splits it refuses before any communication."""

import pytest
import torch

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
