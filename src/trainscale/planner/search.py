"""The search: every layout of a cluster, estimated and ranked (:func:`plan`).

:func:`top_layouts` keeps the best setting of each shape and :func:`verdict_counts`
counts the verdicts; :func:`context_parallel_degrees` and :func:`expert_parallel_degrees`
are the CP and EP degrees :func:`plan` tries by default.

Which layouts are tried: TP over every divisor of the GPU count (it must also
divide the attention heads), CP over the degrees that can help
(:func:`context_parallel_degrees`) that divide what is left, PP over every divisor
of what is left then, DP the rest, and EP over the divisors of the experts that
also divide DP. PP need *not* divide the layers: the fullest stage gets ``ceil(L / PP)``
layers and its pace sets the pipeline's; without interleaving, the first and last
stages, which also hold the embedding and the logits, get one layer fewer when the
layers fall short (as Llama 3 did), which lowers their activation memory. The
micro-batch must divide the sequences of each DP rank; the number
of micro-batches per step is the gradient accumulation.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from trainscale import _checks
from trainscale.checkpointing import RECOMPUTE
from trainscale.memory import USABLE_MEMORY
from trainscale.planner.inputs import (
    Cluster,
    Model,
    _check_inputs,
    _Problem,
    _recompute,
    _software,
    _zero,
)
from trainscale.planner.layout import (
    MAX_BUBBLE,
    VERDICTS,
    Layout,
    _options,
    _Shape,
)
from trainscale.planner.memory import _chunks_fit
from trainscale.planner.step import _evaluate
from trainscale.planner.unknowns import CENTRAL
from trainscale.software import Software


def _subset(name: str, values: object, convert, allowed: str) -> tuple:
    """The distinct values of a non-empty sequence, each checked by ``convert``."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a non-empty sequence of {allowed}, got {values!r}")
    chosen = tuple(dict.fromkeys(convert(name, value) for value in values))
    if not chosen:
        raise ValueError(f"{name} must be a non-empty sequence of {allowed}, got {values!r}")
    return chosen


