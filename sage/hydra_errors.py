"""Hydra's composition errors as the one line every other config error is: an unknown option names the
options a user may choose (not the internal ``base_*`` schemas the option files build on), and an unknown key
names the option of its group that has it, or the key it is closest to, instead of Hydra's ``+key=value``,
which adds a key the schema then refuses.

Hydra prints its own multi-line report of these unless HYDRA_FULL_ERROR is set, in which case it re-raises:
:func:`run_app` sets it while Hydra composes, and :func:`composed` (called as the task starts) restores it,
so a failure inside the run is reported by Hydra as before."""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# No import of sage here: sage.config imports this module (composed), and sage.paths leads back to it.
_ENV = "HYDRA_FULL_ERROR"
_SET_BY_US = "_SAGE_SET_HYDRA_FULL_ERROR"


class GridFailed(RuntimeError):
    """A grid job's failure as the grid driver reports it: its message is the whole report (the launcher
    has logged each job's end), so the grid ends with it as one line and exit code 1."""


def run_app(app: Callable[[], Any], conf_dir: str | Path) -> Any:
    """Run a ``@hydra.main`` app over the configs in ``conf_dir``; a composition error becomes ``error: <one
    line>`` and exit code 2. A user who set HYDRA_FULL_ERROR asked for Hydra's traceback and gets it."""
    from hydra.errors import (
        CompactHydraException,
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )

    if os.environ.get(_ENV):
        return app()
    os.environ[_ENV] = os.environ[_SET_BY_US] = "1"
    try:
        return app()
    except (MissingConfigException, ConfigCompositionException) as e:
        line = one_line(e, conf_dir)
        if line is None:  # not one of the errors reworded here: Hydra's own compact report, as before
            print(str(e), file=sys.stderr)
            if e.__cause__ is not None:
                print(str(e.__cause__), file=sys.stderr)
            sys.exit(1)
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except GridFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except CompactHydraException as e:
        # Raised before any job ran, while HYDRA_FULL_ERROR is still ours: a sweeper's refusal (the Optuna
        # sweeper's SweepError: a resumed study that is another experiment, an objective no trial writes) or
        # an override Hydra cannot parse. Its message is the report; Hydra's traceback adds nothing.
        said = " ".join(str(e).split("\nSee https://")[0].split())
        if isinstance(e, OverrideParseException):
            key, _, value = e.override.partition("=")
            quote = f" (a value holding = is quoted: {key}='{value}')" if "=" in value else ""
            said = f"{e.override}: {said}{quote}"
        print(f"error: {said}", file=sys.stderr)
        sys.exit(2)
    finally:
        composed()


def quote_paths(argv: list[str], keys: tuple[str, ...]) -> list[str]:
    """``argv`` with each ``<key>=<path>`` of ``keys`` quoted for Hydra where its override grammar cannot read
    the path as written: a grid's job folder (``experiment=grpo_branch,seed=1/final``) holds ``=``, which
    Hydra refuses in a value, and ``,``, which it reads as a sweep. A value already quoted, or one in Hydra's
    own syntax (a list, a dict, a sweep function), is left as it is, and so is a ``,`` in a path that does
    not exist without an ``=``: that is a sweep over paths (``checkpoint=a/final,b/final`` under ``-m``)."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") in keys and _unreadable(value):
            quote = "'" if "'" not in value else '"'
            arg = f"{key}={quote}{value}{quote}"
        out.append(arg)
    return out


def _unreadable(value: str) -> bool:
    """Whether Hydra's grammar fails on (or splits) this path, and quoting it reads it whole."""
    if not value or value[0] in "'\"[{(" or re.match(r"\w+\(", value):
        return False
    if ("'" in value and '"' in value) or value.endswith("\\"):
        return False  # no quote keeps it whole: Hydra's own report
    return "=" in value or (any(c in value for c in ",[]{}()") and Path(value).exists())


def composed() -> None:
    """Composition is over: Hydra reports the run's own failures its usual way again."""
    if os.environ.pop(_SET_BY_US, None):
        os.environ.pop(_ENV, None)


def one_line(e: Exception, conf_dir: str | Path) -> str | None:
    """The one line for an unknown option (``group=name``) or an unknown key (``group.key=value``); None for
    any other composition error."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    options = getattr(e, "options", None)
    missing = getattr(e, "missing_cfg_file", None)
    if options is not None and missing and "/" in missing:
        group, name = missing.rsplit("/", 1)
        public = [o for o in options if not o.startswith("base_")]
        close = difflib.get_close_matches(name, public, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        return f"{group}={name}: no such {group} option{hint}; choose one of {', '.join(public)}"
    cause = e.__cause__
    if not isinstance(cause, ConfigAttributeError | ConfigKeyError) or not cause.full_key:
        return None
    typed = re.search(r"use \+(\S+)", str(e))
    line = typed.group(1) if typed else cause.full_key
    full_key, key = str(cause.full_key), str(cause.key)
    here = sorted(str(k) for k in (cause.parent_node or {}) if not str(k).startswith("_"))
    prefix = full_key[: -len(key)]
    group = prefix.rstrip(".")
    where = cause.object_type.__name__ if cause.object_type else (group or "the config")
    if group and "." not in group and (Path(conf_dir) / group).is_dir():
        keys = option_keys(group, conf_dir)
        having = [o for o, ks in keys.items() if key in ks]
        if having:
            choose = " ".join([f"{group}={having[0]}", line])
            return (
                f"{line}: the chosen {group} option ({where}) has no key {key!r}; "
                f"{', '.join(f'{group}={o}' for o in having)} {'has' if len(having) == 1 else 'have'} it: "
                f"choose it, e.g. {choose}"
            )
        known = sorted(set(here).union(*keys.values()))
        close = difflib.get_close_matches(key, known, n=1)
        if close:
            owners = [o for o, ks in keys.items() if close[0] in ks]
            of = "" if close[0] in here else f" (a key of {', '.join(f'{group}={o}' for o in owners)})"
            return f"{line}: no {group} option has a key {key!r}; did you mean {prefix}{close[0]}{of}?"
    close = difflib.get_close_matches(key, here, n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"its keys: {', '.join(here) or 'none'}"
    return f"{line}: {where} has no key {key!r}; {hint}"


def option_keys(group: str, conf_dir: str | Path) -> dict[str, set[str]]:
    """Each option of ``conf/<group>/`` and the keys it takes: its file's own keys and those of the schema
    it starts from (``defaults: [base_<schema>]``, registered in Hydra's ConfigStore)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    repo = ConfigStore.instance().repo.get(group, {})
    out: dict[str, set[str]] = {}
    for path in sorted((Path(conf_dir) / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        keys = {str(k) for k in node if k != "defaults"}
        for base in node.get("defaults") or []:
            schema = repo.get(f"{base}.yaml") if isinstance(base, str) else None
            if schema is not None:
                keys |= {str(k) for k in schema.node}
        out[path.stem] = {k for k in keys if not k.startswith("_")}
    return out
