"""Reports over the MLflow record of sage runs (``sage-report``): the paper's tables and figures.

``load`` is the only module that talks to MLflow; it turns runs into tidy pandas frames. ``tables`` and
``figures`` are functions of those frames (so tests check them on hand-made frames and against logged
values); ``report`` is the CLI, ``assemble.make_report`` the report, one section per module of
``sections``. Nothing here loads a model or imports torch: what the samples say (patterns,
strategies, perplexity under the base model) is computed beside each evaluation (``sage.eval.analyses``)
and read back from MLflow.
"""