def _micro(name: str, value: object) -> int:
    return _checks.count(name, value, minimum=1)


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted({*small, *(n // k for k in small)})


def _sort_key(layout: Layout) -> tuple:
    step = layout.step_seconds if not math.isnan(layout.step_seconds) else math.inf
    memory = layout.memory_bytes if not math.isnan(layout.memory_bytes) else math.inf
    return (
        layout.verdict != "fits",
        step,
        memory,
        layout.shape,
        layout.zero_stage,
        RECOMPUTE.index(layout.recompute),
        layout.micro_batch,
        layout.virtual_stages,
    )


def plan(
    model: Model,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] | None = None,
    recompute: Sequence[str] = RECOMPUTE,
    sequence_parallel: bool = True,
    virtual_stages: int | Sequence[int] = 1,
    efficiency: float | None = None,
    usable_memory: float = USABLE_MEMORY,
    max_bubble: float = MAX_BUBBLE,
    schedule: str = "1f1b",
    software: Software | str | None = None,
    context_parallel: Sequence[int] | None = None,
    expert_parallel: Sequence[int] | None = None,
    tensor_parallel: Sequence[int] | None = None,
) -> list[Layout]:
    """Every layout of ``cluster.gpus`` GPUs, estimated and ranked.

    ``software`` is the stack (:class:`trainscale.software.Software` or a name of
    :data:`trainscale.software.SOFTWARE`; ``None``: :data:`trainscale.software.DEFAULT_SOFTWARE`,
    the planner's assumptions before the software was an input): its attention kernel,
    dropout, gradient dtype, the ZeRO stages and interleaving its engine accepts (layouts
    it refuses are ``invalid``, with its reason) and what it overlaps. ``zero_stages``
    ``None`` tries every stage the software offers.
    ``tensor_parallel`` are the TP degrees to try (``None``: every divisor of the GPU
    count; those that do not divide it are left out).
    ``context_parallel`` and ``expert_parallel`` are the CP and EP degrees to try;
    ``None`` tries those that can help (:func:`context_parallel_degrees`,
    :func:`expert_parallel_degrees`): for a dense model with short sequences only 1.

    TP runs over every divisor of the GPU count, CP over the degrees given that
    divide what TP leaves, PP over every divisor of what TP and CP leave, DP takes
    the rest, so ``TP x CP x PP x DP`` always equals the GPU count; each shape is
    tried with every EP degree given that divides DP, every ZeRO stage,
    recomputation mode and micro-batch size given. Pipeline stages need not divide
    the layers evenly (see :func:`stage_params`). Layouts that break a rule are kept
    with the verdict ``invalid`` so a reader can see why they were rejected.

    Ranked: layouts that fit without any problem first, fastest estimated step
    first, ties going to less memory; then all the others, the same way; the
    ``invalid`` ones last. Each entry is what :func:`evaluate` returns.
    """
    batch = _check_inputs(model, cluster, global_batch)
    stack = _software(software)
    model = model.under(stack)
    micros = _subset("micro_batches", micro_batches, _micro, "whole numbers >= 1")
    stages = _subset(
        "zero_stages",
        stack.zero_stages if zero_stages is None else zero_stages,
        _zero,
        "ZeRO stages 0-3",
    )
    modes = _subset("recompute", recompute, _recompute, f"modes from {RECOMPUTE}")
    if isinstance(virtual_stages, int | float) and not isinstance(virtual_stages, bool):
        depths: tuple[int, ...] = (_micro("virtual_stages", virtual_stages),)
    else:
        depths = stack.depths_for(
            _subset("virtual_stages", virtual_stages, _micro, "whole numbers >= 1")
        )
    options = {
        v: _options(
            *(sequence_parallel, v, efficiency, usable_memory, max_bubble, CENTRAL, schedule),
            software=stack,
        )
        for v in depths
    }
    gpus = cluster.gpus
    cps = (
        context_parallel_degrees(model, cluster, stack)
        if context_parallel is None
        else _subset("context_parallel", context_parallel, _micro, "whole numbers >= 1")
    )
    eps = (
        expert_parallel_degrees(model)
        if expert_parallel is None
        else _subset("expert_parallel", expert_parallel, _micro, "whole numbers >= 1")
    )
    tps = _divisors(gpus)
    if tensor_parallel is not None:
        wanted = _subset("tensor_parallel", tensor_parallel, _micro, "whole numbers >= 1")
        tps = [t for t in tps if t in wanted]
    problem = _Problem(model, cluster, batch)
    layouts = [
        _evaluate(
            problem,
            _Shape(
                tp=t,
                pp=p,
                dp=gpus // (t * c * p),
                zero_stage=zero,
                recompute=mode,
                micro_batch=b,
                cp=c,
                ep=ep,
            ),
            options[v],
        )
        for t in tps
        for c in cps
        if (gpus // t) % c == 0
        for p in _divisors(gpus // (t * c))
        for v in _depths_to_try(depths, model.layers, p)
        for ep in eps
        if (gpus // (t * c * p)) % ep == 0
        for zero in stages
        for mode in modes
        for b in micros
    ]
    return sorted(layouts, key=_sort_key)


def _depths_to_try(depths: tuple[int, ...], layers: int, pp: int) -> tuple[int, ...]:
    """The interleaving depths worth a layout at ``pp`` stages: none without a pipeline
    (the first depth stands for it), and only those whose chunks fit the layers
    (:func:`trainscale.planner.memory._chunks_fit`), or the first when none does, so that a
    pipeline too deep for the model still shows why it is invalid."""
    if pp == 1:
        return depths[:1]
    fitting = tuple(v for v in depths if _chunks_fit(layers, pp, v))
    return fitting or depths[:1]


CP_MIN_LOCAL_TOKENS = 1024
"""The fewest tokens of a sequence one context-parallel rank holds in the search: 8 of the
128-token blocks a FlashAttention kernel works in (Dao 2023, arXiv 2307.08691), below which
each step of the ring moves and computes too little to be worth a rank. A bound on the
search, not a verdict: the cost model ranks every degree it tries."""


def context_parallel_degrees(
    model: Model, cluster: Cluster, software: Software | str | None = None
) -> tuple[int, ...]:
    """The CP degrees :func:`plan` tries by default: 1, and each power of two ``c`` up to
    the GPU count that splits the sequence into ``2 c`` equal chunks (the zig-zag layout
    that balances the causal mask, chapter 10) of at least :data:`CP_MIN_LOCAL_TOKENS`
    tokens per rank, on ``software`` (as :func:`plan` takes it). CP needs a fused attention
    kernel (ring attention keeps the online softmax's running sums, never the ``s x s``
    scores). Whether a degree pays is the cost model's to say
    (:func:`trainscale.planner.traffic._context_parallel_seconds` against the layer it
    splits); chapter 10's thresholds (:func:`trainscale.context.cp_beats_tp_local_tokens`,
    :func:`trainscale.context.cp_hiding_threshold_tokens`) explain the ranking, they do
    not gate it.
    """
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a planner.Cluster, got {type(cluster).__name__}")
    if not model.under(_software(software)).fused_attention:
        return (1,)
    degrees, c = [1], 2
    while (
        c <= cluster.gpus
        and model.seq_len % (2 * c) == 0
        and model.seq_len // c >= CP_MIN_LOCAL_TOKENS
    ):
        degrees.append(c)
        c *= 2
    return tuple(degrees)


def expert_parallel_degrees(model: Model) -> tuple[int, ...]:
    """The EP degrees :func:`plan` tries by default: every divisor of the model's experts
    (1 for a dense model); :func:`plan` keeps those that also divide DP."""
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    return (1,) if model.experts is None else tuple(_divisors(model.experts))


def top_layouts(layouts: Sequence[Layout], count: int = 5) -> list[Layout]:
    """The fastest layout that fits of each TP x PP x DP shape, fastest first, at most ``count``.

    :func:`plan` returns every ZeRO stage, recomputation mode and micro-batch of
    a shape; this keeps the best setting of each shape, so the list compares
    shapes rather than variations of one.
    """
    n = _checks.count("count", count, minimum=1)
    best: dict[tuple[int, int, int], Layout] = {}
    for layout in sorted((lay for lay in layouts if lay.verdict == "fits"), key=_sort_key):
        best.setdefault(layout.shape, layout)
    return list(best.values())[:n]


def verdict_counts(layouts: Iterable[Layout]) -> dict[str, int]:
    """How many layouts got each verdict, in the order of :data:`VERDICTS`."""
    counted = Counter(layout.verdict for layout in layouts)
    return {verdict: counted[verdict] for verdict in VERDICTS}
