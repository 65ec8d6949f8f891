"""Elastic training on a multi-node local cluster (`ray.cluster_utils.Cluster`), driven the way
a user drives it: `raytuner train` is a separate driver process joined to the cluster.

One run lives through every interruption in turn:
1. it starts with `scaling.workers = [1, 2]` on two nodes with room for one worker each, as a
   group of 2 (growth onto nodes as they come: `tests/operate/test_autoscaling.py`, where an
   autoscaler starts them);
2. the second node is drained with the preemption reason (`ray drain-node`, what a cloud autoscaler
   does on a spot reclaim) -> every rank takes a checkpoint at the current step; the node is
   then removed -> the group shrinks to 1 worker and continues from that checkpoint;
3. the driver is SIGKILLed and the newest checkpoint damaged -> the same job submitted again
   skips the damaged checkpoint and resumes from the one before;
and it ends at exactly `train.max_steps`, having trained every scheduled global batch, with a
LoRA that the diffusers pipeline loads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster
from run_checks import committed, lora_changes_the_pipeline

from raytuner.config import load_job
from raytuner.data.cache import fingerprint
from raytuner.data.reader import open_dataset
from raytuner.train import sample_log
from raytuner.train.schedule import epoch_batches

RAY = str(Path(sys.executable).parent / "ray")
NODE = {"num_cpus": 1, "object_store_memory": 200 * 1024**2}
EVERY = 10  # checkpoint.every_steps
SETTINGS = [
    'train.name="elastic"',
    "train.log_every=2",
    "scaling.workers=[1, 2]",
    "scaling.cpus_per_worker=1",
    "scaling.elastic_resize_interval_s=2",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=3",
    "checkpoint.preemption_check_every=1",
]


class Driver:
    """`raytuner train` in its own process, joined to the cluster, its output in a file."""

    def __init__(self, job_file: Path, address: str, log: Path, *settings: str) -> None:
        self.log = log
        sets = [a for s in [*SETTINGS, *settings] for a in ("--set", s)]
        cmd = [sys.executable, "-m", "raytuner", "train", str(job_file), *sets]
        env = os.environ | {"RAY_ADDRESS": address}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, found: Callable, timeout: float = 180):
        """Poll ``found()`` until it returns something; fail if the driver ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := found():
                return value
            if self.proc.poll() is not None:
                pytest.fail(
                    f"driver exited ({self.proc.returncode}) before {what}:\n"
                    + self.output()[-4000:]
                )
            time.sleep(0.1)
        pytest.fail(f"no {what} after {timeout} s:\n" + self.output()[-4000:])


def attempts(run_dir: str) -> list[tuple[int, list[int]]]:
    """(world size, steps) of every attempt that logged a step, oldest first."""
    out = []
    for steps in sample_log.read_attempts(run_dir):
        if steps:
            world = next(iter(next(iter(steps.values())).values()))["world"]
            out.append((world, sorted(steps)))
    return out


def checkpoint_steps(run_dir: str) -> list[tuple[Path, int]]:
    """(folder, step) of the run's complete checkpoint folders, oldest first (a step redone
    after a restart can have two)."""
    folders = sorted(p for p in Path(run_dir).glob("checkpoint_*") if (p / "state.json").is_file())
    return [(p, json.loads((p / "state.json").read_text())["step"]) for p in folders]


def _settled(run_dir: str, quiet_s: float = 5.0, timeout_s: float = 120.0):
    """``checkpoint_steps`` once no new complete checkpoint has appeared for ``quiet_s``."""
    seen, since = checkpoint_steps(run_dir), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        if (now := checkpoint_steps(run_dir)) != seen:
            seen, since = now, time.monotonic()
    return seen


def scheduled(job_file: Path, steps: int) -> dict[int, list[str]]:
    """step -> the rows of its global batch, straight from the schedule function."""
    job = load_job(job_file)
    t = job.train
    data = open_dataset(job.data.cache, fingerprint(job.model, job.preprocess))
    paths = data.paths
    out: dict[int, list[str]] = {}
    epoch = 0
    while len(out) < steps:
        for batch in epoch_batches(data.buckets, t.seed, epoch, t.global_batch_size, t.remainder):
            out[len(out) + 1] = [paths[i] for i in batch]
        epoch += 1
    return {s: out[s] for s in range(1, steps + 1)}


