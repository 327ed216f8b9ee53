"""Data parallelism on real processes (chapter 5).

:func:`worker` runs every check of the chapter on one rank of a
``torch.distributed`` job: PyTorch's ``DistributedDataParallel`` (DDP) on a
slice of the batch, gradient accumulation with ``no_sync``, the cases that break
the equivalence with one device (batch norm, unequal slices), the memory each
rank holds (DDP's gradient buckets included, with and without
``gradient_as_bucket_view``), and when DDP's buckets are all-reduced during
backward: the order of their launches and when each completes. It
returns plain results; the chapter compares them with the one-process answers
of :mod:`trainscale.parallel`.

Annotations are evaluated (no ``from __future__ import annotations``): DDP
checks a communication hook's annotations against ``dist.GradBucket``.

The same file runs on a GPU node, one process per GPU, with NCCL::

    torchrun --nproc-per-node=8 -m trainscale.workers.data_parallel
"""

import contextlib
import inspect
import textwrap
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from trainscale import _checks
from trainscale.distributed import RankError, device, run_ranks, torchrun_main
from trainscale.memory import mlp_stack
from trainscale.parallel import full_batch_gradient

FEATURES, HIDDEN, OUTPUTS = 8, 32, 4
"""Shape of :func:`regression_model`: 8 inputs, two hidden layers of 32, 4 outputs."""

NORMS = (None, "local", "global")
"""Batch-norm variants of :func:`regression_model`."""

loss_fn = nn.functional.mse_loss
"""The loss of every check: the mean squared error over the batch."""


class _AllReduceSum(torch.autograd.Function):
    """A differentiable all-reduce: forward sums ``tensor`` over the ranks, and so does
    backward for the incoming gradient (every rank's loss depends on every rank's input)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class GlobalBatchNorm(nn.BatchNorm1d):
    """Batch norm whose statistics cover the whole global batch, every rank's slice.

    In training mode it all-reduces the per-feature sums, sums of squares and
    the example count, so every rank normalises with the statistics of the full
    batch. The all-reduce is differentiable: its backward all-reduces the
    incoming gradient, so the gradient is the full-batch one too.
    ``nn.SyncBatchNorm`` does the same on GPUs (it refuses CPU tensors). Running
    statistics are not tracked. Outside a process group, or in eval mode, it is
    a plain ``BatchNorm1d``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized()):
            return super().forward(x)
        count = x.new_tensor([float(x.shape[0])])
        totals = _AllReduceSum.apply(torch.cat([x.sum(0), (x * x).sum(0), count]))
        features = x.shape[1]
        n = totals[-1]
        mean = totals[:features] / n
        var = totals[features : 2 * features] / n - mean * mean  # biased, as batch norm uses
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def regression_model(seed: int = 0, norm: str | None = None) -> nn.Sequential:
    """The chapter's small model, ``8 -> 32 -> 32 -> 4`` features with GELU between layers.

    Small and shallow on purpose: its largest gradients are between about 0.01
    and 0.1 in every layer, so relative differences between two ways of
    computing them mean something. ``norm="local"`` puts an ``nn.BatchNorm1d``
    after the first layer, ``norm="global"`` a :class:`GlobalBatchNorm` (same
    parameter names); then the first layer has no bias. The weights come from
    ``seed`` without touching the global random state.
    """
    seed = _checks.count("seed", seed)
    _checks.choice("norm", norm, NORMS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # A bias before batch norm is useless (normalising removes it; its gradient is
        # zero up to rounding), so the first layer has one only without batch norm.
        layers: list[nn.Module] = [nn.Linear(FEATURES, HIDDEN, bias=norm is None)]
        if norm == "local":
            layers.append(nn.BatchNorm1d(HIDDEN))
        elif norm == "global":
            layers.append(GlobalBatchNorm(HIDDEN, track_running_stats=False))
        layers += [nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUTPUTS)]
        return nn.Sequential(*layers)


