"""Functions that run on each rank of a real ``torch.distributed`` job.

One module per chapter idea. Every worker has the signature
``worker(rank, world_size, *args)`` and is started by
:func:`trainscale.distributed.run_ranks` (spawn needs them importable, which is
why they live here and not in the notebooks).
"""
