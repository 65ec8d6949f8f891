"""A whole job on object storage: images, cache and runs on ``s3://`` against a real S3 API on
127.0.0.1 (moto's standalone server, started and stopped here). Preprocess and train with 2
workers in one `raytuner run`, a worker SIGKILLed and the run resumed from its S3 checkpoint,
the final export, then `raytuner sample` and `raytuner cache verify` (in this process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pyarrow.fs as pafs
import pytest

from raytuner import storage
from raytuner.cli import main
from raytuner.tools.demo_images import make_demo_images
from raytuner.train import sample_log

BUCKET = "raytuner-test"
STEPS = 16
JOB = f"""
[model]
family = "sdxl"
pretrained = "tiny"

[data]
images = "s3://{BUCKET}/images"
cache = "s3://{BUCKET}/cache"

[preprocess]
resolution = 64
bucket_step = 16
batch_size = 4

[train]
output = "s3://{BUCKET}/runs"
name = "on-s3"
max_steps = {STEPS}
global_batch_size = 4
remainder = "pad"
log_every = 4
sample_log = true
tensorboard = false

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 4
# one restart for the killed worker, one spare: on the loaded 2-core machine a restart once
# failed again in DDP's first collective (a peer gone; seen once in two suite runs, 2026-11-23)
max_failures = 2
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with one bucket; yields the environment a client needs
    (endpoint and credentials, as a user would export them). The server is stopped after."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto did not start on {endpoint}") from None
                time.sleep(0.2)
        os.environ.update(env)  # this process's pyarrow reads the bucket too
        request = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
        urllib.request.urlopen(request, timeout=10)
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _registered_step(run_dir: str) -> int:
    """The step of the latest checkpoint Ray Train registered on S3 (its snapshot file)."""
    fs, path = storage.resolve(storage.join(run_dir, "checkpoint_manager_snapshot.json"))
    try:
        latest = storage.read_json(fs, path)["latest_checkpoint_result"] or {}
    except (OSError, ValueError, KeyError):
        return 0
    return latest.get("metrics", {}).get("step", 0)


