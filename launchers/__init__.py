"""Hydra launcher configs (hydra/launcher/*.yaml, searched as pkg://launchers) and service scripts."""
