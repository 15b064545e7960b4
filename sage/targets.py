"""A config node and the class its ``_target_`` names: the node's schema mirrored from the class's
constructor (``schema_of``), the values a node changes from the class's defaults (``changed_only``), the
object built from it (``instantiate_node``), and whether it builds a given class (``builds``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from dataclasses import field
from enum import Enum, StrEnum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from sage.errors import ConfigError

# A schema mirrors its target's constructor: the same names, the types OmegaConf can check, and the target's
# own defaults. So every default has one source (the class: ours, TRL's, peft's), an option file lists only
# what it changes, a misspelt key fails at composition, and any knob of the library is settable by name.
_SIMPLE = (int, float, bool, str)
_ENUMS: dict[tuple[str, ...], type[StrEnum]] = {}
# target path -> {field: default}, to pass a library class only the values a config changes (explicit
# defaults can trigger deprecation warnings in transformers, and the record stays what the user chose).
TARGET_DEFAULTS: dict[str, dict[str, Any]] = {}


def _choice_enum(values: tuple[str, ...]) -> type[StrEnum]:
    """A Literal of strings as an Enum, so OmegaConf rejects other values and lists the allowed ones."""
    if values not in _ENUMS:
        _ENUMS[values] = StrEnum("Choice_" + "_".join(values), {v: v for v in values})
    return _ENUMS[values]


def _checked_type(tp: Any) -> Any:
    """The type OmegaConf can check for an annotation, else Any (unions, library objects, callables)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) == 1 and len(rest) < len(args):
            inner = _checked_type(rest[0])
            return Any if inner is Any else typing.Optional[inner]  # noqa: UP045 (OmegaConf needs Optional)
        return Any
    if tp in _SIMPLE:
        return tp
    if origin is typing.Literal and args and all(isinstance(a, str) for a in args):
        return _choice_enum(args)
    if origin is list and len(args) == 1 and args[0] in _SIMPLE:
        return list[args[0]]
    return Any


def _storable(value: Any) -> bool:
    """A plain value a YAML file could hold (not a library object)."""
    if value is None or isinstance(value, (*_SIMPLE, Enum)):
        return True
    if isinstance(value, list | tuple):
        return all(_storable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _storable(v) for k, v in value.items())
    return False


def schema_of(
    cls: type, *, target: str | None = None, runtime: tuple[str, ...] = (), partial: bool = False
) -> type:
    """A structured-config dataclass of ``cls``'s init fields (minus ``runtime``: the values the entry point
    supplies, each of which has its own key elsewhere), with ``_target_`` (and ``_partial_``) first.
    Fields whose default OmegaConf cannot store (library objects) are left out: they keep the class's
    default and are set by ``+key=...`` if ever needed."""
    target = target or f"{cls.__module__}.{cls.__qualname__}"
    hints = typing.get_type_hints(cls)
    specs: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target))]
    if partial:
        specs.append(("_partial_", bool, field(default=True)))
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.name in runtime:
            continue
        tp = _checked_type(hints.get(f.name, Any))
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            specs.append((f.name, tp, field(default=MISSING)))
            continue
        if isinstance(tp, type) and issubclass(tp, Enum) and isinstance(default, str):
            default = tp(default)
        if default is None and tp is not Any and typing.get_origin(tp) is not typing.Union:
            tp = typing.Optional[tp]  # noqa: UP045 (an annotation that forgot None)
        if not _storable(default):
            continue
        defaults[f.name] = default
        if isinstance(default, list | dict):
            specs.append((f.name, tp, field(default_factory=functools.partial(copy.deepcopy, default))))
        else:
            specs.append((f.name, tp, field(default=default)))
    TARGET_DEFAULTS[target] = defaults
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", specs)


def changed_only(node: DictConfig) -> DictConfig:
    """A ``_target_`` node reduced to the keys whose value differs from the target's default."""
    defaults = TARGET_DEFAULTS[node._target_]
    values = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    kept = {k: v for k, v in values.items() if k.startswith("_") or k not in defaults or v != defaults[k]}
    return OmegaConf.create(kept)


def instantiate_node(node: Any, **runtime: Any) -> Any:
    """``hydra.utils.instantiate`` whose failures (bad file, bad row, bad value) surface as the one-line
    ConfigError of their cause instead of Hydra's multi-line wrapper. Lists and dicts reach the target as
    plain Python containers: library configs serialise them (peft's LoraConfig writes JSON)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all", **runtime)
    except InstantiationException as e:
        cause = e.__cause__ or e
        raise ConfigError(f"{node._target_}: {cause}") from e


def builds(node: Any, cls: type) -> bool:
    """Whether ``node``'s ``_target_`` is ``cls`` or a subclass of it, so that a rule follows the class,
    whatever the path it is named by. False for a target that does not import: its instantiation reports
    that, in one line (``instantiate_node``)."""
    import importlib

    module, _, name = str(node._target_).rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(target, type) and issubclass(target, cls)
