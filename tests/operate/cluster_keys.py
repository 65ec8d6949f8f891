"""The allowed-key tables and `key_errors`: every key in a cluster file is looked up here.

Ray checks neither the `provider` section nor `node_config` of a launcher YAML (any key passes),
and the KubeRay derivation reads the fields it needs and ignores the rest (as the API server
prunes unknown fields without a word), so a misspelt key would be dropped and the cluster would
quietly run without it. These tables are ours, not Ray's: EC2 RunInstances and Compute Engine
instances.insert fields (plus Ray's additions), the RayCluster / RayJob CRD fields, the Pod and
Container fields, and `ray start`'s options for rayStartParams (Ray's own schema for the
launcher's top level and node types is added in cluster_launcher.py). `key_errors` names every
unknown key with its path and the closest allowed spelling.
"""

from __future__ import annotations

import difflib
from typing import Any

from ray.scripts.scripts import start as ray_start_command

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
