"""``python -m sage.eval``: the ``sage-eval`` entry point."""

from sage.eval.main import main

main()
