"""``python -m trainscale.train`` (or ``torchrun -m trainscale.train``): :func:`main`."""

import sys

from trainscale.train.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
