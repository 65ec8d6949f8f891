"""What the documentation points to exists: every repository path the READMEs, docs/ and the
shipped job and cluster files name, every link between the markdown files (to a file, and to a
heading of it); the README stays short and lists every page of docs/; and ``raytuner --version``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from raytuner import cli

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))
MARKDOWN = ["README.md", "cluster/README.md", "jobs/README.md", *PAGES]
DOCS = [
    *MARKDOWN,
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "jobs").glob("*.toml")),
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "jobs").glob("*.yaml")),
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "cluster").rglob("*.yaml")),
    "cluster/Dockerfile",
]
# a path in the repository: starts at one of its top folders, not inside an absolute path or a
# URI (s3://bucket/jobs/… is no file here); templated tails (<family>, *, …) are cut off
PATH = re.compile(
    r"(?<![\w./:-])(?:jobs|cluster|raytuner|tests|docs|\.ci)/[\w.+-]*(?:/[\w.+-]+)*/?"
)
# a markdown link's target: [text](target)
LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MAX_LINES = 450


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


def _anchors(path: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no headings in code blocks
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", body, flags=re.M)}


@pytest.mark.parametrize("doc", MARKDOWN)
def test_every_in_page_link_has_its_heading(doc):
    text = (REPO / doc).read_text()
    anchors = _anchors(REPO / doc)
    links = set(re.findall(r"\]\(#([^)\s]+)\)", text.replace("\n", " ")))
    assert not sorted(links - anchors), f"{doc}: links to no heading: {sorted(links - anchors)}"


@pytest.mark.parametrize("doc", MARKDOWN)
def test_every_link_to_another_file_finds_it_and_its_heading(doc):
    """``[x](docs/figures.md#anchor)``, ``[x](../README.md)``, ``[x](job-toml.md#model)``: the
    file exists (relative to the linking file), and an ``#anchor`` is one of its headings."""
    source = REPO / doc
    broken = []
    for target in LINK.findall(source.read_text()):
        if target.startswith("#") or re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # in-page (the test above), or a URL (http:, https:, mailto:)
        name, _, anchor = target.partition("#")
        path = (source.parent / name).resolve()
        if not path.is_relative_to(REPO) or not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            broken.append(f"{target} (no such heading in {path.relative_to(REPO)})")
    assert not broken, f"{doc}: broken links: {broken}"


def test_the_readme_is_short_and_lists_every_page_of_the_docs():
    readme = (REPO / "README.md").read_text()
    lines = len(readme.splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move details into docs/"
    assert PAGES, "docs/ has no pages"
    unlisted = [page for page in PAGES if f"]({page})" not in readme]
    assert not unlisted, f"README.md links to no {unlisted}: add them to its Documentation list"


def _submits(text: str) -> list[str]:
    """Each `ray job submit` command a text shows, its continuation lines joined (``# `` of a
    comment and ``\\`` line ends dropped)."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    commands, current = [], None
    for line in lines:
        if current is None and re.search(r"ray job submit --", line) and "`ray job" not in line:
            current = line
        elif current is not None:
            current += " " + line.strip()
        if current is not None and not current.rstrip().endswith("\\"):
            commands.append(current)
            current = None
    return commands


@pytest.mark.parametrize("doc", DOCS)
def test_every_ray_job_submit_shown_takes_the_runtime_env_and_token_auth(doc):
    """A `ray job submit` copied from a doc or a job file's header runs as the tests run it:
    with jobs/runtime_env.yaml (the working dir, what the driver needs: the dashboard's Train
    page, `ray job stop`'s wait) against a cluster with token auth, `RAY_AUTH_MODE=token` said
    in the same file (without it: a 49-line traceback)."""
    text = (REPO / doc).read_text()
    for command in _submits(text):
        assert "--runtime-env jobs/runtime_env.yaml" in command, f"{doc}: {command}"
        assert "RAY_AUTH_MODE=token" in text, f"{doc} never says RAY_AUTH_MODE=token: {command}"


def test_the_readme_says_a_cluster_needs_token_auth():
    """README step 5 (a cluster): `ray start --head` turns token auth on, and a client without
    RAY_AUTH_MODE=token gets a 49-line traceback."""
    step = (REPO / "README.md").read_text().split("**5. On a cluster.**")[1].split("**6.")[0]
    assert "export RAY_AUTH_MODE=token" in step


def test_version_names_raytuner_and_what_it_runs_on(capsys):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert cli.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"raytuner {project['version']} (torch "), line
    for package in ("ray", "diffusers", "transformers", "peft"):
        assert f", {package} " in line, line
