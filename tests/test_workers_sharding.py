"""workers.sharding: the FSDP2 worker of chapter 05.

Notebook 05 runs it on 4 real ranks and checks, on every rank, the bytes held and
allocated against ``sharding.fsdp_state_bytes`` and ``fsdp_padded_numel``, the order of
the collectives against ``fsdp_collectives``, the gradient and the Adam update against
one process, and the bf16 mixed-precision step. Here: what it refuses before starting
any communication.
"""

import pytest

from trainscale.workers import sharding as workers


def test_worker_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="batch"):
        workers.worker(0, 3, batch=8)
