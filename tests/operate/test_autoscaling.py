"""Autoscaling for real: a raytuner job makes Ray's autoscaler start nodes, and they go after it.

The test starts its own head with `ray start --head --block --num-cpus=0` on free ports and a
private temp dir, with an autoscaling config for Ray's fake multi-node provider (the mechanism
behind `ray.cluster_utils.AutoscalingCluster`, which cannot be used as shipped: Ray 2.60's wheel
lacks its `example.yaml`, and its start and shutdown run `ray stop --force`). The head offers no
CPU; every worker node (1 CPU, at most 3) is a raylet that the autoscaler starts on this machine
when there is demand, and removes once it has been idle for `idle_timeout_minutes`.

`raytuner run` (preprocess, then train) is a driver process joined to that cluster, with an
encoder pool of 2 actors (1 CPU each) and `scaling.workers = [1, 3]` (1 CPU each). While the job
runs the test polls the dashboard's state API and `ray status`, and checks what a user would
see: the autoscaler started worker nodes for the job, the two encoder actors ran on two of them,
the training group grew to 3 workers (the run's attempts on the Train page, and a step trained
by a world of 3 in the run's sample log), and once the driver is interrupted (SIGINT: Ray Train
aborts the run and withdraws its request to the autoscaler) every worker node is removed. It
prints the time from the job's start, and from Ray Train's request for 3 workers, to the first
step of the 3-worker group, and the time the idle nodes took to go. Teardown stops only this
cluster's processes (the fake nodes are in the head's session and name its temp dir): other Ray
clusters on the machine are left alone, so no `ray stop` here.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ray_head import (
    free_ports,
    private_env,
    private_temp_dir,
    start_head,
    stop_and_keep_logs,
    wait_until_ready,
)

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, whatever is on PATH

START_TIMEOUT_S = 120
MAX_NODES = 3
IDLE_TIMEOUT_MIN = 0.3  # an idle worker node is removed after 18 s: the encoder nodes outlive
# the gap between the preprocess and the training request (11-16 s), so training starts on them
GROW_TIMEOUT_S = 300  # job start -> a step of the 3-worker group (measured: 105-182 s)
REMOVE_TIMEOUT_S = 90  # driver interrupted -> no worker node left

# Ray's fake multi-node provider (ray/autoscaler/_private/fake_multi_node/node_provider.py):
# each worker node is a `ray._private.node.Node` that the autoscaler process (on the head)
# starts on this machine, joined to `provider.gcs_address` (without it: <node IP>:6379). The
# keys are those of the provider's example.yaml in Ray's repository (the file the wheel lacks)
# less its GPU node type, with a head of 0 CPUs; the autoscaler (v1, Ray's default) validates
# them against ray/autoscaler/ray-schema.json and reads file_mounts, cluster_synced_files and
# worker_*_commands unconditionally.
WORKER_TYPE = "ray.worker.cpu"


def autoscaling_config(gcs_address: str) -> dict:
    return {
        "cluster_name": "raytuner-autoscaling-test",
        "max_workers": MAX_NODES,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,  # the autoscaler keys nodes by id, not by IP
            "disable_node_updaters": True,  # no SSH or setup commands: Ray is already there
            "disable_launch_config_check": True,
            # a launch of n nodes starts n (without it: one, and the autoscaler, which counted
            # n, asks again only after it has seen fewer nodes come up)
            "launch_multiple": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {"CPU": 1, "object_store_memory": 200 * 1024**2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": MAX_NODES,
            },
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
        "auth": {},
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


@dataclass
class Cluster:
    address: str  # the GCS: what a driver joins (RAY_ADDRESS)
    url: str  # the dashboard: the state API
    token: str
    env: dict[str, str]  # environment of the cluster's processes and of its clients
    temp_dir: str
    log: Path  # output of `ray start`

    def get(self, path: str, **params: str) -> dict:
        """GET a dashboard REST endpoint, authenticated with the cluster's token."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        req = urllib.request.Request(
            self.url + path + query, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=20) as resp:
            return json.loads(resp.read())

    def state(self, resource: str, **params: str) -> list[dict]:
        """Rows of the state API (what `ray list <resource> --format json` shows)."""
        reply = self.get(f"/api/v0/{resource}", limit="1000", timeout="15", **params)
        if not reply.get("result"):
            raise OSError(f"state API {resource}: {reply.get('msg')}")
        return reply["data"]["result"]["result"]

    def worker_nodes(self) -> list[str]:
        """Ids of the alive nodes that are not the head."""
        return [
            n["node_id"]
            for n in self.state("nodes")
            if n["state"] == "ALIVE" and not n.get("is_head_node")
        ]

    def autoscaler_log(self) -> str:
        path = Path(self.temp_dir, "session_latest", "logs", "monitor.log")
        return path.read_text(errors="replace") if path.is_file() else ""