@pytest.fixture
def cluster(monkeypatch):
    """A head node with room for one training worker; nodes inherit this environment."""
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    # after a node loss, Ray Train's elastic policy first asks for the old group size (Ray's
    # AutoscalingCoordinator refreshes its view of the nodes every 20 s) and waits for that
    # group until this timeout (default 60 s) before it starts the smaller one
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "10")
    cluster = Cluster(
        initialize_head=True, connect=False, head_node_args=NODE | {"include_dashboard": False}
    )
    yield cluster
    cluster.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preempt_shrink_and_resubmit_end_at_max_steps(job_file, cluster, tmp_path):
    run_dir = f"{load_job(job_file).train.output}/elastic"
    node = cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    driver = Driver(job_file, cluster.address, tmp_path / "driver-1.log", "train.max_steps=2000")
    try:
        # both nodes are up when the run starts: a group of 2 workers
        grown = driver.wait_for("a step", lambda: attempts(run_dir))
        assert [w for w, _ in grown] == [2], grown

        # the node's preemption is announced: every rank checkpoints at the step it is at
        drained_at = max(grown[0][1])
        drain = subprocess.run(
            [
                RAY,
                "drain-node",
                "--address",
                cluster.address,
                "--node-id",
                node.node_id,
                "--reason",
                "DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message",
                "spot reclaim",
                "--deadline-remaining-seconds",
                "30",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert drain.returncode == 0, drain.stderr
        jit = driver.wait_for(
            "a preemption checkpoint",
            lambda: [
                int(m)
                for m in re.findall(
                    r"preemption announced: checkpoint at step (\d+)", driver.output()
                )
            ],
        )[0]
        driver.wait_for(f"checkpoint {jit} committed", lambda: committed(run_dir) == jit)
        # the line comes from the preemption path only; its step may also be a multiple of EVERY
        assert jit >= drained_at, "a preemption checkpoint older than the drain"

        # the node goes: the group shrinks to 1 worker and goes on from the preemption checkpoint
        lost = time.monotonic()
        cluster.remove_node(node)
        shrunk = driver.wait_for("a step after the node loss", lambda: attempts(run_dir)[1:])
        node_loss_s = time.monotonic() - lost
        # resumed from the preemption checkpoint, or from a regular one the group committed
        # after it while the node was still up: nothing finished before the notice is redone
        resumed = min(shrunk[0][1]) - 1
        assert shrunk[0][0] == 1, attempts(run_dir)
        assert resumed == jit or (resumed > jit and resumed % EVERY == 0), (jit, resumed)

        # the driver dies; the same job submitted again resumes from the latest checkpoint
        driver.wait_for("a checkpoint on 1 worker", lambda: committed(run_dir) > jit)
        driver.proc.send_signal(signal.SIGKILL)
        driver.proc.wait(timeout=30)
        killed_after = committed(run_dir)
        # the dead driver's worker goes on until Ray ends it, and may finish more checkpoints
        settled = _settled(run_dir)
    finally:
        if driver.proc.poll() is None:
            driver.proc.kill()
            driver.proc.wait(timeout=30)
    # The resubmission changes two settings that may change between submissions: max_steps,
    # so that the test ends soon, and a fixed world of 1 worker. An elastic controller reserves
    # its workers' resources with Ray's AutoscalingCoordinator for 180 s
    # (AUTOSCALING_REQUESTS_EXPIRE_TIME_S) and a SIGKILLed driver cannot cancel that, so an
    # elastic resubmission would wait up to 3 minutes for the dead run's reservation to expire.
    # The newest checkpoint on disk (which the resubmission resumes from, registered by Ray or
    # not) is damaged as well: the resubmission skips it (with a warning) and resumes from the
    # one before, and still trains every later batch once.
    (newest, newest_step), (_, fallback) = settled[-1], settled[-2]
    (newest / "weights.safetensors").write_bytes(b"damaged")
    final = max(killed_after, newest_step) + 6
    settings = (f"train.max_steps={final}", "scaling.workers=1")
    again = Driver(job_file, cluster.address, tmp_path / "driver-2.log", *settings)
    assert again.proc.wait(timeout=300) == 0, again.output()[-4000:]
    assert f"trained {final} steps" in again.output()
    print(f"node removed -> training again on 1 worker: {node_loss_s:.1f} s")

    history = attempts(run_dir)
    assert [w for w, _ in history] == [2, 1, 1], history
    assert min(history[2][1]) - 1 == fallback, (fallback, killed_after)
    assert "skipping unreadable checkpoint" in again.output()
    # no step skipped, none trained twice (the killed attempt's steps past the resumed
    # checkpoint were redone; those past the shortened max_steps are not part of this run)
    trained = {s: ids for s, ids in sample_log.trained(run_dir).items() if s <= final}
    assert trained == scheduled(job_file, final)
    assert lora_changes_the_pipeline(f"{load_job(job_file).train.output}/elastic/lora")
