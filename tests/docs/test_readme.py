"""The documentation tells the truth: CI runs the README's test command, and the job TOML
reference (docs/job-toml.md) documents every job key."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from raytuner.config import SECTIONS

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
JOB_TOML = (REPO / "docs" / "job-toml.md").read_text()  # the job TOML reference


def test_ci_runs_exactly_the_readme_test_command():
    block = re.search(r"# 2\. install and run the tests.*?\n(.+?)\n", README).group(1).strip()
    ci = (REPO / ".ci" / "run").read_text()
    assert block in ci.splitlines()


def test_every_config_key_is_documented_under_its_section():
    tables = list(SECTIONS.items())
    for section, cls in tables:  # grows by the sub-tables ([objective.flow]) as they are met
        heading = f"### `[{section}]`"
        assert heading in JOB_TOML, f"docs/job-toml.md lacks a {heading} heading"
        table = JOB_TOML.split(heading, 1)[1].split("###", 1)[0]
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in table, f"docs/job-toml.md lacks {section}.{field.name}"
            if dataclasses.is_dataclass(hints[field.name]):
                tables.append((f"{section}.{field.name}", hints[field.name]))
