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

The checks live beside this file: cluster_keys.py (the allowed-key tables), cluster_launcher.py
(launcher YAMLs), cluster_kuberay.py (KubeRay manifests), cluster_files.py (Dockerfile, README,
secrets, strict YAML, copy helpers) and cluster_validate.py (`validate_file`, one entry point per
file). Here are the tests: every file validates, and each kind of broken copy fails as it should.
"""

from __future__ import annotations

import re

import pytest
from cluster_files import (
    CLUSTER,
    CLUSTER_FILES,
    PROJECT_VERSION,
    ClusterFileError,
    load,
    rename_key,
    set_value,
    write_copy,
)
from cluster_kuberay import as_ray_cluster, groups, ray_derived
from cluster_validate import validate_file


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
