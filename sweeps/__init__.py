"""Optuna search spaces: ``sweeps/<name>.yaml`` is ``sweep=<name>`` (hydra/sweeper=optuna)."""
