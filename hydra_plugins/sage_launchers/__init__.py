"""sage's submitit launchers (``hydra/launcher=local|slurm``, configs in launchers/hydra/launcher/)."""
