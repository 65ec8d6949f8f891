"""End to end: `ray job submit` of `raytuner run jobs/tiny.toml` to a real local Ray head.

The test starts its own head with `ray start --head --block` on free ports, a private temp dir
and a Prometheus metrics port, submits the tiny job with jobs/runtime_env.yaml, scrapes the
metrics endpoint while it runs, waits for SUCCEEDED, then checks what a user looks at: the
progress lines in `ray job logs` (each once), raytuner's metrics tagged with the run, the run
on the dashboard's Train API, the validation grids (written while training went on), the
TensorBoard events and the LoRA. A second job, stopped with `ray job stop` once it has a
checkpoint, reuses the cache the first one committed when the first ran (as a user's second job
reuses the cache of the first): its images are not encoded twice. Teardown kills only this
cluster's processes: other Ray clusters on the machine (other tests, other people) are left
alone, so no `ray stop` here.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
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
JOB_TIMEOUT_S = 360
# a line Ray forwards from an actor or worker: "(Validator pid=1953) ...", maybe in colour
ACTOR_LINE = re.compile(r"(\x1b\[\d+m)?\(\w+ pid=\d+(, ip=[\d.]+)?\)")


@dataclass
class Cluster:
    url: str  # the dashboard = job-submission address
    metrics_url: str  # Prometheus text format
    token: str
    env: dict[str, str]  # environment for `ray` CLI clients of this cluster
    temp_dir: str
    log: Path  # output of `ray start`
    gcs_port: int = 0  # the head's GCS (what `ray start` writes in ray_current_cluster)

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [RAY, *args]
        return subprocess.run(
            cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def get(self, path: str) -> dict:
        """GET a dashboard REST endpoint, authenticated with the cluster's token."""
        headers = {"Authorization": f"Bearer {self.token}"}
        req = urllib.request.Request(self.url + path, headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def job_status(self, job_id: str) -> str:
        try:
            return self.get(f"/api/jobs/{job_id}")["status"]
        except (OSError, ValueError) as e:  # a busy dashboard may time out: ask again
            return f"UNKNOWN ({e!r})"

    def job_logs(self, job_id: str) -> str:
        out = self.ray("job", "logs", "--address", self.url, job_id)
        return out.stdout + out.stderr

    def metrics(self) -> str:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
                return resp.read().decode()
        except OSError:  # not up yet, or busy
            return ""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One head for the module's jobs (a start costs ~30 s here)."""
    tmp_path = tmp_path_factory.mktemp("ray_cluster")
    temp_dir = private_temp_dir()
    # Token auth: `ray start --head` turns it on by itself whenever it finds a token, e.g.
    # ~/.ray/auth_token (which any local `ray.init()` creates); each client then needs
    # RAY_AUTH_MODE=token and the token. Independently of ~/.ray, this cluster gets a fresh
    # token in RAY_AUTH_TOKEN (it wins over the file). The cluster's processes, the job's
    # driver (which inherits the raylet's environment) and the `ray` CLI all read it there.
    token = secrets.token_hex(32)
    # export metrics every second (default 10 s): the tiny job's workers live seconds
    env = private_env(token, RAY_metrics_report_interval_ms="1000")
    ports = free_ports(5)
    _, dashboard, _, _, metrics = ports
    log = tmp_path / "ray_start.log"
    head = start_head(RAY, temp_dir, ports, env, log, "--num-cpus=4")
    urls = f"http://127.0.0.1:{dashboard}", f"http://127.0.0.1:{metrics}/metrics"
    cluster = Cluster(*urls, token, env, temp_dir, log, ports[0])

    def ready() -> bool:  # the dashboard answers /api/version and the jobs API (or raises)
        cluster.get("/api/version")
        cluster.get("/api/jobs/")
        return True

    try:
        wait_until_ready(head, ready, log, START_TIMEOUT_S)
        yield cluster
    finally:
        left = stop_and_keep_logs(head, temp_dir, tmp_path)
        assert not left, "processes of the test's Ray cluster survived:\n" + "\n".join(left)


@pytest.mark.slow
def test_a_command_without_ray_address_starts_its_own_ray_beside_a_ray_start_cluster(
    ray_cluster: Cluster,
) -> None:
    """Without RAY_ADDRESS a command starts a local Ray of its own (docs/job-toml.md), also
    where `ray start` left a cluster that a bare ``ray.init()`` joins: Ray's default temp dir
    (RAY_TMPDIR) names this module's head in its ``ray_current_cluster``, as `ray start` on
    the machine leaves it. Joining another's Ray, a command's run ended when that Ray did (a
    test's preprocess ran on another test's cluster)."""
    default = Path(private_temp_dir())
    try:
        (default / "ray").mkdir()
        head = f"127.0.0.1:{ray_cluster.gcs_port}"
        (default / "ray" / "ray_current_cluster").write_text(head)
        env = ray_cluster.env | {"RAY_TMPDIR": str(default)}
        script = ("from raytuner import runtime; runtime.connect(); import ray; "
                  "print(ray.get_runtime_context().gcs_address)")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        joined = out.stdout.strip().splitlines()[-1]
        assert not joined.endswith(f":{ray_cluster.gcs_port}"), f"joined {head}: {out.stderr}"
    finally:
        shutil.rmtree(default, ignore_errors=True)


# raytuner's series on the metrics endpoint (Ray adds "ray_", counters end in "_total")
METRICS = [
    "ray_raytuner_train_loss", "ray_raytuner_train_samples_per_s", "ray_raytuner_train_step_time_s",
    "ray_raytuner_train_data_wait_fraction", "ray_raytuner_checkpoint_time_s",
    "ray_raytuner_images_encoded_total", "ray_raytuner_images_encoded_per_s",
    "ray_raytuner_cache_hits", "ray_raytuner_skipped_inputs", "ray_raytuner_validation_time_s",
]  # fmt: skip


def _series(text: str, run: str) -> set[str]:
    """Names of the series in a Prometheus scrape that carry ``run="<run>"``."""
    tag = re.compile(r'^(\w+)\{[^}]*\brun="' + re.escape(run) + '"')
    return {m.group(1) for line in text.splitlines() if (m := tag.match(line))}


def _wait_for_job(cluster: Cluster, job_id: str) -> tuple[str, set[str]]:
    """Poll until the job ends, scraping the metrics endpoint as it runs (a worker's gauges
    leave the endpoint when the worker exits); returns the status and the series seen."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    seen: set[str] = set()
    status = cluster.job_status(job_id)
    while status not in ("SUCCEEDED", "FAILED", "STOPPED") and time.monotonic() < deadline:
        seen |= _series(cluster.metrics(), "tiny")
        time.sleep(1)
        status = cluster.job_status(job_id)
    return status, seen | _series(cluster.metrics(), "tiny")


def _check_logs(logs: str) -> None:
    """One progress line per window (step/max, loss, samples/s, ETA) and per preprocess pass,
    each exactly once; no Ray Data progress bars."""
    steps = re.findall(r"step (\d+)/12 loss [\d.]+ lr \S+ [\d.]+ samples/s .* ETA \S+", logs)
    assert steps == [str(n) for n in range(1, 13)], f"progress lines {steps}:\n{logs}"
    assert len(re.findall(r"preprocess: images encoded 12/12 in", logs)) == 1, logs
    assert len(re.findall(r"validation at step 4: ", logs)) == 1, logs
    assert "Running Dataset" not in logs and "it/s]" not in logs, logs


def _check_validation(run: Path) -> None:
    """A 2x2 grid PNG (2 prompts x 2 seeds at 64 px) per validation step, also in TensorBoard;
    training did not wait for the render of step 4, by the times the run recorded: rank 0
    logged step 5 (its TensorBoard scalars' wall time) before that render ended (its record's
    ``finished_at``). A render that blocked training would end first. The render need not be
    slower than four steps, only than one, by a wide margin: it is queued once Ray Train's
    controller has taken the step-4 checkpoint's report (polled every 0.5 s here) and the first
    one loads the pipeline, while rank 0 trains step 5 as soon as its report is uploaded."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for step in (4, 8, 12):
        with Image.open(run / "validation" / f"step_{step:06d}.png") as grid:
            assert grid.size == (128, 128)
    record = json.loads((run / "validation" / "step_000004.json").read_text())
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("validation")] == [4, 8, 12]
    assert {"train/loss", "train/lr", "train/samples_per_s"} <= set(events.Tags()["scalars"])
    logged = {e.step: e.wall_time for e in events.Scalars("train/step_time_s")}
    assert sorted(logged) == list(range(1, 13)), logged
    assert logged[4] < record["started_at"] <= record["finished_at"], (logged, record)
    assert logged[5] < record["finished_at"], f"training waited for the render: {logged}, {record}"
    ahead = record["finished_at"] - logged[5]
    print(f"step 5 logged {ahead:.1f} s before the render of step 4 ended")


