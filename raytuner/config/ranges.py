"""The allowed range of every numeric key of a job, declared beside the key in its section's
dataclass (``ranged``: the field's metadata) and checked by the loader for every value a job
file or a ``--set`` gives (``loader.build_section``): a value outside its range, and a float that
is not finite (``nan``, ``inf``), is refused with the key, the value and what is allowed.

A range is ``low``/``high`` bounds (each included unless ``*_open``; ``None``: none), and may
allow 0 besides (``zero``: what 0 means, e.g. "the family's default"); a list's range is each
element's. ``tests/config/test_config_ranges.py`` fails for a numeric key declared without one.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

RANGE = "range"  # the field-metadata key of a field's Range
# the largest seed: TOML's largest integer, which every random generator raytuner seeds takes
# (torch.Generator.manual_seed takes < 2**64, numpy's any integer >= 0)
SEED_MAX = 2**63 - 1
# Ray counts a resource in steps of 0.0001: a smaller fraction is refused by Ray at start
RESOURCE_STEP = 0.0001


@dataclass(frozen=True)
class Range:
    """What a numeric key allows (see the module's docstring)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is refused ("> low")
    high_open: bool = False  # high itself is refused ("< high")
    zero: str = ""  # 0 is allowed too, meaning this
    # given as 0, this key of the same section must be set (not 0): one of the two is needed
    zero_needs: str = ""
    hint: str = ""  # what the message adds: why, or what a user of another trainer means

    def allows(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.zero and value == 0:
            return True
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        high = self.high
        return high is None or not (value > high or (self.high_open and value == high))

    def text(self, integer: bool) -> str:
        """What is allowed, in words: ``an integer >= 1 and <= 4096``."""
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {_number(self.low, integer)}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_open else '<='} {_number(self.high, integer)}")
        allowed = f"{'an integer' if integer else 'a finite number'} {' and '.join(bounds)}"
        return f"0 ({self.zero}) or {allowed}" if self.zero else allowed.rstrip()


def _number(bound: float, integer: bool) -> str:
    return str(int(bound)) if integer or float(bound).is_integer() else f"{bound:g}"


def ranged(default: Any, low: float | None = None, high: float | None = None, **how: Any) -> Any:
    """A numeric field of a section with its allowed range (``Range(low, high, **how)``);
    ``default`` a list: its elements' range, the list the field's default."""
    metadata = {RANGE: Range(low, high, **how)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def integer(tp: Any) -> bool:
    """Whether a numeric field's type (``int``, ``float``, ``list[int]``, ``int | list[int]``)
    holds integers."""
    args = typing.get_args(tp)
    return tp is int or (bool(args) and all(integer(a) for a in args))


def problem(cls: type, values: dict[str, Any], section: str) -> str:
    """Why a value of ``values`` (the keys a table gives ``cls``, as the TOML has them; the
    section ``section``) is out of its field's range, or "" when none is. Values the table
    leaves out are the defaults, which are in range."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        rng = f.metadata.get(RANGE)
        if rng is None or f.name not in values:
            continue
        value = values[f.name]
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if not rng.allows(item):
                key = f"{section}.{f.name}" + ("" if i is None else f"[{i}]")
                hint = f" ({rng.hint})" if rng.hint else ""
                return f"{key} = {item!r}: must be {rng.text(integer(hints[f.name]))}{hint}"
        if rng.zero_needs and value == 0:
            other = values.get(rng.zero_needs, _default(_field(cls, rng.zero_needs)))
            if not other:
                allowed = dataclasses.replace(rng, zero="").text(integer(hints[f.name]))
                return (
                    f"{section}.{f.name} = 0: must be {allowed} while {section}.{rng.zero_needs}"
                    f" = {other!r}" + (f" ({rng.hint})" if rng.hint else "")
                )
    return ""


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)
