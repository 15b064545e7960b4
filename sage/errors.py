"""The error every configuration check raises. A module of its own, importing nothing, so the low-level
helpers that check a path or a run folder (sage.paths, sage.run_folder) can raise it without importing
sage.config, which imports them: sage.config re-exports it, and callers keep ``from sage.config import
ConfigError``."""


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message is one line that says what to change."""
