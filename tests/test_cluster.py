"""Each file under cluster/ passes the checks Ray applies when it is used; a broken copy fails.

A broken cluster file shows late: `ray up` stops on a schema error once credentials are set up,
the KubeRay autoscaler in the head pod crash-loops, a cloud API rejects a launch minutes in, or
worse, a misspelt key is dropped and the cluster quietly runs without it. These checks find the
same faults offline, with no cloud SDK, credentials or network:

* Launcher YAMLs (aws.yaml, gcp.yaml): Ray's `prepare_config` (merges Ray's per-provider
  defaults.yaml, setup commands, docker settings, per-type worker bounds) and `validate_config`
  (Ray's ray-schema.json, the head type, the worker bounds): what `ray up` runs first
  (`commands._bootstrap_config`). Ray's next steps there (resource autodetection, provider
  bootstrap) need boto3 / googleapiclient and an account, so they are not run.
* KubeRay manifests: `_derive_autoscaling_config_from_ray_cr`, which the autoscaler in the head
  pod runs every round on the live RayCluster, and which ends in `validate_config`. It needs
  metadata.namespace, which kubectl fills in at apply time ("default" here). A RayJob's
  rayClusterSpec is wrapped into a RayCluster for it.

Ray checks neither the `provider` section nor `node_config` (any key passes), and the KubeRay
derivation reads the fields it needs and ignores the rest (as the API server prunes unknown
fields without a word). So every key is also looked up in tables: Ray's own schema for the
launcher's top level and node types (the message then names a misspelt key even where jsonschema
reports a missing one instead), EC2 RunInstances and Compute Engine instances.insert fields
(plus Ray's additions), the RayCluster / RayJob CRD fields, the Pod and Container fields, and
`ray start`'s options for rayStartParams. A key given twice in a YAML file fails too.

Then the promises of cluster/README.md (a head without CPUs, workers from zero, GPU workers,
spot preferred over on demand, token auth, a loopback dashboard, ...) are checked, the
Dockerfile and the README have checks of their own, and no file may hold a secret-looking
string. A file under cluster/ that none of this covers fails.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import start as ray_start_command

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
CLUSTER_FILES = sorted(p for p in CLUSTER.rglob("*") if p.is_file())
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"


class ClusterFileError(Exception):
    """A cluster file that Ray or the cloud would reject, or that breaks a promise of cluster/."""


# --- allowed keys --------------------------------------------------------------------------

ANY = None  # a value whose keys are not looked into


class MapOf:
    """A mapping with free-form keys (labels, quantities) whose values follow ``shape``."""

    def __init__(self, shape: Any = ANY) -> None:
        self.shape = shape


def leaves(names: Any) -> dict[str, Any]:
    """Keys whose values are not looked into: a space-separated string or any iterable."""
    return dict.fromkeys(names.split() if isinstance(names, str) else names, ANY)


def _ray_start_options() -> dict[str, Any]:
    """rayStartParams keys: KubeRay turns each into a `ray start --<key>` flag."""
    return leaves(o[2:] for p in ray_start_command.params for o in p.opts if o[:2] == "--")


# EC2 RunInstances (boto3 create_instances) fields a node can use; SubnetIds is Ray's (one
# SubnetId per launch). MinCount/MaxCount/ClientToken/DryRun are Ray's to set, so not listed.
AWS_NODE_CONFIG = {
    **leaves(
        "ImageId InstanceType KeyName SubnetId SubnetIds SecurityGroupIds SecurityGroups UserData "
        "EbsOptimized Monitoring Placement KernelId RamdiskId Ipv6AddressCount Ipv6Addresses "
        "PrivateIpAddress NetworkInterfaces LaunchTemplate CreditSpecification CpuOptions "
        "CapacityReservationSpecification HibernationOptions LicenseSpecifications EnclaveOptions "
        "PrivateDnsNameOptions MaintenanceOptions DisableApiStop DisableApiTermination "
        "EnablePrimaryIpv6 InstanceInitiatedShutdownBehavior NetworkPerformanceOptions Operator "
        "ElasticGpuSpecification ElasticInferenceAccelerators AdditionalInfo"
    ),
    "BlockDeviceMappings": [
        {
            **leaves("DeviceName VirtualName NoDevice"),
            "Ebs": leaves(
                "DeleteOnTermination Iops SnapshotId VolumeSize VolumeType KmsKeyId Throughput "
                "OutpostArn Encrypted AvailabilityZone AvailabilityZoneId VolumeInitializationRate"
            ),
        }
    ],
    "InstanceMarketOptions": {
        "MarketType": ANY,
        "SpotOptions": leaves(
            "MaxPrice SpotInstanceType BlockDurationMinutes ValidUntil InstanceInterruptionBehavior"
        ),
    },
    "IamInstanceProfile": leaves("Arn Name"),
    "MetadataOptions": leaves(
        "HttpTokens HttpPutResponseHopLimit HttpEndpoint HttpProtocolIpv6 InstanceMetadataTags"
    ),
    "TagSpecifications": [{"ResourceType": ANY, "Tags": [leaves("Key Value")]}],
}

# Compute Engine instances.insert fields of an Instance (GPU VMs, not TPUs);
# sourceInstanceTemplate is Ray's (passed as the insert call's parameter).
GCP_NODE_CONFIG = {
    **leaves(
        "machineType description canIpForward minCpuPlatform networkInterfaces tags "
        "shieldedInstanceConfig confidentialInstanceConfig advancedMachineFeatures "
        "reservationAffinity resourcePolicies displayDevice deletionProtection hostname "
        "privateIpv6GoogleAccessType networkPerformanceConfig keyRevocationActionType params "
        "instanceEncryptionKey sourceInstanceTemplate"
    ),
    "disks": [
        {
            **leaves(
                "boot autoDelete type mode deviceName source interface diskEncryptionKey "
                "guestOsFeatures diskSizeGb licenses savedState forceAttach architecture"
            ),
            "initializeParams": {
                **leaves(
                    "diskName diskSizeGb diskType sourceImage sourceSnapshot "
                    "sourceImageEncryptionKey sourceSnapshotEncryptionKey description "
                    "provisionedIops provisionedThroughput resourcePolicies onUpdateAction "
                    "architecture licenses replicaZones resourceManagerTags storagePool "
                    "enableConfidentialCompute"
                ),
                "labels": MapOf(),
            },
        }
    ],
    "guestAccelerators": [leaves("acceleratorType acceleratorCount")],
    "scheduling": leaves(
        "onHostMaintenance automaticRestart preemptible provisioningModel "
        "instanceTerminationAction nodeAffinities minNodeCpus locationHint maxRunDuration "
        "terminationTime onInstanceStopAction localSsdRecoveryTimeout availabilityDomain "
        "hostErrorTimeoutSeconds"
    ),
    "metadata": {"items": [leaves("key value")], "fingerprint": ANY},
    "serviceAccounts": [leaves("email scopes")],
    "labels": MapOf(),
}

NODE_CONFIGS = {"aws": AWS_NODE_CONFIG, "gcp": GCP_NODE_CONFIG}

# Kubernetes core/v1: the Pod and Container fields (nested where these files use them).
RESOURCES = {"requests": MapOf(), "limits": MapOf(), "claims": ANY}
ENV_VAR = {
    "name": ANY,
    "value": ANY,
    "valueFrom": {
        "secretKeyRef": leaves("name key optional"),
        "configMapKeyRef": leaves("name key optional"),
        "fieldRef": leaves("apiVersion fieldPath"),
        "resourceFieldRef": leaves("containerName resource divisor"),
        "fileKeyRef": ANY,
    },
}
ENV_FROM = {
    "prefix": ANY,
    "secretRef": leaves("name optional"),
    "configMapRef": leaves("name optional"),
}
VOLUME_MOUNT = leaves(
    "name mountPath readOnly subPath subPathExpr mountPropagation recursiveReadOnly"
)
CONTAINER = {
    **leaves(
        "name image imagePullPolicy command args workingDir lifecycle livenessProbe readinessProbe "
        "startupProbe securityContext stdin stdinOnce tty terminationMessagePath "
        "terminationMessagePolicy volumeDevices resizePolicy restartPolicy restartPolicyRules"
    ),
    "env": [ENV_VAR],
    "envFrom": [ENV_FROM],
    "ports": [leaves("containerPort name protocol hostPort hostIP")],
    "resources": RESOURCES,
    "volumeMounts": [VOLUME_MOUNT],
}
VOLUME = {
    **leaves(
        "name secret configMap persistentVolumeClaim hostPath csi ephemeral projected downwardAPI "
        "nfs image"
    ),
    "emptyDir": leaves("medium sizeLimit"),
}
POD_SPEC = {
    **leaves(
        "activeDeadlineSeconds affinity automountServiceAccountToken dnsConfig dnsPolicy "
        "enableServiceLinks ephemeralContainers hostAliases hostIPC hostNetwork hostPID hostUsers "
        "hostname hostnameOverride imagePullSecrets nodeName os overhead preemptionPolicy priority "
        "priorityClassName readinessGates resourceClaims resources restartPolicy runtimeClassName "
        "schedulerName schedulingGates securityContext serviceAccount serviceAccountName "
        "setHostnameAsFQDN shareProcessNamespace subdomain terminationGracePeriodSeconds "
        "topologySpreadConstraints"
    ),
    "containers": [CONTAINER],
    "initContainers": [CONTAINER],
    "nodeSelector": MapOf(),
    "tolerations": [leaves("key operator value effect tolerationSeconds")],
    "volumes": [VOLUME],
}
OBJECT_META = {**leaves("name namespace generateName"), "labels": MapOf(), "annotations": MapOf()}
POD_TEMPLATE = {"metadata": OBJECT_META, "spec": POD_SPEC}

# KubeRay ray.io/v1 (ray-operator/apis/ray/v1: raycluster_types.go, rayjob_types.go).
RAY_START = _ray_start_options()
AUTOSCALER_OPTIONS = {
    **leaves(
        "image imagePullPolicy securityContext idleTimeoutSeconds upscalingMode version command "
        "args"
    ),
    "resources": RESOURCES,
    "env": [ENV_VAR],
    "envFrom": [ENV_FROM],
    "volumeMounts": [VOLUME_MOUNT],
}
GROUP = {
    "rayStartParams": RAY_START,
    "template": POD_TEMPLATE,
    "resources": MapOf(),
    "labels": MapOf(),
}
HEAD_GROUP = {**GROUP, **leaves("serviceType headService enableIngress ingressOptions")}
WORKER_GROUP = {
    **GROUP,
    **leaves(
        "groupName replicas minReplicas maxReplicas idleTimeoutSeconds priority numOfHosts suspend "
        "scaleStrategy"
    ),
}
RAY_CLUSTER_SPEC = {
    **leaves(
        "rayVersion enableInTreeAutoscaling suspend managedBy upgradeStrategy "
        "gcsFaultToleranceOptions headServiceAnnotations networkPolicy tlsOptions "
        "historyServerOptions"
    ),
    "authOptions": leaves("mode secretName enableK8sTokenAuth"),
    "autoscalerOptions": AUTOSCALER_OPTIONS,
    "headGroupSpec": HEAD_GROUP,
    "workerGroupSpecs": [WORKER_GROUP],
}
RAY_JOB_SPEC = {
    **leaves(
        "activeDeadlineSeconds backoffLimit metadata clusterSelector submitterConfig managedBy "
        "deletionStrategy entrypoint runtimeEnvYAML jobId submissionMode entrypointResources "
        "entrypointNumCpus entrypointNumGpus ttlSecondsAfterFinished shutdownAfterJobFinishes "
        "suspend"
    ),
    "rayClusterSpec": RAY_CLUSTER_SPEC,
    "submitterPodTemplate": POD_TEMPLATE,
}
MANIFESTS = {
    kind: {**leaves("apiVersion kind"), "metadata": OBJECT_META, "spec": spec}
    for kind, spec in {"RayCluster": RAY_CLUSTER_SPEC, "RayJob": RAY_JOB_SPEC}.items()
}


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def key_errors(value: Any, shape: Any, path: str) -> list[str]:
    """Every key in ``value`` that ``shape`` does not allow, as 'path: unknown key ...'."""
    if shape is ANY:
        return []
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        return [e for i, v in enumerate(value) for e in key_errors(v, shape[0], f"{path}[{i}]")]
    if not isinstance(value, dict):
        return [f"{path}: expected a mapping, got {type(value).__name__}"]
    if isinstance(shape, MapOf):
        return [e for k, v in value.items() for e in key_errors(v, shape.shape, _join(path, k))]
    errors = []
    for key, item in value.items():
        if key in shape:
            errors += key_errors(item, shape[key], _join(path, key))
        else:
            close = difflib.get_close_matches(str(key), list(shape), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{path or 'top level'}: unknown key {key!r}{hint}")
    return errors


# --- launcher YAMLs ------------------------------------------------------------------------


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


def ray_rejects(e: Exception) -> str:
    """Ray's message, first line only (a jsonschema error goes on to dump the whole schema)."""
    lines = str(e).splitlines() or [""]
    return f"Ray rejects it: {type(e).__name__}: {lines[0]}"


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


