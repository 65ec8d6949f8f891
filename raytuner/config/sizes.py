"""Sizes of memory as a job and `raytuner plan --gpu-memory` write them: a number and an explicit
unit (``80GiB``, ``24GB``), read in bytes (``parse_size``)."""

from __future__ import annotations

import re

from raytuner.config.loader import ConfigError

GiB = 2**30  # as plan counts (trace.GiB); imported without torch

UNITS = {"gib": GiB, "mib": 2**20, "gb": 10**9, "mb": 10**6}  # binary, then decimal
SPELLING = {"gib": "GiB", "mib": "MiB", "gb": "GB", "mb": "MB"}
SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def parse_size(text, what: str = "--gpu-memory") -> int:
    """``--gpu-memory`` (``raytuner.plan``'s ``gpu_memory``, ``scaling.worker_memory``: ``what``
    names it in the error) in bytes: a number and an
    explicit unit, ``GiB``/``MiB`` (binary) or ``GB``/``MB`` (decimal), in any case, e.g.
    ``80GiB``, ``12.5GiB``, ``24GB`` (22.4 GiB). A bare number (bytes? GiB?), ``G`` or ``M``
    (binary or decimal?) and any other text are refused, saying what to write."""
    match = SIZE.fullmatch(text) if isinstance(text, str) else None
    if match and match.group(2).lower() in UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * UNITS[match.group(2).lower()])
    n = match.group(1) if match and float(match.group(1)) > 0 else "24"
    if not isinstance(text, bool) and isinstance(text, int | float) and text > 0:
        n = f"{text / GiB:.4g}" if text >= 2**20 else f"{text:g}"  # bytes, or a size in GiB
    zero = ", more than 0," if match and not float(match.group(1)) else ""
    if match and match.group(2).lower() in ("m", "mi"):  # megabytes meant: say it in M
        raise ConfigError(
            f"{what} {text!r}: give a size{zero} and its unit: {n}MiB (binary, as "
            f"nvidia-smi counts) or {n}MB (decimal: {float(n) * 1e6 / 2**20:.1f} MiB)"
        )
    raise ConfigError(
        f"{what} {text!r}: give a size{zero} and its unit: {n}GiB (binary, as "
        f'nvidia-smi counts: a card sold as "{n} GB" holds about {n}GiB) or {n}GB (decimal: '
        f"{float(n) * 1e9 / GiB:.1f} GiB); MiB and MB work the same"
    )
