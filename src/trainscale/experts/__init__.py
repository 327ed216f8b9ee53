"""Mixture of experts and expert parallelism (chapter 15), one module per section of the chapter.

* :mod:`~trainscale.experts.routing`: the router's top-k and gates, each expert's
  capacity, the assignments dropped, and the Switch Transformer's balancing loss;
* :mod:`~trainscale.experts.layer`: :class:`MoELayer`, an independent token-by-token
  reference (:func:`per_token_reference`), the chapter's inputs, and the balancing loss
  at work;
* :mod:`~trainscale.experts.traffic`: expert parallelism's all-to-alls, their bytes and
  their time against the experts' compute.

Everything is re-exported here, so ``from trainscale.experts import X`` and
``experts.X`` need no submodule.
"""

from __future__ import annotations

from trainscale.experts.layer import (
    MoELayer,
    ReferenceRun,
    balance_router,
    per_token_reference,
    sample_tokens,
)
from trainscale.experts.routing import (
    Routing,
    dropped_assignments,
    expert_capacity,
    load_balancing_loss,
    route,
)
from trainscale.experts.traffic import (
    ALL_TO_ALLS_PER_LAYER,
    all_to_all_bytes_per_rank,
    ep_comm_to_compute,
    link_comm_to_compute,
    remote_nodes,
)

__all__ = [
    "ALL_TO_ALLS_PER_LAYER",
    "MoELayer",
    "ReferenceRun",
    "Routing",
    "all_to_all_bytes_per_rank",
    "balance_router",
    "dropped_assignments",
    "ep_comm_to_compute",
    "expert_capacity",
    "link_comm_to_compute",
    "load_balancing_loss",
    "per_token_reference",
    "remote_nodes",
    "route",
    "sample_tokens",
]