@pytest.fixture
def autoscaling_cluster(tmp_path: Path) -> Iterator[Cluster]:
    temp_dir = private_temp_dir()
    # Token auth as in test_job_submit.py: a fresh token in RAY_AUTH_TOKEN, read by the head,
    # by the nodes the autoscaler starts (they inherit its environment) and by the driver.
    token = secrets.token_hex(32)
    ports = free_ports(5)
    gcs, dashboard = ports[:2]
    env = private_env(
        token,
        # the fake provider refuses to start without it
        RAY_FAKE_CLUSTER="1",
        # the autoscaler's loop every second (default 5 s)
        AUTOSCALER_UPDATE_INTERVAL_S="1",
        # Ray Train waits this long for a worker group it decided to start (default 60 s)
        RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="30",
        # The state API's clients inside the cluster (Ray Train's controller helpers) find the
        # dashboard here, not by looking for Ray processes on the machine (other clusters
        # there would make that ambiguous).
        RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{dashboard}",
    )
    # The nodes join the GCS at the address the head announces (the machine's IP, never
    # 127.0.0.1), so that every process of the cluster names the same GCS.
    import ray.util

    gcs_address = f"{ray.util.get_node_ip_address()}:{gcs}"
    config = tmp_path / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(gcs_address), indent=2))
    log = tmp_path / "ray_start.log"
    # the fake nodes take ports the OS picks
    extra = ("--num-cpus=0", f"--autoscaling-config={config}")
    head = start_head(RAY, temp_dir, ports, env, log, *extra)
    cluster = Cluster(gcs_address, f"http://127.0.0.1:{dashboard}", token, env, temp_dir, log)
    try:
        # the dashboard's state API lists the head node
        ready = lambda: any(n.get("is_head_node") for n in cluster.state("nodes"))  # noqa: E731
        wait_until_ready(head, ready, log, START_TIMEOUT_S)
        yield cluster
    finally:
        left = stop_and_keep_logs(head, temp_dir, tmp_path)
        assert not left, "processes of the test's Ray cluster survived:\n" + "\n".join(left)


# 12 images in batches of 8: 2 stream blocks, so 2 encoder tasks and 2 write tasks (each write
# task starts a worker process, several seconds on this machine). min_actors = 2: the pool asks
# for both actors at once, and the autoscaler starts a node for each. With min_actors = 1 (tried
# with 24 images) the pool stayed at one actor: Ray Data adds an actor only within its resource
# budget, the CPUs the cluster has now, and its own request to the autoscaler (every 10 s, once
# it has measured throughput) had not asked for a second actor's CPU when the encoding ended.
JOB = """
[model]
family = "sdxl"
pretrained = "tiny"

[data]
images = "{root}/images"
cache = "{root}/cache"

[preprocess]
resolution = 64
bucket_step = 16
batch_size = 8
min_actors = 2
max_actors = 2
cpus_per_actor = 1

[train]
name = "autoscale"
output = "{root}/runs"
max_steps = 100000
global_batch_size = 4
learning_rate = 1e-3
log_every = 1
sample_log = true

[scaling]
workers = [1, 3]
cpus_per_worker = 1
elastic_resize_interval_s = 2
resource_wait_s = 120

[checkpoint]
every_steps = 10
keep = 2
"""


@dataclass
class Watch:
    """What a poll of the state API (and of `ray status`) every second saw while the job ran."""

    most_nodes: int = 0
    nodes: set[str] = field(default_factory=set)  # every worker node seen alive
    encoders: dict[str, str] = field(default_factory=dict)  # encoder actor id -> node id
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, alive workers)
    requested: float = 0.0  # when `ray status` first showed Ray Train's request for 3 workers
    errors: list[str] = field(default_factory=list)


# how `ray status` shows Ray Train's request for its largest group: 3 bundles of 1 CPU
TRAIN_REQUEST = re.compile(r"\{'CPU': 1\.0\}: 3 from request_resources\(\)")


def _watch(cluster: Cluster, watch: Watch, stop: threading.Event, preprocessed) -> None:
    while not stop.wait(1.0):
        try:
            alive = cluster.worker_nodes()
            watch.most_nodes = max(watch.most_nodes, len(alive))
            watch.nodes |= set(alive)
            if not watch.timeline or watch.timeline[-1][1] != len(alive):
                watch.timeline.append((time.time(), len(alive)))
            for actor in cluster.state("actors", detail="true"):
                name = f"{actor.get('repr_name')} {actor.get('class_name')}"  # MapWorker(…Encoder))
                if "Encoder" in name and actor.get("node_id"):
                    watch.encoders[actor["actor_id"]] = actor["node_id"]
            # Ray Data asks for bundles of its own while it preprocesses: look after it
            if not watch.requested and preprocessed():
                status = cluster.get("/api/cluster_status", format="1")["data"]["clusterStatus"]
                if TRAIN_REQUEST.search(status):
                    watch.requested = time.time()
        except (OSError, ValueError, KeyError, TypeError) as e:  # a busy dashboard: ask again
            watch.errors.append(repr(e))


def worlds(run_dir: Path) -> list[tuple[int, float]]:
    """(world size, time of its first logged step) of every attempt that logged a step, oldest
    first, from the run's sample log (`<run>/samples/<attempt>/rank*.jsonl`: one file per rank
    and log window, written at the end of the window)."""
    out = []
    for attempt in sorted((run_dir / "samples").glob("*")):
        files = sorted(attempt.glob("rank*.jsonl"), key=lambda p: p.stat().st_mtime)
        if files:
            first = json.loads(files[0].read_text().splitlines()[0])
            out.append((first["world"], files[0].stat().st_mtime))
    return out


