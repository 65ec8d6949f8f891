"""The cluster paths and error; Dockerfile, README, secret and strict YAML checks; copy helpers.

None of this is Ray's own checking; all of it is ours. The Dockerfile must build on a pinned Ray
2.60 / Python 3.11+ base with torch and the repository's package and token auth on, and its
instructions and COPY flags are looked up like keys (docker build stops on a misspelt one). The
README must name every file under cluster/, the image build, and only job TOMLs that exist. No
file may hold a secret-looking string. YAML is loaded strictly: a key given twice fails (PyYAML,
Kubernetes and Ray would all keep the last one without a word). The copy helpers write a changed
copy of a cluster file for the tests that check a broken copy fails.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import ray
import yaml
from cluster_keys import leaves

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
CLUSTER_FILES = sorted(p for p in CLUSTER.rglob("*") if p.is_file())
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


class ClusterFileError(Exception):
    """A cluster file that Ray or the cloud would reject, or that breaks a promise of cluster/."""


def ray_rejects(e: Exception) -> str:
    """Ray's message, first line only (a jsonschema error goes on to dump the whole schema)."""
    lines = str(e).splitlines() or [""]
    return f"Ray rejects it: {type(e).__name__}: {lines[0]}"


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    lines = [
        ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def dockerfile_workdir(text: str | None = None) -> str:
    text = (CLUSTER / "Dockerfile").read_text() if text is None else text
    return [args for op, args in dockerfile_instructions(text) if op == "WORKDIR"][-1]


def dockerfile_base(text: str) -> str:
    """The FROM image with the ARG defaults filled in."""
    args, image = {}, ""
    for op, rest in dockerfile_instructions(text):
        if op == "ARG" and "=" in rest:
            name, default = rest.split("=", 1)
            args[name] = default
        elif op == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], ""), rest)
    return image.split()[0] if image else ""


DOCKERFILE = {
    **leaves("FROM RUN CMD LABEL EXPOSE ENV ADD ENTRYPOINT VOLUME USER WORKDIR ARG ONBUILD"),
    **leaves("STOPSIGNAL HEALTHCHECK SHELL MAINTAINER"),
    "COPY": leaves("--chown --chmod --from --link --parents --exclude"),
}


def dockerfile_key_errors(ops: list[tuple[str, str]]) -> list[str]:
    """Misspelt instructions, and misspelt COPY flags (docker build stops on both)."""
    errors = [f"unknown instruction {op!r}" for op, _ in ops if op not in DOCKERFILE]
    flags = [
        w.split("=")[0] for op, args in ops if op == "COPY" for w in args.split() if w[:2] == "--"
    ]
    return errors + [f"COPY: unknown flag {f!r}" for f in flags if f not in DOCKERFILE["COPY"]]


def dockerfile_problems(text: str) -> list[str]:
    """A pinned Ray 2.60 / Python 3.11+ base, torch, the repo's package installed, auth on."""
    ops = dockerfile_instructions(text)
    if errors := dockerfile_key_errors(ops):
        return errors
    base = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)(-\S+)?", dockerfile_base(text))
    problems = []
    if not base or base[1] != ray.__version__ or int(base[2]) < 11:
        problems.append(f"FROM must be rayproject/ray:{ray.__version__}-py311 or later Python")
    copied = [
        w for op, args in ops if op == "COPY" for w in args.split()[:-1] if not w.startswith("--")
    ]
    problems += [
        f"COPY {src}: not in the repository" for src in copied if not (REPO / src).exists()
    ]
    if not {"pyproject.toml", "raytuner", "jobs"} <= set(copied):
        problems.append("COPY must bring in pyproject.toml, raytuner/ and jobs/")
    runs = [args for op, args in ops if op == "RUN"]
    torch = next((i for i, r in enumerate(runs) if re.search(r"pip install .*torch", r)), None)
    package = next(
        (i for i, r in enumerate(runs) if re.search(r"pip install [^&]*\s\.(\s|$)", r)), None
    )
    if torch is None or package is None or torch > package:
        problems.append("RUN pip install torch first, then `pip install .` of the copied repo")
    if ("ENV", "RAY_AUTH_MODE=token") not in ops:
        problems.append("ENV RAY_AUTH_MODE=token: token auth on wherever the image runs")
    return problems


def readme_problems(text: str) -> list[str]:
    """The README names every file here, the image build, and only job TOMLs that exist."""
    problems = [
        f"README does not mention {p.relative_to(REPO)}"
        for p in CLUSTER_FILES
        if p.name != "README.md" and str(p.relative_to(REPO)) not in text
    ]
    if "docker build -f cluster/Dockerfile" not in text:
        problems.append("README must show the image build (docker build -f cluster/Dockerfile)")
    for job in set(re.findall(r"jobs/([\w.-]+\.toml)", text)):
        if not (REPO / "jobs" / job).is_file():
            problems.append(f"README names jobs/{job}, which does not exist")
    return problems


SECRET_PATTERNS = {
    "an AWS access key id": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
    "a PEM block (private key or certificate)": r"-----BEGIN",
    "an AWS secret access key": r"(?i)aws_secret_access_key\s*[:=]\s*\S",
    "a GCP service-account key": r"\"private_key\"|\"type\"\s*:\s*\"service_account\"",
    "a GitHub or Hugging Face token": r"\bgh[pousr]_[A-Za-z0-9]{36}|\bhf_[A-Za-z0-9]{30,}",
    "a long hex string (a Ray token is 32 hex digits)": r"\b[0-9a-fA-F]{32,}\b",
    "a value for a token, secret, password or key": (
        r"(?i)(token|secret|passw(or)?d|api[_-]?key)[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9+/=_\-]{16,}"
    ),
}


def secret_problems(text: str) -> list[str]:
    return [f"looks like {what}" for what, rx in SECRET_PATTERNS.items() if re.search(rx, text)]


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; Kubernetes and Ray would too."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        twice = sorted({str(k) for k in keys if keys.count(k) > 1})
        if twice:
            raise ClusterFileError(f"line {node.start_mark.line + 1}: duplicate key {twice[0]!r}")
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no Python objects


def load(name: str) -> dict:
    return load_yaml((CLUSTER / name).read_text())


def write_copy(tmp_path: Path, name: str, doc: Any) -> Path:
    """A copy of cluster/<name> (same file name) holding ``doc``."""
    path = tmp_path / Path(name).name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def _copy_at(doc: dict, path: str) -> tuple[dict, Any, str]:
    """A deep copy of ``doc``, the node holding dotted ``path`` in it, and the last part."""
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return doc, node, last


def rename_key(doc: dict, path: str, new: str) -> dict:
    """A copy of ``doc`` with the key at dotted ``path`` (list items by index) renamed."""
    doc, node, old = _copy_at(doc, path)
    node[new] = node.pop(old)
    return doc


def set_value(doc: dict, path: str, value: Any) -> dict:
    doc, node, last = _copy_at(doc, path)
    node[int(last) if isinstance(node, list) else last] = value
    return doc
