"""Mixture of experts and expert parallelism (chapter 11), one module per section of the chapter.

* :mod:`~trainscale.experts.routing`: the router's top-k and gates, each expert's
  capacity, the assignments dropped, the Switch Transformer's balancing loss and
  ST-MoE's router z-loss;
* :mod:`~trainscale.experts.layer`: :class:`MoELayer`, an independent token-by-token
  reference (:func:`per_token_reference`), the chapter's inputs, and the balancing loss
  at work;
* :mod:`~trainscale.experts.dropless`: the dropless layer (permute, grouped GEMM,
  unpermute), its padding and its memory traffic;
* :mod:`~trainscale.experts.traffic`: expert parallelism's all-to-alls, their bytes and
  their time against the experts' compute;
* :mod:`~trainscale.experts.groups`: expert parallelism beside TP, PP and DP: which group
  reduces which gradient, and the model state per GPU.

Everything is re-exported here, so ``from trainscale.experts import X`` and
``experts.X`` need no submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below are, for type checkers; at run time see __getattr__
    from trainscale.experts.dropless import (
        GROUPED_MM_DTYPES,
        can_group,
        dropless_forward,
        expert_mlps,
        padded_rows,
        padding_flops,
        permute_bytes,
        permute_to_compute,
    )
    from trainscale.experts.groups import (
        data_parallel_size,
        expert_data_parallel_size,
        model_state_per_gpu,
    )
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
        rounding_drift,
        route,
        router_z_loss,
    )
    from trainscale.experts.traffic import (
        ALL_TO_ALLS_PER_LAYER,
        all_to_all_bytes_per_rank,
        ep_comm_to_compute,
        link_comm_to_compute,
        remote_nodes,
    )

_EXPORTS = {
    "dropless": (
        "GROUPED_MM_DTYPES",
        "can_group",
        "dropless_forward",
        "expert_mlps",
        "padded_rows",
        "padding_flops",
        "permute_bytes",
        "permute_to_compute",
    ),
    "groups": ("data_parallel_size", "expert_data_parallel_size", "model_state_per_gpu"),
    "layer": ("MoELayer", "ReferenceRun", "balance_router", "per_token_reference", "sample_tokens"),
    "routing": (
        "Routing",
        "dropped_assignments",
        "expert_capacity",
        "load_balancing_loss",
        "rounding_drift",
        "route",
        "router_z_loss",
    ),
    "traffic": (
        "ALL_TO_ALLS_PER_LAYER",
        "all_to_all_bytes_per_rank",
        "ep_comm_to_compute",
        "link_comm_to_compute",
        "remote_nodes",
    ),
}
"""Each submodule and the names it gives this package. They are imported when first read
(:func:`__getattr__`): the traffic formulas need no torch, so the planner (chapter 16, and
its web page, which has no torch) imports them without the modules that run tensors."""

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    """A name of :data:`_EXPORTS`, from its submodule (imported on first use)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = [
    "ALL_TO_ALLS_PER_LAYER",
    "GROUPED_MM_DTYPES",
    "MoELayer",
    "ReferenceRun",
    "Routing",
    "all_to_all_bytes_per_rank",
    "balance_router",
    "can_group",
    "data_parallel_size",
    "dropless_forward",
    "dropped_assignments",
    "ep_comm_to_compute",
    "expert_capacity",
    "expert_data_parallel_size",
    "expert_mlps",
    "link_comm_to_compute",
    "load_balancing_loss",
    "model_state_per_gpu",
    "padded_rows",
    "padding_flops",
    "per_token_reference",
    "permute_bytes",
    "permute_to_compute",
    "remote_nodes",
    "rounding_drift",
    "route",
    "router_z_loss",
    "sample_tokens",
]