def group_sizes(cluster: Cluster, name: str) -> list[int]:
    """Workers of each attempt of the Ray Train run ``name``, oldest first (the dashboard's Train
    page, from Ray Train's state tracking)."""
    runs = cluster.get("/api/train/v2/runs/v1")["train_runs"]
    attempts = [a for run in runs if run["name"] == name for a in run["attempts"]]
    return [len(a["workers"]) for a in sorted(attempts, key=lambda a: a["start_time_ns"])]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_autoscaler_adds_nodes_for_the_job_and_removes_them(
    autoscaling_cluster: Cluster, tmp_path: Path
) -> None:
    from raytuner.tools.demo_images import make_demo_images

    cluster = autoscaling_cluster
    assert cluster.worker_nodes() == [], "the cluster starts with its head alone"
    make_demo_images(tmp_path / "images", per_aspect=4)  # 12 images, 3 buckets
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(root=tmp_path))
    run_dir = tmp_path / "runs" / "autoscale"

    out = tmp_path / "driver.log"
    output = lambda: out.read_text(errors="replace")  # noqa: E731
    preprocessed = lambda: "preprocess: images encoded 12/12 in" in output()  # noqa: E731
    watch, stop = Watch(), threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(cluster, watch, stop, preprocessed), daemon=True
    )
    watcher.start()
    started = time.time()
    with open(out, "w") as log:
        driver = subprocess.Popen(
            [sys.executable, "-m", "raytuner", "run", str(job)],
            cwd=REPO,
            env=cluster.env | {"RAY_ADDRESS": cluster.address},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + GROW_TIMEOUT_S
        while not any(w == MAX_NODES for w, _ in worlds(run_dir)):
            if driver.poll() is not None:
                pytest.fail(
                    f"driver exited ({driver.returncode}) before a step on {MAX_NODES} workers:"
                    f"\n{output()[-6000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(
                    f"no step on {MAX_NODES} workers after {GROW_TIMEOUT_S} s (attempts: "
                    f"{worlds(run_dir)}, {watch}):\n{output()[-6000:]}\n"
                    f"autoscaler:\n{cluster.autoscaler_log()[-3000:]}"
                )
            time.sleep(0.5)
        history = worlds(run_dir)
        # The Train page shows every start of the group. A group is resized as soon as it has
        # started when more nodes have come up meanwhile (its start takes longer than
        # elastic_resize_interval_s), before it trains a step, so the sample log shows only the
        # last one: 1 -> 3, 2 -> 3 or 1 -> 2 -> 3 workers, or 3 at once when the autoscaler had
        # started all 3 nodes by the time Ray Train first looked.
        sizes = group_sizes(cluster, "autoscale")
        # Ctrl-C: Ray Train aborts the run and withdraws its request to the autoscaler (a
        # SIGKILLed driver cannot: its request would hold the nodes for 180 s)
        interrupted = time.time()
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=30)
        stop.set()
        watcher.join(timeout=30)

    # the autoscaler removes every worker node once it has been idle idle_timeout_minutes
    while (left := cluster.worker_nodes()) and time.time() < interrupted + REMOVE_TIMEOUT_S:
        time.sleep(1)
    removed_s = time.time() - interrupted
    grown = next(t for w, t in history if w == MAX_NODES)
    asked = grown - watch.requested if watch.requested else float("nan")
    timeline = ", ".join(f"{t - started:.0f} s: {n}" for t, n in watch.timeline)
    print(
        f"\njob start -> first step of the {MAX_NODES}-worker group: {grown - started:.1f} s; "
        f"Ray Train's request for {MAX_NODES} workers (in `ray status`) -> that step: "
        f"{asked:.1f} s; group sizes on the Train page: {sizes}; "
        f"driver interrupted -> worker nodes removed: {removed_s:.1f} s (driver exit code "
        f"{driver.returncode}); worker nodes started: "
        f"{len(watch.nodes)}; alive worker nodes over time (since job start): {timeline}"
    )
    assert not left, f"worker nodes still alive {REMOVE_TIMEOUT_S} s after the job: {left}"
    # 3 alive at once (the fake provider may briefly start one more: it starts a node while the
    # autoscaler, which sees a node only once it is up, asks again; the extra one is removed at
    # once, "max_workers_per_type")
    assert watch.most_nodes >= MAX_NODES, watch
    # the encoder pool ran on nodes the autoscaler started for it, one actor per node
    encoder_nodes = set(watch.encoders.values())
    assert len(encoder_nodes) == 2 and encoder_nodes <= watch.nodes, watch
    assert watch.requested, f"`ray status` never showed Ray Train's request: {watch}"
    # the group only grew, up to 3 workers, and the 3 trained (the sample log)
    assert sizes == sorted(sizes) and sizes[-1] == MAX_NODES, sizes
    assert [w for w, _ in history][-1] == MAX_NODES, history
