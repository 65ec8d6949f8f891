"""`validate_file`: one entry point per file under cluster/, and what it dispatches to.

Every file gets the secret scan; a Dockerfile, README, launcher YAML (with `provider:`) or
RayCluster / RayJob manifest gets its own checks (Ray's own validation plus ours, see
cluster_launcher.py, cluster_kuberay.py and cluster_files.py), a Grafana dashboard (`*.json`)
those of cluster_grafana.py, and a YAML file is loaded strictly (a key given twice fails). A
file under cluster/ that none of this covers fails, so a new kind of file cannot slip in
unchecked: its check belongs here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster_files import (
    ClusterFileError,
    dockerfile_problems,
    load_yaml,
    readme_problems,
    secret_problems,
)
from cluster_grafana import dashboard_problems
from cluster_keys import MANIFESTS
from cluster_kuberay import kuberay_problems
from cluster_launcher import launcher_problems


def yaml_problems(doc: Any) -> list[str]:
    if isinstance(doc, dict) and doc.get("kind") in MANIFESTS:
        return kuberay_problems(doc)
    if isinstance(doc, dict) and "provider" in doc:
        return launcher_problems(doc)
    return ["neither a launcher config (provider:) nor a RayCluster/RayJob"]


def validate_file(path: Path) -> None:
    """Raise ClusterFileError listing every problem of one cluster file."""
    text = path.read_text()
    problems = secret_problems(text)
    if path.name == "Dockerfile":
        problems += dockerfile_problems(text)
    elif path.suffix == ".md":
        problems += readme_problems(text)
    elif path.suffix == ".json":
        try:
            problems += dashboard_problems(json.loads(text))
        except ValueError as e:
            problems.append(f"not valid JSON: {e}")
    elif path.suffix in (".yaml", ".yml"):
        try:
            problems += yaml_problems(load_yaml(text))
        except ClusterFileError as e:
            problems.append(str(e))
    else:
        problems.append(
            "no check for this kind of file: add one to tests/operate/cluster_validate.py"
        )
    if problems:
        raise ClusterFileError(f"{path.name}:\n  " + "\n  ".join(problems))