def _kill_a_worker(proc: subprocess.Popen, run_dir: str, killed: list) -> None:
    """SIGKILL one Ray Train worker of ``proc`` once Ray has a checkpoint of step 4 on S3;
    ``killed`` gets (its pid, the step of Ray's latest checkpoint then)."""
    deadline = time.monotonic() + 500
    while proc.poll() is None and time.monotonic() < deadline:
        if (registered := _registered_step(run_dir)) >= 4:
            workers = [
                p
                for p in psutil.Process(proc.pid).children(recursive=True)
                if "RayTrainWorker" in " ".join(p.cmdline())
            ]
            if workers:
                workers[-1].send_signal(signal.SIGKILL)
                killed.append((workers[-1].pid, registered))
                return
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_whole_job_on_s3_survives_a_killed_worker(s3, tmp_path, monkeypatch, capsys):
    images = make_demo_images(tmp_path / "images", per_aspect=3)
    fs, _ = storage.resolve(f"s3://{BUCKET}/images")
    pafs.copy_files(str(images), f"{BUCKET}/images", destination_filesystem=fs)
    (tmp_path / "job.toml").write_text(JOB)
    run_dir = f"s3://{BUCKET}/runs/on-s3"

    proc = subprocess.Popen(
        [sys.executable, "-m", "raytuner", "run", "job.toml"],
        cwd=tmp_path,
        env=os.environ | s3,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed: list = []
    killer = threading.Thread(target=_kill_a_worker, args=(proc, run_dir, killed))
    killer.start()
    out, err = proc.communicate(timeout=900)
    killer.join()
    assert proc.returncode == 0, err[-4000:]
    assert killed, "the run ended before a worker could be killed"
    assert f"trained {STEPS} steps" in out, out
    assert f"LoRA: {run_dir}/lora/pytorch_lora_weights.safetensors" in out

    attempts = sample_log.read_attempts(run_dir)
    assert len(attempts) >= 2  # the first start, and the restart(s) after the kill
    # the restart resumed from an S3 checkpoint (at least the one Ray had when the worker was
    # killed), not from step 0: its first step is the one after a checkpoint's
    (_, registered), resumed = killed[0], min(attempts[1]) - 1
    assert resumed >= registered >= 4 and resumed % 4 == 0, (resumed, registered)
    assert f"rank 0 resumed at step {resumed} " in err, err[-4000:]
    trained = sample_log.trained(run_dir)
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert all(len(ids) == 4 for ids in trained.values())
    assert not (tmp_path / "runs").exists()  # nothing went to local disk instead

    # sample and verify in this process (the CLI's own code, without another torch import)
    monkeypatch.chdir(tmp_path)
    args = ["sample", "job.toml", "--prompt", "a red circle", "--steps", "2", "--out", "samples"]
    assert main(args) == 0
    assert (tmp_path / "samples" / "00-a-red-circle-seed0.png").is_file()
    capsys.readouterr()
    assert main(["cache", "verify", "job.toml"]) == 0
    verified = capsys.readouterr().out
    assert verified.rstrip().endswith(": ok") and "bad " not in verified


def test_sharded_checkpoint_files_are_read_in_place_on_s3(s3, tmp_path):
    """A weights/ folder as two workers write it (each its rows of every tensor, their offsets
    in the file's header) read from the bucket by ranged reads (``shards.RangeReader``: what a
    resumed sharded worker and the final export use), whole tensors assembled from both."""
    import json

    import torch
    from safetensors.torch import save_file

    from raytuner.checkpoint.ranges import RangeReader

    full = {"blocks.0.weight": torch.randn(5, 3), "blocks.0.bias": torch.randn(5)}
    folder = tmp_path / "weights"
    folder.mkdir()
    for rank, rows in enumerate([slice(0, 3), slice(3, 5)]):
        part = {k: v[rows].contiguous() for k, v in full.items()}
        offsets = {
            k: {"saved_offsets": [rows.start] + [0] * (v.dim() - 1)} for k, v in full.items()
        }
        meta = {"DCP_SHARDING_INFO": json.dumps(offsets)}
        save_file(part, folder / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors", meta)
    fs, _ = storage.resolve(f"s3://{BUCKET}/sharded")
    pafs.copy_files(str(folder), f"{BUCKET}/sharded/weights", destination_filesystem=fs)

    reader = RangeReader(fs, f"{BUCKET}/sharded/weights")
    assert reader.shapes() == {k: (tuple(v.shape), v.dtype) for k, v in full.items()}
    read = reader.read(sorted(full))
    assert all(torch.equal(read[k], full[k]) for k in full)


CLIP_JOB = f"""
[model]
family = "wan"
pretrained = "tiny"

[data]
images = "s3://{BUCKET}/clips"
cache = "s3://{BUCKET}/clip-cache"
frames = [5, 9]

[preprocess]
resolution = 64
bucket_step = 16
min_size = 32

[train]
output = "s3://{BUCKET}/clip-runs"
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clips_on_s3_are_listed_decoded_and_reported_as_on_disk(s3, tmp_path):
    """Clips beside an image and their captions in a bucket: `raytuner preprocess` decodes
    them from S3 into samples (one too short), its report line counting each clip once."""
    from clip_files import clip
    from PIL import Image

    folder = tmp_path / "clips"
    folder.mkdir()
    (folder / "long.mp4").write_bytes(clip(12, 24))
    (folder / "short.mp4").write_bytes(clip(3, 24, seed=1))
    Image.new("RGB", (80, 48), (10, 90, 200)).save(folder / "still.png")
    for name in ("long", "short", "still"):
        (folder / f"{name}.txt").write_text(f"a {name} one")
    fs, _ = storage.resolve(f"s3://{BUCKET}/clips")
    pafs.copy_files(str(folder), f"{BUCKET}/clips", destination_filesystem=fs)
    (tmp_path / "job.toml").write_text(CLIP_JOB)
    done = subprocess.run(
        [sys.executable, "-m", "raytuner", "preprocess", "job.toml"],
        cwd=tmp_path, env=os.environ | s3, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "clips: 2 files, 1 trained (1 samples; 9 frames: 1); too_short 1" in done.stdout
    assert "buckets: 80x48: 1, 80x48/3: 1" in done.stdout, done.stdout