@pytest.fixture(scope="module")
def committed_caches() -> list[Path]:
    """The caches of the module's jobs that succeeded: a later job reuses one, as a user's
    second job reuses the first one's (its preprocess finds every image cached and starts no
    encoder), so the module's images are encoded once."""
    return []


def _submit(cluster: Cluster, out: Path, *sets: str, cache: Path | None = None) -> str:
    """`ray job submit --no-wait` of `raytuner run jobs/tiny.toml` with jobs/runtime_env.yaml,
    its runs under ``out`` and its cache there too unless ``cache`` names one; ``sets``: more
    ``--set`` values. Returns the job's id. What `ray job submit` prints is the user's too:
    nothing of the working dir's caches."""
    job_id = f"raytuner-e2e-{secrets.token_hex(4)}"
    # The job's PATH need not hold the venv's bin dir: run the CLI with this interpreter.
    # jobs/tiny.toml's relative paths resolve against the uploaded working dir.
    entrypoint = [
        sys.executable, "-m", "raytuner", "run", "jobs/tiny.toml",
        "--set", f"train.output={out / 'runs'}", "--set", f"data.cache={cache or out / 'cache'}",
    ]  # fmt: skip
    entrypoint += [arg for value in sets for arg in ("--set", value)]
    submit = cluster.ray(
        "job", "submit", "--address", cluster.url, "--runtime-env", "jobs/runtime_env.yaml",
        "--entrypoint-num-cpus", "0.5", "--submission-id", job_id, "--no-wait", "--", *entrypoint,
    )  # fmt: skip
    printed = submit.stdout + submit.stderr
    assert submit.returncode == 0, f"ray job submit failed:\n{printed}"
    # Ray names each .gitignore it reads: ruff's and pytest's caches have one of their own
    caches = [
        line for line in printed.splitlines() if "Ignoring upload" in line and "_cache" in line
    ]
    assert not caches, printed
    return job_id


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_tiny(
    ray_cluster: Cluster, tmp_path: Path, committed_caches: list[Path]
) -> None:
    """A fresh cache of its own: the job encodes the images (its preprocess line says so)."""
    out = tmp_path / "out"
    job_id = _submit(ray_cluster, out, "train.log_every=1")  # every step's time in TensorBoard

    status, seen = _wait_for_job(ray_cluster, job_id)
    logs = ray_cluster.job_logs(job_id)
    assert status == "SUCCEEDED", f"job {job_id}: {status}; `ray job logs`:\n{logs}"
    assert "trained 12 steps" in logs, logs
    _check_logs(logs)
    committed_caches.append(out / "cache")
    assert not set(METRICS) - seen, f"missing on the metrics endpoint: {set(METRICS) - seen}"
    runs = ray_cluster.get("/api/train/v2/runs/v1")
    assert "tiny" in json.dumps(runs), f"the run is not on the dashboard's Train API: {runs}"
    _check_validation(out / "runs" / "tiny")

    lora = out / "runs" / "tiny" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file() and lora.stat().st_size > 0, f"no LoRA at {lora}; logs:\n{logs}"
    from safetensors.torch import load_file  # imports torch: only once the job has passed

    weights = load_file(lora)
    assert any("lora" in k for k in weights), sorted(weights)[:10]


