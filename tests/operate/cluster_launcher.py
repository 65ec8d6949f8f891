"""Checks of the `ray up` launcher YAMLs (cluster/aws.yaml, cluster/gcp.yaml).

Ray's own checks come first: `prepare_config` (merges Ray's per-provider defaults.yaml, setup
commands, docker settings, per-type worker bounds) and `validate_config` (Ray's ray-schema.json,
the head type, the worker bounds), which is what `ray up` runs first
(`commands._bootstrap_config`); Ray's next steps there (resource autodetection, provider
bootstrap) need boto3 / googleapiclient and an account, so they are not run. Ray checks neither
the `provider` section nor `node_config` (any key passes), so every key is also looked up in our
tables: Ray's own schema for the top level and node types (the message then names a misspelt key
even where jsonschema reports a missing one instead) and the EC2 / Compute Engine fields of
cluster_keys.py. Then the promises of cluster/README.md are ours to check: a head without CPUs,
workers from zero, GPU workers, spot preferred over on demand, what Compute Engine rejects at
launch, autoscaling spelt out, token auth and a loopback dashboard.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import ray
from cluster_files import ray_rejects
from cluster_keys import ANY, NODE_CONFIGS, MapOf, key_errors, leaves
from ray.autoscaler._private.util import prepare_config, validate_config

RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


def launcher_shape(provider_type: str) -> dict[str, Any]:
    """Ray's schema for a launcher file, with the provider and node_config keys it leaves open."""
    schema = json.loads(RAY_SCHEMA.read_text())["properties"]
    node_type = schema["available_node_types"]["patternProperties"][".*"]["properties"]
    node_config = NODE_CONFIGS.get(provider_type, ANY)
    return {
        **leaves(schema),
        "provider": leaves(schema["provider"]["properties"]),
        "available_node_types": MapOf({**leaves(node_type), "node_config": node_config}),
    }


def launcher_key_errors(config: dict) -> list[str]:
    """Unknown keys anywhere, notably where Ray lets any key through (provider, node_config)."""
    provider_type = config.get("provider", {}).get("type")
    errors = key_errors(config, launcher_shape(provider_type), "")
    if provider_type not in NODE_CONFIGS:
        errors.append(f"provider.type: no node_config table for {provider_type!r}")
    return errors


def ray_prepared(config: dict) -> dict:
    """`ray up`'s offline checks: prepare_config (Ray's defaults merged in), validate_config."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def is_spot(provider: str, node_config: dict) -> bool:
    if provider == "aws":
        return node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    scheduling = node_config.get("scheduling", {})
    return scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True


def head_problems(config: dict) -> list[str]:
    """The head takes no training work: it advertises no CPU and no GPU to the scheduler."""
    head = config["available_node_types"][config["head_node_type"]]
    resources = head.get("resources", {})
    if resources.get("CPU") != 0 or resources.get("GPU", 0) != 0:
        return [f"head resources {resources}: CPU and GPU must be 0 (no tasks on the head)"]
    return []


def worker_problems(config: dict) -> list[str]:
    """Workers scale from zero, each is a GPU node, spot is preferred, on demand is the fallback."""
    provider = config["provider"]["type"]
    workers = {
        k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]
    }
    problems = [
        f"{name}: {msg}"
        for name, node in workers.items()
        for ok, msg in [
            (node.get("min_workers") == 0, "min_workers must be 0 (scale to zero)"),
            (node.get("max_workers", 0) >= 1, "max_workers must be at least 1"),
            (node.get("resources", {}).get("GPU", 0) >= 1, "resources must name its GPUs"),
        ]
        if not ok
    ]
    spot = {
        k: v.get("priority", 0) for k, v in workers.items() if is_spot(provider, v["node_config"])
    }
    ondemand = {k: v.get("priority", 0) for k, v in workers.items() if k not in spot}
    if not spot or not ondemand:
        return [*problems, f"need a spot and an on-demand worker type, got spot={sorted(spot)}"]
    if max(spot.values()) <= max(ondemand.values()):
        problems.append("a spot type must have a higher priority than every on-demand type")
    return problems


def gcp_problems(config: dict) -> list[str]:
    """What Compute Engine rejects at launch: GPU VMs that migrate, spot VMs that restart,
    disks in another zone than the VM."""
    if config["provider"]["type"] != "gcp":
        return []
    problems, zone = [], config["provider"].get("availability_zone")
    for name, node in config["available_node_types"].items():
        node_config = node["node_config"]
        scheduling = node_config.get("scheduling", {})
        gpu = node.get("resources", {}).get("GPU", 0) >= 1
        if gpu and not node_config.get("guestAccelerators"):
            problems.append(f"{name}: a GPU type needs guestAccelerators")
        if gpu and scheduling.get("onHostMaintenance") != "TERMINATE":
            problems.append(f"{name}: GPU VMs need scheduling.onHostMaintenance TERMINATE")
        if is_spot("gcp", node_config) and scheduling.get("automaticRestart") is not False:
            problems.append(f"{name}: spot VMs need scheduling.automaticRestart false")
        for disk in node_config.get("disks", []):
            disk_type = disk.get("initializeParams", {}).get("diskType", "")
            disk_zone = re.search(r"zones/([^/]+)/", disk_type)
            if disk_zone and disk_zone[1] != zone:
                problems.append(f"{name}: diskType in zone {disk_zone[1]}, the VM in {zone}")
    return problems


def autoscaling_problems(raw: dict) -> list[str]:
    """Autoscaling is spelt out in the file, not left to Ray's defaults."""
    return [
        f"{key} must be set in the file and > 0"
        for key in ("max_workers", "upscaling_speed", "idle_timeout_minutes")
        if not raw.get(key, 0) > 0
    ]


def auth_problems(config: dict) -> list[str]:
    """Token auth in every container, with the token file shipped by file_mounts."""
    options = " ".join(config.get("docker", {}).get("run_options", []))
    env = dict(re.findall(r"(?:-e|--env)[ =](RAY_AUTH_\w+)=(\S+)", options))
    problems = []
    if env.get("RAY_AUTH_MODE") != "token":
        problems.append("docker.run_options must set RAY_AUTH_MODE=token")
    if env.get("RAY_AUTH_TOKEN_PATH") not in config.get("file_mounts", {}):
        problems.append("RAY_AUTH_TOKEN_PATH must name a file_mounts target (the token file)")
    return problems


def dashboard_problems(raw: dict, prepared: dict) -> list[str]:
    """The dashboard and job API listen on loopback only; start commands are the file's own."""
    problems = [
        f"{key} must be written out (Ray's defaults start the dashboard on 0.0.0.0)"
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        if key not in raw
    ]
    for command in prepared["head_start_ray_commands"]:
        for host in re.findall(r"--dashboard-host[= ](\S+)", command):
            if host not in ("127.0.0.1", "localhost"):
                problems.append(f"--dashboard-host={host}: bind the dashboard to 127.0.0.1")
    return problems


def launcher_problems(raw: dict) -> list[str]:
    """Everything wrong with a launcher YAML: unknown keys and Ray's verdict, then the promises."""
    errors = launcher_key_errors(raw)
    try:
        prepared = ray_prepared(raw)
    except Exception as e:  # Ray's own exceptions: jsonschema, ValueError, KeyError, ...
        return [*errors, ray_rejects(e)]
    if errors:
        return errors  # the promises below read node_config; first make its keys right
    return [
        *head_problems(prepared),
        *worker_problems(prepared),
        *gcp_problems(prepared),
        *autoscaling_problems(raw),
        *auth_problems(prepared),
        *dashboard_problems(raw, prepared),
    ]
