"""What every `raytuner bench …` shares: sides alternated in rounds on a quiet machine, their
spread and the load average, torch's thread count for a measurement, and how figures print."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

import psutil
import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for a measurement, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def alternate(
    rounds: int,
    sides: dict[str, Callable[[int], object]],
    settle: Callable[[], object] | None = None,
) -> dict[str, list]:
    """Each side called once a round, in turn (A B A B …): {side: [its result each round]}.
    Alternating spreads the machine's slow and fast spells over both sides; ``settle``, called
    before each side, waits for what the previous side left running (e.g. ``wait_for_quiet``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    out: dict[str, list] = {name: [] for name in sides}
    for r in range(rounds):
        for name, side in sides.items():
            if settle is not None:
                settle()
            out[name].append(side(r))
    return out


def wait_for_quiet(busy_percent: float = 25.0, max_s: float = 5.0) -> float:
    """Wait until the machine's CPUs are less than ``busy_percent`` busy over half a second
    (Ray workers of the side before still exiting, an export finishing), at most ``max_s``;
    returns the seconds waited. A shared machine may never be quiet: then it goes on."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        if psutil.cpu_percent(interval=0.5) < busy_percent:
            break
    return time.monotonic() - start


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the rounds of one side landed, as a fraction."""
    return (max(values) - min(values)) / statistics.median(values)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def round_figures(rounds: int, rates: dict[str, list[float]], before, after) -> dict:
    """The figures every alternating bench adds: its rounds, each side's spread, the load."""
    return {
        "rounds": rounds,
        "spread": {name: round(spread(values), 4) for name, values in rates.items()},
        "load_before": before,
        "load_after": after,
    }


def print_figures(result: dict, as_json: bool) -> dict:
    """One JSON object, or one aligned ``name value`` line per figure."""
    if as_json:
        print(json.dumps(result))
    else:
        width = max(map(len, result)) + 2
        for key, value in result.items():
            print(f"{key:<{width}}{value}")
    return result
