"""Hydra sweepers of sage: optuna.py runs an Optuna 5 study (``hydra/sweeper=optuna``); the search spaces
are conf/hparams_search/."""