def _complete_steps(run_dir: Path) -> list[int]:
    """The steps of the run's complete checkpoints (state.json written last)."""
    from raytuner.checkpoint import layout

    steps = []
    for folder in layout.complete_checkpoints(str(run_dir))[1]:
        with contextlib.suppress(OSError, ValueError):  # being deleted by Ray's retention
            steps.append(json.loads(Path(folder, layout.STATE).read_text())["step"])
    return sorted(steps)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_stop_ends_the_log_with_the_newest_checkpoint(
    ray_cluster, tmp_path, committed_caches
) -> None:
    """README step 7: `ray job stop` of a training job stops its workers and the driver's part of
    the job's log ends in the line that names the newest complete checkpoint, without Ray's
    "SIGTERM received" dump; the driver exits by itself within the time jobs/runtime_env.yaml
    gives it (RAY_JOB_STOP_WAIT_TIME_S), not by Ray's SIGKILL. The job reuses the cache of the
    module's job that succeeded, where that one ran (alone, this test encodes its own)."""
    out = tmp_path / "out"
    cache = committed_caches[0] if committed_caches else None
    sets = ("train.max_steps=400", 'train.name="stopped"')
    job_id = _submit(ray_cluster, out, *sets, cache=cache)
    run_dir, deadline = out / "runs" / "stopped", time.monotonic() + JOB_TIMEOUT_S
    while not _complete_steps(run_dir):
        status = ray_cluster.job_status(job_id)
        assert status in ("PENDING", "RUNNING") or status.startswith("UNKNOWN"), (
            f"job {job_id}: {status}:\n{ray_cluster.job_logs(job_id)}"
        )
        assert time.monotonic() < deadline, ray_cluster.job_logs(job_id)
        time.sleep(0.5)
    stopped = time.monotonic()
    stop = ray_cluster.ray("job", "stop", "--address", ray_cluster.url, job_id, timeout=180)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    print(f"`ray job stop` returned after {time.monotonic() - stopped:.1f} s")
    assert ray_cluster.job_status(job_id) == "STOPPED"
    logs = ray_cluster.job_logs(job_id)
    assert "SIGTERM received" not in logs and "PC: @" not in logs, logs
    # the driver's last line: an actor's line (the validator's last render) is forwarded by Ray's
    # log monitor a moment after it was written, so it may land after the driver's own last line
    last = [line for line in logs.splitlines() if line.strip() and not ACTOR_LINE.match(line)][-1]
    newest = _complete_steps(run_dir)[-1]
    assert re.fullmatch(
        rf"raytuner: run interrupted: the newest complete checkpoint is step {newest} "
        r"\(.+\): the same command resumes from it",
        last,
    ), logs[-3000:]
    supervisor = Path(ray_cluster.temp_dir, "session_latest", "logs", "jobs")
    said = (supervisor / f"supervisor-{job_id}.log").read_text()
    assert "has been terminated gracefully" in said, said  # not SIGKILLed
