"""What the documentation points to exists: every repository path the READMEs and the shipped
job and cluster files name, every in-page link of the READMEs; and ``raytuner --version``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from raytuner import cli

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "cluster/README.md",
    "jobs/README.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "jobs").glob("*.toml")),
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "jobs").glob("*.yaml")),
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "cluster").rglob("*.yaml")),
    "cluster/Dockerfile",
]
# a path in the repository: starts at one of its top folders, not inside an absolute path or a
# URI (s3://bucket/jobs/… is no file here); templated tails (<family>, *, …) are cut off
PATH = re.compile(r"(?<![\w./:-])(?:jobs|cluster|raytuner|tests|\.ci)/[\w.+-]*(?:/[\w.+-]+)*/?")


def _paths(text: str) -> set[str]:
    return {m.group(0).rstrip(".,;:") for m in PATH.finditer(text)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_path_a_doc_names_exists(doc):
    text = (REPO / doc).read_text()
    missing = sorted(p for p in _paths(text) if not (REPO / p).exists())
    assert not missing, f"{doc} names paths that are not in the repository: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", "cluster/README.md", "jobs/README.md"])
def test_every_in_page_link_has_its_heading(doc):
    text = (REPO / doc).read_text()
    body = re.sub(r"```.*?```", "", text, flags=re.S)  # no headings inside code blocks
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", body, flags=re.M)}
    links = set(re.findall(r"\]\(#([^)\s]+)\)", text.replace("\n", " ")))
    assert not sorted(links - anchors), f"{doc}: links to no heading: {sorted(links - anchors)}"


def test_version_names_raytuner_and_what_it_runs_on(capsys):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert cli.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"raytuner {project['version']} (torch "), line
    for package in ("ray", "diffusers", "transformers", "peft"):
        assert f", {package} " in line, line
