"""Reports over the MLflow record of sage runs (``sage-report``): the paper's tables and figures.

``load`` is the only module that talks to MLflow; it turns runs into tidy pandas frames. ``tables``,
``patterns`` and ``figures`` are functions of those frames (so tests check them on hand-made frames and
against logged values); ``perplexity`` scores samples under the base model; ``report`` is the CLI.
"""
