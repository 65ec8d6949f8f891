"""TOML tables into frozen dataclasses: unknown keys, wrong types and numbers outside their key's
range (``config/ranges.py``) are rejected with where they came from (the file, or the ``--set``
override), the dotted key, the nearest known name and what is allowed; ``--set`` overrides are
parsed as TOML values."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from typing import Any

from raytuner.config import ranges


class ConfigError(ValueError):
    """A job file or override the user must change (CLI exit code 2)."""


def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """A value check of a section's ``__post_init__``: ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(allowed)}")


def did_you_mean(name: str, known: list[str]) -> str:
    """`` (did you mean x?)`` for the nearest of ``known`` to a misspelt ``name`` (difflib), or
    "" when none is near."""
    near = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {near[0]}?)" if near else ""


def unknown_key(where: str, cls: type, section: str, key: str) -> ConfigError:
    """The error for ``section.key``, which ``cls`` (the table ``[section]``) does not have:
    ``where`` it came from (the job file, or ``--set …``), the nearest known key (or the new
    place of a key that moved) and the table's keys."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    moved = getattr(cls, "MOVED", {})
    if key in moved:
        return ConfigError(
            f"{where}: {section}.{key} moved to {moved[key]}; "
            f"allowed keys in [{section}]: " + ", ".join(allowed)
        )
    hint = did_you_mean(key, allowed)
    if not hint and (old := difflib.get_close_matches(key, list(moved), n=1)):
        hint = f" (did you mean {moved[old[0]]}?)"
    return ConfigError(
        f"{where}: unknown key {section}.{key}{hint}; allowed keys in [{section}]: "
        + ", ".join(allowed)
    )


def check_key(cls: type, section: str, key: str, where: str) -> None:
    """Refuse an override's ``section.key`` (``key`` may be ``sub.key``) that names no key of
    ``cls`` (the table ``[section]``) or of its sub-tables, as the file's own keys are refused
    (``unknown_key``) but naming ``where`` (the ``--set``), as is a path that goes on below a
    value. The value's type is checked with the file's."""
    names = key.split(".")
    for depth, name in enumerate(names, 1):
        if name not in {f.name for f in dataclasses.fields(cls)}:
            raise unknown_key(where, cls, section, name)
        tp = typing.get_type_hints(cls)[name]
        if depth < len(names) and not dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"{where}: {section}.{name} is a value in the job file ({_type_name(tp)}), "
                "not a table"
            )
        cls, section = tp, f"{section}.{name}"


def _type_name(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "table"
    if isinstance(tp, type):
        return {"str": "string", "int": "integer", "float": "float", "bool": "boolean"}.get(
            tp.__name__, tp.__name__
        )
    if typing.get_origin(tp) is list:
        return f"array of {_type_name(typing.get_args(tp)[0])}"
    return " or ".join(_type_name(a) for a in typing.get_args(tp))


def _matches(value: Any, tp: Any) -> bool:
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is list:
        return isinstance(value, list) and all(_matches(v, typing.get_args(tp)[0]) for v in value)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _convert(value: Any, tp: Any, where: str, dotted: str) -> Any:
    """Checked TOML value -> field value (ints as floats, tables of nested dataclasses)."""
    if tp is float:
        return float(value)
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, where, dotted)
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return [build_section(args[0], v, where, f"{dotted}[{i}]") for i, v in enumerate(value)]
    return value


def build_section(cls: type, values: Any, where: str, section: str) -> Any:
    """A table into ``cls``; a field typed as a dataclass is a sub-table (``[section.key]``).
    A key in the class's ``MOVED`` (old name -> where it lives now) is refused with its new
    place."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: [{section}] must be a table, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in allowed:
            raise unknown_key(where, cls, section, key)
        if not _matches(value, hints[key]):
            raise ConfigError(
                f"{where}: {section}.{key} = {value!r} has type {type(value).__name__}; "
                f"expected {_type_name(hints[key])}"
            )
        kwargs[key] = _convert(value, hints[key], where, f"{section}.{key}")
    if out_of_range := ranges.problem(cls, values, section):
        raise ConfigError(f"{where}: {out_of_range}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
    ]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {section}.{', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, typed value); ``section.sub.key=value`` (a key of
    a sub-table) -> (section, "sub.key", value). Bare words become strings."""
    dotted, sep, raw = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not all(key.split(".")):
        raise ConfigError(f"--set {text!r}: use --set section.key=value or section.sub.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # an unquoted string such as a path
    return section, key, value


def set_dotted(raw: dict, section: str, key: str, value: Any, text: str) -> None:
    """Put an override's value at ``section.key`` of the raw job table (``key`` may be
    ``sub.key``: a sub-table, made when the file has none)."""
    *subs, last = key.split(".")
    table, path = raw, []
    for name in [section, *subs]:
        path.append(name)
        table = table.setdefault(name, {})
        if not isinstance(table, dict):
            raise ConfigError(
                f"--set {text}: {'.'.join(path)} is a value in the job file, not a table"
            )
    table[last] = value
