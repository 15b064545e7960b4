"""``python -m sage.train`` (and ``torchrun -m sage.train``): the ``sage-train`` entry point."""

from sage.train.main import main

main()
