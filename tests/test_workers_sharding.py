"""workers.sharding: the FSDP2 worker of chapter 05.

Notebook 05 runs it on 4 real ranks and checks, on every rank, the bytes held and
allocated against ``sharding.fsdp_state_bytes`` and ``fsdp_padded_numel``, the order of
the collectives against ``fsdp_collectives``, the gradient and the Adam update against
one process, the bf16 mixed-precision step, the bytes held at each moment against
``sharding.fsdp_memory_moments`` and the traffic of gradient accumulation against
``sharding.zero_traffic``. Here: what it refuses before starting
any communication.
"""

import pytest

from trainscale.workers import sharding as workers


def test_worker_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="batch"):
        workers.worker(0, 3, batch=8)


def test_worker_rejects_micro_batches_that_do_not_split_the_slice():
    # 16 examples on 4 ranks: 4 each, which 3 micro-batches cannot split
    with pytest.raises(ValueError, match="micro_batches"):
        workers.worker(0, 4, batch=16, micro_batches=(1, 3))
    with pytest.raises(ValueError, match="micro_batches"):
        workers.worker(0, 4, batch=16, micro_batches=(0,))
    with pytest.raises(ValueError, match="micro_batches"):
        workers.accumulation_worker(0, 4, micro_batches="12")