# --- KubeRay -------------------------------------------------------------------------------


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


# --- Dockerfile, README, secrets -----------------------------------------------------------


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


# --- one entry point per file --------------------------------------------------------------


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
    elif path.suffix in (".yaml", ".yml"):
        try:
            problems += yaml_problems(load_yaml(text))
        except ClusterFileError as e:
            problems.append(str(e))
    else:
        problems.append("no check for this kind of file: add one to tests/test_cluster.py")
    if problems:
        raise ClusterFileError(f"{path.name}:\n  " + "\n  ".join(problems))


# --- the tests -----------------------------------------------------------------------------


def load(name: str) -> dict:
    return load_yaml((CLUSTER / name).read_text())


def write_copy(tmp_path: Path, name: str, doc: Any) -> Path:
    """A copy of cluster/<name> (same file name) holding ``doc``."""
    path = tmp_path / Path(name).name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def rename_key(doc: dict, path: str, new: str) -> dict:
    """A copy of ``doc`` with the key at dotted ``path`` (list items by index) renamed."""
    doc = copy.deepcopy(doc)
    *parents, old = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[new] = node.pop(old)
    return doc


def set_value(doc: dict, path: str, value: Any) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return doc


def test_the_expected_files_are_there():
    names = {str(p.relative_to(CLUSTER)) for p in CLUSTER_FILES}
    expected = {"README.md", "Dockerfile", "aws.yaml", "gcp.yaml"}
    assert expected | {"kuberay/raycluster.yaml", "kuberay/rayjob.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: str(p.relative_to(CLUSTER)))
def test_every_cluster_file_validates(path):
    validate_file(path)


MISSPELT = [
    # (file, dotted path of a key, misspelling, who names it: Ray's schema, the key tables, both)
    ("aws.yaml", "idle_timeout_minutes", "idle_timeout_minute", "both"),
    ("aws.yaml", "available_node_types.gpu_spot.min_workers", "min_worker", "both"),
    ("aws.yaml", "docker.run_options", "run_option", "ray"),
    ("aws.yaml", "provider.availability_zone", "availabilty_zone", "table"),
    ("aws.yaml", "available_node_types.gpu_spot.node_config.InstanceType", "InstanceTyp", "table"),
    ("aws.yaml", "available_node_types.gpu_spot.node_config.InstanceMarketOptions.MarketType",
     "Markettype", "table"),
    ("gcp.yaml", "head_node_type", "head_node_typ", "both"),
    ("gcp.yaml", "available_node_types.gpu_spot.resources", "resource", "both"),
    ("gcp.yaml", "provider.project_id", "projectId", "table"),
    ("gcp.yaml", "available_node_types.gpu_spot.node_config.machineType", "machinetype", "table"),
    ("gcp.yaml", "available_node_types.gpu_spot.node_config.scheduling.provisioningModel",
     "provisioningMode", "table"),
    ("gcp.yaml",
     "available_node_types.gpu_ondemand.node_config.guestAccelerators.0.acceleratorCount",
     "acceleratorcount", "table"),
    ("kuberay/raycluster.yaml", "spec.enableInTreeAutoscaling", "enableInTreeAutoScaling", "table"),
    ("kuberay/raycluster.yaml", "spec.autoscalerOptions.idleTimeoutSeconds", "idleTimeout",
     "table"),
    ("kuberay/raycluster.yaml", "spec.workerGroupSpecs.0.minReplicas", "minReplica", "table"),
    ("kuberay/raycluster.yaml", "spec.headGroupSpec.rayStartParams.num-cpus", "num-cpu", "table"),
    ("kuberay/raycluster.yaml", "spec.workerGroupSpecs.1.template.spec.containers.0.resources",
     "resource", "table"),
    ("kuberay/raycluster.yaml", "spec.headGroupSpec.template.spec.volumes", "volume", "table"),
    ("kuberay/rayjob.yaml", "spec.shutdownAfterJobFinishes", "shutdownAfterJobFinish", "table"),
    ("kuberay/rayjob.yaml", "spec.rayClusterSpec.workerGroupSpecs.0.maxReplicas", "maxReplica",
     "table"),
    ("kuberay/rayjob.yaml", "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.envFrom",
     "envfrom", "table"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "key", "typo", "who"), MISSPELT, ids=lambda v: str(v))
def test_a_copy_with_a_misspelt_key_fails_naming_it(tmp_path, name, key, typo, who):
    """The message names the misspelt key, wherever it is; Ray's schema covers only some places."""
    broken = write_copy(tmp_path, name, rename_key(load(name), key, typo))
    with pytest.raises(ClusterFileError, match=re.escape(repr(typo))) as failure:
        validate_file(broken)
    message = str(failure.value)
    assert ("Ray rejects it" in message) == (who in ("ray", "both"))
    assert (f"unknown key {typo!r}" in message) == (who in ("table", "both"))


RAY_CATCHES = [
    # (file, dotted path, bad value, what Ray says): the values only Ray's own checks judge.
    ("aws.yaml", "head_node_type", "nohead", "must be one of `available_node_types`"),
    ("aws.yaml", "max_workers", 0, "smaller than the sum of `min_workers`"),
    ("gcp.yaml", "available_node_types.gpu_spot.resources.GPU", 0.5, "is not of type 'integer'"),
    ("gcp.yaml", "available_node_types.gpu_spot.max_workers", "8", "is not of type 'integer'"),
    (
        "kuberay/raycluster.yaml",
        "spec.workerGroupSpecs.0.maxReplicas",
        2.5,
        "not of type 'integer'",
    ),
    ("kuberay/raycluster.yaml", "spec.autoscalerOptions.idleTimeoutSeconds", -60, "minimum of 0"),
    ("kuberay/rayjob.yaml", "spec.rayClusterSpec.headGroupSpec.rayStartParams", {}, "detect `CPU`"),
]


@pytest.mark.parametrize(("name", "key", "value", "message"), RAY_CATCHES, ids=lambda v: str(v))
def test_ray_own_validation_rejects_a_broken_copy(tmp_path, name, key, value, message):
    doc = load(name)
    if key == "max_workers":  # global max below the sum of the types' min_workers
        doc = set_value(doc, "available_node_types.gpu_spot.min_workers", 1)
    if key.endswith("rayStartParams"):  # and no CPU limit to fall back on: Ray cannot size it
        head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        head["resources"] = {}
    broken = write_copy(tmp_path, name, set_value(doc, key, value))
    with pytest.raises(ClusterFileError, match="Ray rejects it") as failure:
        validate_file(broken)
    assert message in str(failure.value)


BROKEN_PROMISES = [
    # (file, dotted path, value, the problem a user would hit)
    ("aws.yaml", "available_node_types.head.resources.CPU", 2, "no tasks on the head"),
    ("aws.yaml", "available_node_types.gpu_ondemand.min_workers", 1, "min_workers must be 0"),
    ("aws.yaml", "available_node_types.gpu_spot.node_config.InstanceMarketOptions.MarketType",
     "capacity-block", "need a spot and an on-demand"),
    ("aws.yaml", "available_node_types.gpu_spot.priority", 0, "higher priority"),
    ("aws.yaml", "available_node_types.gpu_spot.resources", {"CPU": 8}, "name its GPUs"),
    ("aws.yaml", "docker.run_options", ["--ulimit nofile=65536:65536"], "RAY_AUTH_MODE=token"),
    ("aws.yaml", "file_mounts", {}, "RAY_AUTH_TOKEN_PATH"),
    ("aws.yaml", "head_start_ray_commands", ["ray start --head --dashboard-host=0.0.0.0"],
     "--dashboard-host=0.0.0.0"),
    ("gcp.yaml", "available_node_types.gpu_spot.node_config.scheduling",
     [{"preemptible": True}, {"onHostMaintenance": "TERMINATE"}], "expected a mapping"),
    ("gcp.yaml", "available_node_types.gpu_spot.node_config.scheduling.automaticRestart", True,
     "automaticRestart false"),
    ("gcp.yaml", "available_node_types.gpu_ondemand.node_config.scheduling.onHostMaintenance",
     "MIGRATE", "onHostMaintenance TERMINATE"),
    ("gcp.yaml", "idle_timeout_minutes", 0, "idle_timeout_minutes must be set"),
    ("gcp.yaml", "provider.availability_zone", "us-central1-b", "diskType in zone us-central1-a"),
    ("kuberay/raycluster.yaml", "spec.headGroupSpec.rayStartParams.num-cpus", "2", 'num-cpus: "0"'),
    ("kuberay/raycluster.yaml", "spec.headGroupSpec.serviceType", "LoadBalancer", "ClusterIP"),
    ("kuberay/raycluster.yaml", "spec.workerGroupSpecs.0.minReplicas", 1, "minReplicas must be 0"),
    ("kuberay/raycluster.yaml", "spec.authOptions.mode", "disabled", "authOptions.mode"),
    ("kuberay/raycluster.yaml", "spec.rayVersion", "2.9.0", "rayVersion must be"),
    ("kuberay/raycluster.yaml", "spec.workerGroupSpecs.1.template.spec.containers.0.env",
     [{"name": "HF_TOKEN", "value": "see-the-secret"}], "must come from a Secret"),
    ("kuberay/rayjob.yaml", "spec.entrypoint", "raytuner run jobs/sdxl2.toml", "no such job TOML"),
    ("kuberay/rayjob.yaml", "spec.entrypoint", "raytuner run /home/ray/raytuner/jobs/sdxl.toml",
     "--set data.images to a bucket URI"),
    ("kuberay/rayjob.yaml", "spec.shutdownAfterJobFinishes", False, "shutdownAfterJobFinishes"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "key", "value", "problem"), BROKEN_PROMISES, ids=lambda v: str(v))
def test_a_copy_that_breaks_a_promise_fails(tmp_path, name, key, value, problem):
    broken = write_copy(tmp_path, name, set_value(load(name), key, value))
    with pytest.raises(ClusterFileError, match=re.escape(problem)):
        validate_file(broken)


SECRETS = [
    "AKIAIOSFODNN7EXAMPLE",
    "-----BEGIN OPENSSH PRIVATE KEY-----",
    "aws_secret_access_key = wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY",
    "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
    "RAY_AUTH_TOKEN=3f2a9c0d4b6e8f1a2c3d4e5f6a7b8c9d",
    "password: Zm9vYmFyYmF6cXV4cXV1eGNvcmdl",
]


@pytest.mark.parametrize("secret", SECRETS)
@pytest.mark.parametrize("name", ["aws.yaml", "kuberay/rayjob.yaml", "Dockerfile", "README.md"])
def test_a_copy_with_a_secret_in_it_fails(tmp_path, name, secret):
    text = (CLUSTER / name).read_text() + f"\n# {secret}\n"
    with pytest.raises(ClusterFileError, match="looks like"):
        validate_file(write_copy(tmp_path, name, text))


DOCKERFILE_BREAKS = [
    # (text in cluster/Dockerfile, replacement, the problem it causes)
    ("rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:latest-gpu", "FROM must be"),
    ("rayproject/ray:2.60.0-py311-gpu", "rayproject/ray:2.60.0-py310-gpu", "FROM must be"),
    ("pip install --no-cache-dir . &&", "pip install --no-cache-dir raytuner &&", "pip install ."),
    ("COPY --chown=ray:users jobs ./jobs", "COPY --chown=ray:users job ./jobs", "COPY job: not in"),
    ("ENV RAY_AUTH_MODE=token", "ENV RAY_AUTH_MODE=disabled", "ENV RAY_AUTH_MODE=token"),
    ("WORKDIR /home/ray/raytuner", "WORKDIRS /home/ray/raytuner", "instruction 'WORKDIRS'"),
    ("COPY --chown=ray:users jobs", "COPY --chwon=ray:users jobs", "flag '--chwon'"),
]


@pytest.mark.parametrize(("old", "new", "problem"), DOCKERFILE_BREAKS, ids=lambda v: str(v))
def test_a_broken_dockerfile_fails(tmp_path, old, new, problem):
    text = (CLUSTER / "Dockerfile").read_text()
    assert old in text
    with pytest.raises(ClusterFileError, match=re.escape(problem)):
        validate_file(write_copy(tmp_path, "Dockerfile", text.replace(old, new)))


def test_a_yaml_copy_with_a_key_given_twice_fails(tmp_path):
    """The second `max_workers` would silently win; the file must say it once."""
    text = (
        (CLUSTER / "aws.yaml")
        .read_text()
        .replace("max_workers: 8\n", "max_workers: 8\nmax_workers: 80\n", 1)
    )
    with pytest.raises(ClusterFileError, match="duplicate key 'max_workers'"):
        validate_file(write_copy(tmp_path, "aws.yaml", text))


def test_a_readme_that_forgets_a_file_fails(tmp_path):
    text = (CLUSTER / "README.md").read_text().replace("cluster/gcp.yaml", "the GCP file")
    with pytest.raises(ClusterFileError, match="does not mention cluster/gcp.yaml"):
        validate_file(write_copy(tmp_path, "README.md", text))


def test_a_file_with_no_check_fails(tmp_path):
    with pytest.raises(ClusterFileError, match="no check"):
        validate_file(write_copy(tmp_path, "notes.txt", "a new file in cluster/\n"))


def test_the_rayjob_runs_the_same_cluster_as_the_raycluster():
    """Edit one manifest, edit the other: the RayJob's cluster is the RayCluster's spec."""
    job = load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]
    assert job == load("kuberay/raycluster.yaml")["spec"]


def test_every_file_runs_the_image_of_this_release():
    """One image everywhere, tagged with the project's version."""
    images = {load(n)["docker"]["image"] for n in ("aws.yaml", "gcp.yaml")}
    for name in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        doc = load(name)
        spec = as_ray_cluster(doc)["spec"]
        images |= {c["image"] for _, g in groups(spec) for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1, images
    assert images.pop().endswith(f":{PROJECT_VERSION}")


def test_the_derived_kuberay_config_matches_the_manifest():
    """What the autoscaler will do: head without CPUs, GPU groups from 0 up to maxReplicas."""
    derived = ray_derived(load("kuberay/raycluster.yaml"))
    types = derived["available_node_types"]
    assert types["headgroup"]["resources"]["CPU"] == 0
    assert {k: (v["min_workers"], v["max_workers"]) for k, v in types.items()} == {
        "headgroup": (0, 0),
        "gpu": (0, 4),
        "gpu-spot": (0, 8),
    }
    assert types["gpu-spot"]["priority"] > types["gpu"].get("priority", 0)
    assert derived["idle_timeout_minutes"] == 10
