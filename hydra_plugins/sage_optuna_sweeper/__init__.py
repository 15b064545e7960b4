"""``hydra/sweeper=optuna``: our Optuna 5 sweeper (config.py: schema, options; sweeper.py: the study loop)."""
