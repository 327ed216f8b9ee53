"""trainscale: the small package behind the book *Training at Scale*.

One module per idea, named as the chapters name it:

- :mod:`trainscale.compute`: FLOPs, training time, MFU, the phases of a step;
- :mod:`trainscale.memory`: bytes of model state per GPU, measured activations;
- :mod:`trainscale.collectives`: ring all-reduce and its two halves, step by step;
- :mod:`trainscale.parallel`: data, tensor and pipeline parallelism in one process;
- :mod:`trainscale.precision`: what fp16 and bf16 lose;
- :mod:`trainscale.schedule`: the learning-rate schedule;
- :mod:`trainscale.figures`, :mod:`trainscale.widgets`, :mod:`trainscale.quiz`:
  the book's figures, kernel-free sliders and check-yourself questions.
"""

__version__ = "0.1.0"
