"""What a job asks of the cluster: what it can never hold (more than its nodes have, and than an
autoscaler may add) fails within seconds naming the resource, what was asked and what the cluster
has; what it may still hold (busy now, or nodes an autoscaler may start) is waited for at most
`scaling.resource_wait_s` (training) or `preprocess.resource_wait_s` (the encoder actors), then
fails saying what it asked for and what exists, instead of Ray retrying without end."""

from __future__ import annotations

import dataclasses
import time

import pytest

from raytuner import runtime
from raytuner.api import preprocess, train
from raytuner.config import load_job
from raytuner.data import cache
from raytuner.runtime import Cluster, NodeType
from raytuner.tools import synthetic

JOB = """
[model]
family = "sdxl"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
global_batch_size = 8
[scaling]
workers = [3, 4]
cpus_per_worker = 1.0
resource_wait_s = 2
"""

FAILS_WITHIN_S = 60  # a request the cluster can never hold: no wait, seconds of Ray calls


def job_with_cache(tmp_path, overrides=()):
    """JOB (with ``overrides``) and a committed synthetic cache for it: train() starts at once."""
    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path))
    job = load_job(tmp_path / "job.toml", list(overrides))
    version = cache.Version(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    shapes = lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)}  # noqa: E731
    synthetic.write_cache(
        version,
        buckets=[(64, 64)] * 8,
        captions=[0] * 8,
        repeats=[1] * 8,
        shapes=shapes,
        family="sdxl",
        sources=job.data.all_sources(),  # the job's own dataset: train() trains it
    )
    return job


def test_a_group_the_cluster_cannot_hold_fails_in_the_stated_time(ray_local, tmp_path):
    job = job_with_cache(tmp_path)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        train(job)
    assert time.monotonic() - started < 30
    message = str(caught.value)
    assert "3 training workers need 3 CPU" in message and "2 CPU in all" in message
    assert "scaling.resource_wait_s" in message
    # a local Ray has no autoscaler: 3 CPUs can never come, so there is no wait at all
    assert "no autoscaler" in message and "can never hold them" in message


def test_a_gpu_for_training_on_a_cpu_only_ray_fails_at_once_naming_gpu(ray_local, tmp_path):
    """scaling.strategy = "auto" probes the GPU a worker gets before any worker starts; a
    strategy the job names asks for the workers' GPUs: either fails at once, naming GPU."""
    job = job_with_cache(tmp_path, ["scaling.use_gpu=true", "scaling.workers=1"])
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        train(job)
    assert time.monotonic() - started < FAILS_WITHIN_S
    message = str(caught.value)
    assert 'scaling.strategy = "auto" and its probe need 1 GPU at once' in message
    assert "0 GPU in all (1 node)" in message and "scaling.worker_memory" in message
    pinned = dataclasses.replace(job, scaling=dataclasses.replace(job.scaling, strategy="ddp"))
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        train(pinned)
    assert time.monotonic() - started < FAILS_WITHIN_S
    message = str(caught.value)
    assert "1 training workers need 1 CPU, 1 GPU at once" in message
    assert "GPU: one needs 1, the largest node has 0" in message
    assert "0 GPU in all (1 node) and no autoscaler" in message


def test_a_gpu_for_the_encoders_on_a_cpu_only_ray_fails_at_once_naming_gpu(
    ray_local, tmp_path, demo_images
):
    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path))
    job = load_job(tmp_path / "job.toml", ["preprocess.gpus_per_actor=1"])
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        preprocess(job)
    assert time.monotonic() - started < FAILS_WITHIN_S
    message = str(caught.value)
    assert "the encoder actors (preprocess.min_actors = 1) need 0.5 CPU, 1 GPU" in message
    assert "GPU: one needs 1, the largest node has 0" in message
    assert "preprocess.min_actors / cpus_per_actor / gpus_per_actor" in message


def test_a_group_that_fits_but_is_busy_waits_the_stated_time(ray_local, tmp_path):
    """Two CPUs held by another group: one worker of 1 CPU fits the cluster, so training waits
    for it, `scaling.resource_wait_s` and no longer, then says what is free."""
    job = job_with_cache(tmp_path, ["scaling.workers=1", "scaling.resource_wait_s=4"])
    holder = ray_local.util.placement_group([{"CPU": 2}])
    assert holder.wait(timeout_seconds=60)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError) as caught:
            train(job)
        waited = time.monotonic() - started
    finally:
        ray_local.util.remove_placement_group(holder)
    assert 4 <= waited < 4 + 30, waited
    message = str(caught.value)
    assert "1 training workers need 1 CPU at once" in message
    assert "2 CPU in all and 0 CPU free after waiting 4 s (scaling.resource_wait_s)" in message


