"""The error every configuration check raises, and how a full disk reads in an error's text. A module of
its own, importing nothing, so the low-level helpers that check a path or a run folder (sage.paths,
sage.run_folder) and the tracker can use them without importing sage.config, which imports them:
sage.config re-exports ConfigError, and callers keep ``from sage.config import ConfigError``."""


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message is one line that says what to change."""


# How a full disk reads where no OSError carries its errno: safetensors (Rust), SQLite (an MLflow store).
NO_SPACE_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "database or disk is full")
