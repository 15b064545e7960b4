"""Hydra launchers of sage: submitit.py runs a sweep's jobs as local processes or one SLURM array."""
