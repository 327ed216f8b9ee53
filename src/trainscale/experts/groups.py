"""Expert parallelism beside tensor, pipeline and data parallelism: which group reduces which
gradient, and the model state each GPU holds (chapter 11).

Megatron-Core builds two grids over the same ``world`` GPUs ("MoE parallel folding",
Liu et al. 2025, arXiv 2504.14960; ``megatron/core/parallel_state.py``): the dense layers
(attention, norms, router, shared experts, embeddings) are split ``tp x cp x dp x pp``,
the experts ``etp x ep x edp x pp`` with the same pipeline stages. So

* a dense parameter is held by the ``dp x cp = world / (tp pp)`` GPUs of its data- and
  context-parallel group (:func:`data_parallel_size` gives ``dp``), which all-reduce
  (or reduce-scatter, under ZeRO) its gradient;
* an expert parameter is held by the ``edp = world / (etp ep pp)`` GPUs of its
  *expert-data-parallel* group (:func:`expert_data_parallel_size`), which reduce its
  gradient. The expert-parallel all-to-all already brought the tokens of the ``ep`` ranks
  of its expert-parallel group to it, so the ``edp`` copies together have seen every token.

:func:`model_state_per_gpu` counts the bytes of both, with ZeRO sharding each over its
own group: the experts, many and sharded over a small group, hold most of the optimiser
state.
"""

from __future__ import annotations

from trainscale import _checks
from trainscale.memory import StateDtypes, model_state_groups


def data_parallel_size(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """Data-parallel ranks of the dense layers: ``world / (tp * pp * cp)``. Their gradients
    are reduced over ``dp * cp`` ranks (Megatron-Core folds context parallelism into the
    data-parallel group)."""
    w = _checks.count("world", world, minimum=1)
    split = (
        _checks.count("tp", tp, minimum=1)
        * _checks.count("pp", pp, minimum=1)
        * _checks.count("cp", cp, minimum=1)
    )
    if w % split:
        raise ValueError(f"world must be a multiple of tp * pp * cp = {split}, got {world}")
    return w // split


def expert_data_parallel_size(world: int, ep: int, etp: int = 1, pp: int = 1) -> int:
    """GPUs that hold the same experts and reduce their gradients:
    ``world / (etp * ep * pp)`` (Megatron-Core's ``expert_data_parallel_size``)."""
    w = _checks.count("world", world, minimum=1)
    split = (
        _checks.count("etp", etp, minimum=1)
        * _checks.count("ep", ep, minimum=1)
        * _checks.count("pp", pp, minimum=1)
    )
    if w % split:
        raise ValueError(f"world must be a multiple of etp * ep * pp = {split}, got {world}")
    return w // split


def model_state_per_gpu(
    dense_params: float,
    expert_params: float,
    world: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    zero_stage: int = 1,
    dtypes: StateDtypes | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes of model state on one GPU: ``{"dense": ..., "experts": ...}``, each a dict of
    weights, gradients and optimiser state (:func:`trainscale.memory.model_state_groups`).

    The dense parameters are split over ``tp * pp`` GPUs and sharded by ZeRO
    (``zero_stage``) over the ``dp * cp`` that hold the same ones; the experts' over
    ``etp * ep * pp`` and sharded over the ``edp`` that hold the same experts (each split
    rounded up to whole parameters). ``dense_params`` and ``expert_params`` are whole
    numbers (``1.6e9`` is accepted). ``etp=None``
    takes ``tp`` (Megatron-Core's default). Every stage is taken to hold an equal share of
    both (uneven stages, and the embedding on the first and last, are left out).
    """
    dense = _checks.count("dense_params", dense_params)
    expert = _checks.count("expert_params", expert_params)
    t = _checks.count("tp", tp, minimum=1)
    et = t if etp is None else _checks.count("etp", etp, minimum=1)
    dp = data_parallel_size(world, t, pp, cp)
    edp = expert_data_parallel_size(world, ep, et, pp)
    return {
        "dense": model_state_groups(-(-dense // (t * pp)), dp * cp, zero_stage, dtypes),
        "experts": model_state_groups(-(-expert // (et * ep * pp)), edp, zero_stage, dtypes),
    }
