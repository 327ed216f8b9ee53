"""trainscale: the small package behind the book *Training at Scale*.

One module per idea, named as the chapters name it:

- :mod:`~trainscale.compute`: FLOPs, training time, MFU, the phases of a step (1, 11);
- :mod:`~trainscale.memory`: bytes of model state per GPU, measured activations (2);
- :mod:`~trainscale.parallel`: data and tensor parallelism in one process (3, 6);
- :mod:`~trainscale.collectives`: ring all-reduce and its two halves, step by step (4);
- :mod:`~trainscale.sharding`: ZeRO's stages and the FSDP step (5);
- :mod:`~trainscale.pipeline`: GPipe and 1F1B schedules (7);
- :mod:`~trainscale.precision`, :mod:`~trainscale.loss_scaling`: fp16, bf16, loss scales (8);
- :mod:`~trainscale.checkpointing`: activation checkpointing's trade (9);
- :mod:`~trainscale.schedule`, :mod:`~trainscale.stability`: learning rates, runs that diverge (10);
- :mod:`~trainscale.transformer`: a minimal GPT-style decoder (10, 11);
- :mod:`~trainscale.efficiency`: measuring peak FLOP/s, MFU and loader stalls (12);
- :mod:`~trainscale.planner`, :mod:`~trainscale.train`: the layout planner and the
  restartable capstone run of the transformer's GPT (13);
- :mod:`~trainscale.published`: published large runs as typed records, and their GPUs (13);
- :mod:`~trainscale.distributed` and :mod:`~trainscale.workers`: real gloo processes;
- :mod:`~trainscale.figures`, :mod:`~trainscale.widgets`, :mod:`~trainscale.quiz`:
  the book's figures, kernel-free sliders and check-yourself questions.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainscale")  # what pip installed: pyproject.toml's version
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