def test_a_local_ray_has_no_autoscaler(ray_local):
    """The session's Ray, started by this process: nothing to wait for beyond its nodes. The
    same Ray seen as a cluster joined from elsewhere: its monitor runs without an autoscaling
    config (Ray's read-only provider), which `_autoscaler` tells from its published status."""
    found = runtime.cluster()
    assert found.autoscaler == "none" and found.most()["CPU"] == 2
    deadline = time.monotonic() + 30  # the monitor publishes its status every few seconds
    while (kind := runtime._autoscaler()) != ("none", ()) and time.monotonic() < deadline:
        time.sleep(1)
    assert kind == ("none", ())


GPU_BUNDLE = {"CPU": 1.0, "GPU": 1.0}
HEAD = {"CPU": 2.0}


def test_node_types_an_autoscaler_may_add_count_and_only_those():
    gpu_nodes = (NodeType("gpu", {"CPU": 8.0, "GPU": 1.0}, 2),)
    # a GPU node type: the request can be met (an autoscaler starts the nodes), so it waits
    assert Cluster((HEAD,), "types", gpu_nodes).never([GPU_BUNDLE] * 2) == []
    unlimited = (NodeType("gpu", {"CPU": 4.0, "GPU": 1.0}, -1),)
    assert Cluster((HEAD,), "types", unlimited).never([GPU_BUNDLE] * 50) == []
    # more GPUs than the node type's max count gives
    assert Cluster((HEAD,), "types", gpu_nodes).never([GPU_BUNDLE] * 3) == [
        "GPU: 3 in all, the cluster can grow to 2"
    ]
    # only CPU node types: never, and it names GPU
    cpu_nodes = (NodeType("cpu", {"CPU": 16.0}, 10),)
    assert Cluster((HEAD,), "types", cpu_nodes).never([GPU_BUNDLE]) == [
        "GPU: one needs 1, the largest node or type has 0"
    ]
    # a node type with max count 0 adds nothing
    off = (NodeType("gpu", {"CPU": 8.0, "GPU": 1.0}, 0),)
    assert Cluster((HEAD,), "types", off).never([GPU_BUNDLE]) != []
    # no single node holds the bundle, though each resource exists somewhere
    split = Cluster(({"CPU": 4.0}, {"GPU": 1.0}), "none")
    assert split.never([GPU_BUNDLE]) == ["no node holds 1 CPU, 1 GPU at once"]
    # an autoscaler whose node types are not published: nothing is certain, it waits
    for kind in ("v2", "unknown"):
        assert Cluster((HEAD,), kind).never([GPU_BUNDLE] * 8) == []


def test_the_message_names_the_nodes_and_what_an_autoscaler_may_add():
    found = Cluster((HEAD,), "types", (NodeType("cpu", {"CPU": 16.0}, 10),))
    assert found.describe(["CPU", "GPU"]) == (
        "the cluster has 2 CPU, 0 GPU in all (1 node); its autoscaler may add up to 10 x cpu "
        "(16 CPU, 0 GPU)"
    )


def test_autoscaler_v2_verdict_on_a_placement_group():
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    reply = GetClusterStatusReply()
    gang = reply.autoscaling_state.infeasible_gang_resource_requests.add()
    gang.details = "9e07e09ead86f677db61c1042c9701000000:PACK|PENDING"
    gang.requests.add().resources_bundle.update({"GPU": 1.0})
    data = reply.SerializeToString()
    assert runtime.refused(data, "9e07e09ead86f677db61c1042c9701000000")
    assert not runtime.refused(data, "55bf48fd6eb9954c0069e38465f701000000")
    assert not runtime.refused(GetClusterStatusReply().SerializeToString(), "9e07e09e")


def test_every_ray_train_retry_is_bounded_and_a_job_sets_the_bounds(tmp_path):
    from raytuner.train.trainer import failure_config

    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path))
    bounded = failure_config(load_job(tmp_path / "job.toml").checkpoint)
    limits = (bounded.max_failures, bounded.max_preemption_failures)
    assert all(0 <= n < 1000 for n in (*limits, bounded.controller_failure_limit))
    overrides = ["checkpoint.max_preemption_failures=5", "checkpoint.controller_failure_limit=0"]
    chosen = failure_config(load_job(tmp_path / "job.toml", overrides).checkpoint)
    assert (chosen.max_preemption_failures, chosen.controller_failure_limit) == (5, 0)
