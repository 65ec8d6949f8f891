"""The README tells the truth: CI runs its test command, and it documents every job key."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from raytuner.config import SECTIONS

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    block = re.search(r"# 2\. install and run the tests.*?\n(.+?)\n", README).group(1).strip()
    ci = (REPO / ".ci" / "run").read_text()
    assert block in ci.splitlines()


def test_every_config_key_is_documented_under_its_section():
    tables = list(SECTIONS.items())
    for section, cls in tables:  # grows by the sub-tables ([objective.flow]) as they are met
        assert f"### `[{section}]`" in README, f"README lacks a ### `[{section}]` heading"
        table = README.split(f"### `[{section}]`", 1)[1].split("###", 1)[0]
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in table, f"README lacks {section}.{field.name}"
            if dataclasses.is_dataclass(hints[field.name]):
                tables.append((f"{section}.{field.name}", hints[field.name]))
