"""Checks of the KubeRay manifests (cluster/kuberay/raycluster.yaml, rayjob.yaml).

Ray's own check is `_derive_autoscaling_config_from_ray_cr`, which the autoscaler in the head pod
runs every round on the live RayCluster, and which ends in `validate_config`: a broken manifest
otherwise shows as a crash-looping autoscaler. It needs metadata.namespace, which kubectl fills in
at apply time ("default" here), and a RayJob's rayClusterSpec is wrapped into a RayCluster for
it. The derivation reads the fields it needs and ignores the rest (as the API server prunes
unknown fields without a word), so every key is first looked up in our tables (the RayCluster /
RayJob CRD, Pod and Container fields, `ray start`'s options; cluster_keys.py). Then the promises
of cluster/README.md are ours to check: this Ray and one image, in-tree autoscaling with an idle
timeout, a head without CPUs behind a ClusterIP service, GPU worker groups from zero, token auth
with secrets from Secrets, and a RayJob that runs a real job TOML and cleans its cluster up.
"""

from __future__ import annotations

import re
import shlex

import ray
from cluster_files import REPO, dockerfile_workdir, ray_rejects
from cluster_keys import MANIFESTS, key_errors
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)


def as_ray_cluster(doc: dict) -> dict:
    """The RayCluster the KubeRay autoscaler sees (a RayJob's cluster, namespace filled in)."""
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    metadata = {"namespace": "default", **doc.get("metadata", {})}
    return {
        "apiVersion": doc.get("apiVersion"),
        "kind": "RayCluster",
        "metadata": metadata,
        "spec": spec,
    }


def ray_derived(doc: dict) -> dict:
    """The autoscaling config Ray derives from the cluster (and validates with validate_config)."""
    return _derive_autoscaling_config_from_ray_cr(as_ray_cluster(doc))


def groups(spec: dict) -> list[tuple[str, dict]]:
    return [("headgroup", spec["headGroupSpec"])] + [
        (g["groupName"], g) for g in spec.get("workerGroupSpecs", [])
    ]


def kuberay_head_problems(spec: dict, derived: dict) -> list[str]:
    """The head takes no training work, and its service stays inside the cluster."""
    head = spec["headGroupSpec"]
    resources = derived["available_node_types"]["headgroup"]["resources"]
    problems = []
    if head.get("rayStartParams", {}).get("num-cpus") != "0":
        problems.append('headGroupSpec.rayStartParams must set num-cpus: "0"')
    if resources.get("CPU") != 0 or resources.get("GPU", 0) != 0:
        problems.append(f"the autoscaler sees the head with {resources}: CPU and GPU must be 0")
    if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
        problems.append("the head service must be ClusterIP with no Ingress (use port-forward)")
    return problems


def kuberay_worker_problems(spec: dict, derived: dict) -> list[str]:
    """Every worker group scales from zero and is a GPU group, as the autoscaler sees it."""
    problems = []
    for group in spec.get("workerGroupSpecs", []):
        name = group["groupName"]
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        for ok, msg in [
            (group.get("minReplicas") == 0, "minReplicas must be 0 (scale to zero)"),
            (group.get("replicas", 0) == 0, "replicas must start at 0"),
            (group.get("maxReplicas", 0) >= 1, "maxReplicas must be at least 1"),
            ("nvidia.com/gpu" in limits, "the Ray container must limit nvidia.com/gpu"),
            (derived["available_node_types"][name]["resources"].get("GPU", 0) >= 1, "no GPUs"),
        ]:
            if not ok:
                problems.append(f"{name}: {msg}")
    return problems


def kuberay_security_problems(spec: dict) -> list[str]:
    """Token auth is on and no secret is written into an env value."""
    problems = []
    if spec.get("authOptions", {}).get("mode") != "token":
        problems.append("authOptions.mode must be token")
    for name, group in groups(spec):
        for container in group["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                if re.search(r"TOKEN|SECRET|PASSWORD|KEY", env["name"]) and "value" in env:
                    problems.append(f"{name}: env {env['name']} must come from a Secret")
    return problems


def kuberay_spec_problems(spec: dict, derived: dict) -> list[str]:
    """The cluster runs this Ray, autoscales, and every Ray container runs the one image."""
    images = {g["template"]["spec"]["containers"][0]["image"] for _, g in groups(spec)}
    return [
        msg
        for ok, msg in [
            (spec.get("rayVersion") == ray.__version__, f"rayVersion must be {ray.__version__}"),
            (spec.get("enableInTreeAutoscaling") is True, "enableInTreeAutoscaling must be true"),
            (
                spec.get("autoscalerOptions", {}).get("idleTimeoutSeconds", 0) > 0,
                "set idleTimeoutSeconds",
            ),
            (derived["idle_timeout_minutes"] > 0, "the idle timeout must be > 0"),
            (len(images) == 1, f"one image for every group, got {sorted(images)}"),
        ]
        if not ok
    ]


def entrypoint_problems(entrypoint: str) -> list[str]:
    """`raytuner run` of a job TOML in jobs/, inside the image, with storage every pod reaches."""
    words = shlex.split(entrypoint)
    if words[:2] != ["raytuner", "run"] or len(words) < 3:
        return [f"entrypoint must be `raytuner run <job TOML>`, got {entrypoint!r}"]
    problems = []
    job = re.fullmatch(r"(.*/)?jobs/([\w.-]+\.toml)", words[2])
    if not job or not (REPO / "jobs" / job.group(2)).is_file():
        problems.append(f"{words[2]}: no such job TOML in jobs/")
    elif job.group(1) and job.group(1) != dockerfile_workdir() + "/":
        problems.append(f"{words[2]}: the image has jobs/ under {dockerfile_workdir()}")
    settings = dict(w.split("=", 1) for w in words[3:] if "=" in w)
    for key in ("data.images", "data.cache", "train.output"):
        if "://" not in settings.get(key, ""):
            problems.append(f"entrypoint must --set {key} to a bucket URI (s3://, gs://)")
    return problems


def rayjob_problems(doc: dict) -> list[str]:
    """The job names a real job TOML, cleans its cluster up, and is submitted a known way."""
    spec = doc["spec"]
    modes = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
    problems = entrypoint_problems(spec.get("entrypoint", ""))
    if spec.get("shutdownAfterJobFinishes") is not True:
        problems.append("shutdownAfterJobFinishes must be true (GPU pods go when the job ends)")
    if spec.get("submissionMode", "K8sJobMode") not in modes:
        problems.append(f"submissionMode must be one of {modes}")
    return problems


def kuberay_problems(doc: dict) -> list[str]:
    """Everything wrong with a RayCluster or RayJob: unknown keys first, then Ray's verdict."""
    errors = key_errors(doc, MANIFESTS[doc["kind"]], doc["kind"])
    if errors:
        return errors  # Ray reads only the keys it knows; its verdict would be misleading
    try:
        derived = ray_derived(doc)
    except Exception as e:  # Ray's own exceptions: jsonschema, ValueError, KeyError, ...
        return [ray_rejects(e)]
    spec = as_ray_cluster(doc)["spec"]
    problems = [
        *kuberay_spec_problems(spec, derived),
        *kuberay_head_problems(spec, derived),
        *kuberay_worker_problems(spec, derived),
        *kuberay_security_problems(spec),
    ]
    return problems + (rayjob_problems(doc) if doc["kind"] == "RayJob" else [])