def regression_data(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``batch`` random inputs and targets for :func:`regression_model`."""
    size = _checks.count("batch", batch, minimum=1)
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    return torch.randn(size, FEATURES, generator=g), torch.randn(size, OUTPUTS, generator=g)


def slice_sizes(batch: int, replicas: int) -> list[int]:
    """How many examples each replica gets when ``batch`` is cut into ``replicas`` slices.

    As ``torch.tensor_split`` cuts: the first ``batch % replicas`` slices get one
    example more. Every replica needs at least one example.
    """
    n = _checks.count("replicas", replicas, minimum=1)
    b = _checks.count("batch", batch, minimum=n)
    return [b // n + (r < b % n) for r in range(n)]


def rank_slice(batch: int, rank: int, replicas: int) -> slice:
    """The examples of ``rank``: its contiguous slice of a batch of ``batch``."""
    sizes = slice_sizes(batch, replicas)
    r = _checks.count("rank", rank)
    if r >= len(sizes):
        raise ValueError(f"rank must be between 0 and replicas - 1 = {len(sizes) - 1}, got {rank}")
    start = sum(sizes[:r])
    return slice(start, start + sizes[r])


def largest_relative_difference(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> float:
    """``max`` over parameters of ``|got - expected| / |expected|`` (Euclidean norms).

    One number for "how far is this gradient from the reference", fair to
    layers whose gradients are small. A parameter whose expected gradient is
    zero contributes ``|got|`` instead. Both dicts must name the same parameters.
    """
    if got.keys() != expected.keys():
        raise ValueError(
            f"got and expected must name the same parameters, got {sorted(got)} "
            f"and {sorted(expected)}"
        )
    worst = 0.0
    for name, reference in expected.items():
        error = torch.linalg.vector_norm((got[name] - reference).double()).item()
        scale = torch.linalg.vector_norm(reference.double()).item()
        worst = max(worst, error / scale if scale > 0 else error)
    return worst


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's ``.grad``, as CPU copies keyed by the unwrapped model's names."""
    inner = model.module if isinstance(model, DDP) else model
    return {name: p.grad.detach().cpu().clone() for name, p in inner.named_parameters()}


def ddp_gradient(
    model: nn.Module, batch: int, rank: int, world_size: int, weighted: bool = False, **ddp_options
) -> dict[str, torch.Tensor]:
    """Wrap ``model`` in DDP, run one forward and backward on this rank's slice of
    a batch of ``batch``; return the gradients DDP leaves in ``.grad``."""
    dev = device()
    ddp = DDP(model.to(dev), **ddp_options)
    x, y = regression_data(batch)
    part = rank_slice(batch, rank, world_size)
    loss = loss_fn(ddp(x[part].to(dev)), y[part].to(dev))
    if weighted:
        # DDP averages over ranks; scaling by (slice / batch) * ranks turns that
        # plain mean into the mean weighted by each slice's share of the batch.
        loss = loss * (part.stop - part.start) * world_size / batch
    loss.backward()
    return _gradients(ddp)


def _synchronise(dev: torch.device) -> None:
    """Wait for the GPU's queued work, so a timer reads when it really ended."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _first_weights(model: nn.Module) -> list[float]:
    """The first three weights of the first layer: enough to tell two models apart."""
    return [round(v, 6) for v in model[0].weight.detach().flatten()[:3].cpu().tolist()]


def check_broadcast_at_construction(rank: int, world_size: int) -> dict[str, list[float]]:
    """Each rank builds its model from its own seed; DDP's constructor overwrites it
    with rank 0's weights (a broadcast)."""
    model = regression_model(seed=rank).to(device())
    before = _first_weights(model)
    DDP(model)
    return {"before": before, "after": _first_weights(model)}


def check_training(
    rank: int, world_size: int, batch: int = 32, steps: int = 3, lr: float = 0.1
) -> dict[str, torch.Tensor]:
    """``steps`` SGD steps with DDP, a new batch each step; the weights at the end."""
    dev = device()
    ddp = DDP(regression_model().to(dev))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    part = rank_slice(batch, rank, world_size)
    for step in range(steps):
        x, y = regression_data(batch, seed=step)
        loss_fn(ddp(x[part].to(dev)), y[part].to(dev)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().cpu().clone() for name, p in ddp.module.named_parameters()}


def _counting_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default averaging all-reduce, counted."""
    state["all_reduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def check_accumulation(
    rank: int, world_size: int, batch: int = 32, micro_batches: int = 4, skip_sync: bool = True
) -> dict[str, object]:
    """Gradient accumulation under DDP: ``micro_batches`` backward passes per rank.

    Each micro-batch's loss is divided by ``micro_batches``. With
    ``skip_sync=True`` all but the last backward run inside ``no_sync()``, so
    DDP all-reduces once; otherwise after every micro-batch. The accumulated
    gradient is the same either way; the number of all-reduces is not.
    """
    dev = device()
    ddp = DDP(regression_model().to(dev))
    counter = {"all_reduces": 0}
    ddp.register_comm_hook(counter, _counting_hook)
    x, y = regression_data(batch)
    part = rank_slice(batch, rank, world_size)
    pieces = list(
        zip(
            torch.tensor_split(x[part], micro_batches),
            torch.tensor_split(y[part], micro_batches),
            strict=True,
        )
    )
    for index, (xs, ys) in enumerate(pieces):
        sync = not skip_sync or index == len(pieces) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            (loss_fn(ddp(xs.to(dev)), ys.to(dev)) / micro_batches).backward()
    return {"gradient": _gradients(ddp), "all_reduces": counter["all_reduces"]}


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: views of one buffer count once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def check_memory(
    rank: int, world_size: int, gradient_as_bucket_view: bool = False, steps: int = 2
) -> dict[str, object]:
    """DDP on the reference model (``memory.mlp_stack``) after ``steps`` AdamW steps:
    the parameters, and the bytes of each part of the state this rank holds.

    DDP's reducer keeps its own flat buffers, one per gradient bucket, which it
    all-reduces; a communication hook sees each one as ``bucket.buffer()``. By
    default ``.grad`` is a separate tensor whose values are copied into and out
    of the buffers, so the gradients are held twice. With
    ``gradient_as_bucket_view=True`` each ``.grad`` *is* a view into a buffer
    (from the second iteration on, once DDP has rebuilt its buckets). Returns the
    bytes of each part (``"DDP buckets"``: the buffers of the last backward),
    how many gradients live inside a bucket buffer, and the bytes of all the
    distinct storages behind them (shared storage counted once): what the
    rank really holds.
    """
    _checks.boolean("gradient_as_bucket_view", gradient_as_bucket_view)
    n_steps = _checks.count("steps", steps, minimum=1)
    dev = device()
    model = mlp_stack().to(dev)
    ddp = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
    buffers: list[torch.Tensor] = []

    def keeping_hook(state: list, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        state.append(bucket.buffer())
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(buffers, keeping_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(rank)).to(dev)
    for _ in range(n_steps):
        buffers.clear()  # keep only the last backward's buckets
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    states = [optimizer.state[p] for p in params]
    adam = [s[key] for s in states for key in ("exp_avg", "exp_avg_sq")]
    bucket_storages = {b.untyped_storage().data_ptr() for b in buffers}
    return {
        "parameters": sum(p.numel() for p in params),
        "bytes": {
            "weights": sum(p.nbytes for p in params),
            "gradients": sum(g.nbytes for g in grads),
            "Adam momentum": sum(s["exp_avg"].nbytes for s in states),
            "Adam variance": sum(s["exp_avg_sq"].nbytes for s in states),
            "DDP buckets": sum(b.nbytes for b in buffers),
        },
        "buckets": len(buffers),
        "gradients inside a bucket": sum(
            g.untyped_storage().data_ptr() in bucket_storages for g in grads
        ),
        "gradient tensors": len(grads),
        "distinct bytes": _storage_bytes(params + grads + adam + buffers),
    }


def _blocks(names: dict, bucket: dist.GradBucket) -> list[int]:
    """The reference model's blocks whose gradients ``bucket`` holds."""
    return sorted({int(names[p].split(".")[0]) for p in bucket.parameters()})


def check_buckets(
    rank: int, world_size: int, iterations: int = 2, bucket_cap_mb: float = 4
) -> list[dict[str, object]]:
    """When DDP launches each gradient bucket's all-reduce during backward, and when
    each one completes.

    DDP on the reference model (``memory.mlp_stack``, 16 MiB of fp32 weights) with
    buckets of ``bucket_cap_mb`` MiB, so that this small model fills several
    (the default, 25 MiB, would not). A communication hook wraps DDP's default
    all-reduce: it notes the launch, and chains a callback onto the all-reduce's
    future (``fut.then``) that notes the completion. DDP waits for the future the
    hook returns, the chained one, before ``backward()`` returns, so every
    completion is noted by then. For each of ``iterations`` backward passes,
    returns the buckets in launch order (bucket index, the model's blocks whose
    gradients it holds, launched and completed in ms after backward started) and
    when backward returned (ms).

    On gloo a future completes when the all-reduce has finished. With NCCL it
    completes once the work is queued on the GPU (the GPU still runs it later),
    so there the completion times say little: read a profiler trace instead.
    """
    _checks.count("iterations", iterations, minimum=1)
    _checks.positive("bucket_cap_mb", bucket_cap_mb)
    dev = device()
    model = mlp_stack().to(dev)
    names = {p: name for name, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    log: dict = {"launched": {}, "completed": {}, "start": 0.0}

    def elapsed_ms(state: dict) -> float:
        return (time.perf_counter() - state["start"]) * 1e3

    def timing_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()
        state["launched"][index] = (_blocks(names, bucket), elapsed_ms(state))
        future = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        def completed(done: torch.futures.Future) -> torch.Tensor:
            state["completed"][index] = elapsed_ms(state)  # runs on gloo's thread
            return done.value()

        return future.then(completed)

    ddp.register_comm_hook(log, timing_hook)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(rank)).to(dev)
    passes = []
    for _ in range(iterations):
        loss = ddp(x).pow(2).mean()
        log["launched"], log["completed"] = {}, {}
        log["start"] = time.perf_counter()
        loss.backward()
        _synchronise(dev)
        backward_ms = elapsed_ms(log)
        buckets = [
            (index, blocks, launched, log["completed"][index])
            for index, (blocks, launched) in log["launched"].items()  # in launch order
        ]
        passes.append({"buckets": buckets, "backward_ms": backward_ms})
        ddp.zero_grad()
    return passes


def communication_hidden_ms(buckets: list, compute_end_ms: float) -> float:
    """How long some all-reduce was running before ``compute_end_ms`` (ms).

    ``buckets`` holds ``(index, blocks, launched_ms, completed_ms)`` records as
    :func:`check_buckets` returns them. The union of the intervals
    ``[launched, completed]``, clipped at ``compute_end_ms`` (when backward
    computed its last gradient): communication that ran while backward was still
    computing, hidden under it.
    """
    end = _checks.non_negative("compute_end_ms", compute_end_ms)
    hidden, reached = 0.0, 0.0
    for start, stop in sorted((launched, done) for *_, launched, done in buckets):
        if stop < start:
            raise ValueError(f"buckets must complete after their launch, got {start} > {stop}")
        lo, hi = max(start, reached), min(stop, end)
        hidden += max(0.0, hi - lo)
        reached = max(reached, stop)
    return hidden


# --- the exercise: average the gradients yourself -----------------------------------------

EXERCISE_NAMES = {"torch": torch, "dist": dist, "nn": nn}
"""What a reader's function finds defined on the ranks (as in the chapter's notebook)."""

EXERCISE_TOLERANCE = 1e-5
"""Largest relative difference (:func:`largest_relative_difference`) that counts as equal."""


def exercise_worker(rank: int, world_size: int, source: str, name: str, batch: int) -> dict:
    """One rank of :func:`check_average_gradients`: forward and backward on this rank's
    slice of a batch of ``batch``, then the reader's ``name`` (defined by ``source``,
    run with :data:`EXERCISE_NAMES`) on the model. Returns the ``.grad`` it left, or
    the error it raised, as text."""
    model = regression_model().to(device())
    x, y = regression_data(batch)
    part = rank_slice(batch, rank, world_size)
    loss_fn(model(x[part].to(device())), y[part].to(device())).backward()
    namespace = dict(EXERCISE_NAMES)
    try:
        exec(compile(source, f"<your {name}>", "exec"), namespace)
        namespace[name](model)
    except Exception as error:  # the reader's code: report it, do not crash the rank
        return {"error": f"{type(error).__name__}: {error}"}
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if missing:
        return {"error": f".grad is None for {', '.join(missing)}"}
    return {"gradients": _gradients(model)}


_DIAGNOSES = {
    "local": "still hold{s} this rank's own gradient: nothing was all-reduced into "
    "{it} (dist.all_reduce changes the tensor you pass it, in place: pass p.grad itself)",
    "sum": "hold{s} the sum over the ranks, {n} times the full-batch gradient: divide by "
    "dist.get_world_size()",
    "local / ranks": "{was} divided by the number of ranks but never all-reduced",
    "mean / ranks": "{was} divided by the number of ranks twice",
    "other": "match{es} neither the full-batch gradient nor a typical mistake",
}


def _kind(got: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str:
    """Which of ``candidates`` ``got`` equals (within :data:`EXERCISE_TOLERANCE`)."""
    for kind, expected in candidates.items():
        if largest_relative_difference({"g": got}, {"g": expected}) < EXERCISE_TOLERANCE:
            return kind
    return "other"


def _error_problem(error: str) -> str:
    """What to say about an error a reader's function raised on a rank."""
    if "Connection closed by peer" in error or "Timed out" in error:
        return (
            "waited in a collective that another rank never called: every rank must "
            "call the same collectives, on tensors of the same shapes, in the same order"
        )
    if error.startswith("NameError"):
        return (
            f"raised {error}: the ranks define only torch, dist (torch.distributed) and "
            "nn (torch.nn); import anything else inside your function"
        )
    return f"raised {error}"


def _rank_problems(result: dict, full: dict, local: dict, n: int) -> list[str]:
    """What is wrong with one rank's report: the kinds of mistake, by parameter."""
    if "error" in result:
        return [_error_problem(result["error"])]
    kinds: dict[str, list[str]] = {}
    for name, got in result["gradients"].items():
        candidates = {
            "mean": full[name],
            "local": local[name],
            "sum": full[name] * n,
            "local / ranks": local[name] / n,
            "mean / ranks": full[name] / n,
        }
        kinds.setdefault(_kind(got, candidates), []).append(name)
    problems = []
    for kind, names in kinds.items():
        if kind == "mean":
            continue
        every = len(names) == len(full)
        subject = "every .grad" if every else f"the .grad of {', '.join(names)}"
        plural = {"s": "s", "es": "es", "it": "it", "was": "was"}
        if not every and len(names) > 1:
            plural = {"s": "", "es": "", "it": "them", "was": "were"}
        problems.append(f"{subject} {_DIAGNOSES[kind].format(n=n, **plural)}")
    return problems


def exercise_problems(results: list[dict], batch: int) -> list[str]:
    """What is wrong with the gradients each rank reported (empty: nothing).

    Each rank's ``.grad`` is compared, parameter by parameter, with what a correct
    average gives (the gradient of the whole batch, :func:`full_batch_gradient` in
    this process) and with the typical mistakes: the rank's own gradient left alone,
    the sum not divided, a division without an all-reduce, a division done twice. A
    problem that every rank shares is said once.
    """
    n = len(results)
    x, y = regression_data(batch)
    full = full_batch_gradient(regression_model(), loss_fn, x, y)
    by_problem: dict[str, list[int]] = {}
    for rank, result in enumerate(results):
        part = rank_slice(batch, rank, n)
        local = full_batch_gradient(regression_model(), loss_fn, x[part], y[part])
        for problem in _rank_problems(result, full, local, n):
            by_problem.setdefault(problem, []).append(rank)
    said = []
    for problem, ranks in by_problem.items():
        who = "every rank" if len(ranks) == n else "rank " + ", ".join(map(str, ranks))
        said.append(f"{who}: {problem}")
    return said


def _wrapped(text: str, **indents: str) -> str:
    """``text`` in lines of at most 76 characters, broken only at spaces."""
    return textwrap.fill(text, 76, break_on_hyphens=False, break_long_words=False, **indents)


def check_average_gradients(
    average_gradients: Callable[[nn.Module], None],
    world_sizes: tuple[int, ...] = (2, 4),
    batch: int = 24,
    timeout: float = 60.0,
) -> bool:
    """Check a reader's ``average_gradients(model)`` on real ranks; print what is wrong.

    On each of ``world_sizes`` ranks (gloo processes), every rank runs forward and
    backward on its slice of the same batch of ``batch`` examples (the chapter's small
    model), then ``average_gradients(model)``, which must leave in each ``.grad`` the
    mean over the ranks: the gradient of the whole batch. The function is sent as its
    source text (ranks cannot import a notebook) and runs with ``torch``, ``dist``
    (``torch.distributed``) and ``nn`` defined. Returns whether it passed.
    """
    sizes = tuple(_checks.count("world_sizes", n, minimum=2) for n in world_sizes)
    if not sizes:
        raise ValueError("world_sizes must name at least one number of ranks")
    for n in sizes:
        slice_sizes(_checks.count("batch", batch, minimum=n), n)
        if batch % n:
            raise ValueError(f"batch must be divisible by every world size, got {batch} and {n}")
    try:
        source = textwrap.dedent(inspect.getsource(average_gradients))
    except (OSError, TypeError) as error:
        raise ValueError(
            f"average_gradients must be a function defined in a cell or a file, got {error}"
        ) from None
    name = getattr(average_gradients, "__name__", "")
    if not name.isidentifier():
        raise ValueError(f"average_gradients must be a function defined with def, got {name!r}")
    for n in sizes:
        try:
            results = run_ranks(exercise_worker, n, source, name, batch, timeout=timeout)
        except RankError as error:
            first = str(error).splitlines()[0].rstrip(":")
            said = (
                f"{n} ranks: {first}. Every rank must call the same collectives, on tensors"
                " of the same shapes, in the same order: a rank that waits for a partner"
                " that never calls waits until the check gives up."
            )
            print(_wrapped(said))
            return False
        problems = exercise_problems(results, batch)
        if problems:
            print(f"{n} ranks, a batch of {batch}: not yet right")
            for problem in problems:
                print(_wrapped(problem, initial_indent="- ", subsequent_indent="  "))
            return False
        print(f"{n} ranks, a batch of {batch}: every rank's .grad is the full-batch gradient")
    print(f"passed: {name} averages the gradients as DDP does")
    return True


def worker(rank: int, world_size: int, batch: int = 32, unequal_batch: int = 10) -> dict:
    """Every check of chapter 5 on this rank; a dict of plain results.

    ``batch`` must be divisible by ``world_size`` for the equal-slice checks
    (and split into 4 micro-batches per rank); ``unequal_batch`` should not be,
    so the plain mean of the ranks' gradients goes wrong.
    """
    results: dict[str, object] = {
        "broadcast": check_broadcast_at_construction(rank, world_size),
        "ddp": ddp_gradient(regression_model(), batch, rank, world_size),
        "trained": check_training(rank, world_size, batch),
        "accumulated": check_accumulation(rank, world_size, batch, skip_sync=True),
        "accumulated, syncing every time": check_accumulation(
            rank, world_size, batch, skip_sync=False
        ),
        "unequal, plain": ddp_gradient(regression_model(), unequal_batch, rank, world_size),
        "unequal, weighted": ddp_gradient(
            regression_model(), unequal_batch, rank, world_size, weighted=True
        ),
        "batch norm, local": ddp_gradient(regression_model(norm="local"), batch, rank, world_size),
        "batch norm, global": ddp_gradient(
            regression_model(norm="global"), batch, rank, world_size
        ),
    }
    results["memory"] = check_memory(rank, world_size)
    results["memory, gradients as bucket views"] = check_memory(
        rank, world_size, gradient_as_bucket_view=True
    )
    results["buckets"] = check_buckets(rank, world_size)
    return results


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: run :func:`worker`, compare with one process, rank 0 reports."""
    batch = 4 * world_size  # equal slices for any number of ranks
    got = worker(rank, world_size, batch=batch, unequal_batch=4 * world_size + 1)
    if rank != 0:
        return
    x, y = regression_data(batch)
    u, v = regression_data(4 * world_size + 1)
    references = {
        "ddp": full_batch_gradient(regression_model(), loss_fn, x, y),
        "accumulated": full_batch_gradient(regression_model(), loss_fn, x, y),
        "unequal, plain": full_batch_gradient(regression_model(), loss_fn, u, v),
        "unequal, weighted": full_batch_gradient(regression_model(), loss_fn, u, v),
        "batch norm, local": full_batch_gradient(regression_model(norm="local"), loss_fn, x, y),
        # One process on the whole batch: plain batch norm is the global one (and
        # GlobalBatchNorm would wait for the other ranks here, so it is not used).
        "batch norm, global": full_batch_gradient(regression_model(norm="local"), loss_fn, x, y),
    }
    print(f"{world_size} ranks, batch {batch}: gradient vs one process on the whole batch")
    for key, reference in references.items():
        result = got[key]["gradient"] if key == "accumulated" else got[key]
        error = largest_relative_difference(result, reference)
        print(f"  {key:20s} largest relative difference {error:.1e}")
    memory = got["memory"]
    print(f"  every rank holds all {memory['parameters']:,} parameters of the reference model")


if __name__ == "__main__":
    torchrun_main(main)
