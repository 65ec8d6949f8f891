"""End to end: `ray job submit` of `raytuner run jobs/tiny.toml` to a real local Ray head.

The test starts its own head with `ray start --head --block` on free ports and a private
temp dir, submits the tiny job with the repository as the working dir, waits for SUCCEEDED
and checks the LoRA it wrote. The cluster is torn down by killing only its own processes:
other Ray clusters on the machine (other tests, other people) are left alone, so there is no
`ray stop` here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")  # the venv's CLI, whatever is on PATH

START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 360
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _free_ports(n: int) -> list[int]:
    """n distinct ports that are free on 127.0.0.1 (all held open at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _terminate_with_parent() -> None:
    """Popen preexec_fn: if pytest is killed before its teardown runs (SIGKILL, a CI timeout),
    the kernel sends SIGTERM to `ray start --block`, which then shuts its node down (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@dataclass
class Cluster:
    url: str  # the dashboard / job-submission address
    token: str
    env: dict[str, str]  # environment for `ray` CLI clients of this cluster
    temp_dir: str
    log: Path  # output of `ray start`

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [RAY, *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def get(self, path: str, timeout: float = 10) -> dict:
        """GET a dashboard REST endpoint, authenticated with the cluster's token."""
        req = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def job_logs(self, job_id: str) -> str:
        out = self.ray("job", "logs", "--address", self.url, job_id)
        return out.stdout + out.stderr


def _head_log_tail(cluster_log: Path, n: int = 40) -> str:
    return "\n".join(cluster_log.read_text(errors="replace").splitlines()[-n:])


def _wait_until_ready(cluster: Cluster, head: subprocess.Popen) -> None:
    """Until the dashboard answers both /api/version and the jobs API."""
    deadline = time.monotonic() + START_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(
                f"`ray start` exited with {head.returncode}:\n{_head_log_tail(cluster.log)}"
            )
        try:
            cluster.get("/api/version")
            cluster.get("/api/jobs/")
            return
        except (OSError, urllib.error.URLError, ValueError) as e:
            last = e
            time.sleep(1)
    pytest.fail(
        f"Ray head not ready after {START_TIMEOUT_S}s ({last!r}):\n{_head_log_tail(cluster.log)}"
    )


def _own_processes(leader: int, temp_dir: str, known: list[psutil.Process]) -> list[psutil.Process]:
    """Live processes of this cluster: `known` (a snapshot of the leader's process tree), those
    still in the leader's session, and any whose command line names the private temp dir."""
    found = {p.pid: p for p in known if p.is_running()}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getsid(p.pid) == leader or temp_dir in " ".join(p.info["cmdline"] or ()):
                found.setdefault(p.pid, p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def _stop_cluster(head: subprocess.Popen, temp_dir: str) -> list[str]:
    """Stop the cluster started as `head`; returns descriptions of processes that survived.

    `ray start --block` shuts its node down on SIGTERM (raylet, GCS, dashboard, agents,
    workers). It runs as the leader of its own session (start_new_session=True), so its
    process group holds the system processes; but Ray workers get a process group of
    their own, and a job's driver and its watchdog run in new sessions, so a killpg alone
    would miss them. So: snapshot the whole process tree first, SIGTERM the leader, then
    SIGTERM/SIGKILL whatever of the snapshot (or of the leader's session, or naming the
    private temp dir) is still alive. Nothing outside this cluster is touched.
    """
    try:
        leader = psutil.Process(head.pid)
        tree = [leader, *leader.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = _own_processes(head.pid, temp_dir, tree)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        psutil.wait_procs(procs, timeout=15)
    left = []
    for p in _own_processes(head.pid, temp_dir, tree):
        with contextlib.suppress(psutil.Error):
            left.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
    return left


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[Cluster]:
    # Ray's unix sockets live under <temp dir>/session_<timestamp>_<pid>/sockets/ and a
    # socket path may not exceed ~107 bytes, too short for pytest's tmp_path: use /tmp/rt*.
    temp_dir = tempfile.mkdtemp(prefix="rt")
    # Token auth: `ray start --head` turns it on by itself whenever a token is found (e.g.
    # ~/.ray/auth_token, which any local `ray.init()` creates), and every client then needs
    # RAY_AUTH_MODE=token plus the token. To be independent of ~/.ray, this cluster gets a
    # fresh token via RAY_AUTH_TOKEN (it takes precedence over the file); the cluster's
    # processes, the job driver and the `ray` CLI clients all read it from the environment.
    token = secrets.token_hex(32)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH")
    }
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        # On SIGTERM the head first drains the node for up to 30 s; not needed in a test.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
    )
    gcs, dashboard, client, agent = _free_ports(4)
    cmd = [
        RAY,
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--num-cpus=4",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        # These default to fixed ports (10001, 52365, 10002-19999) that would clash with other
        # clusters; 0 means a port the OS picks. The remaining ports are random by default.
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent}",
        "--min-worker-port=0",
        "--max-worker-port=0",
    ]
    log = tmp_path / "ray_start.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_terminate_with_parent,
        )
    cluster = Cluster(f"http://127.0.0.1:{dashboard}", token, env, temp_dir, log)
    try:
        _wait_until_ready(cluster, head)
        yield cluster
    finally:
        left = _stop_cluster(head, temp_dir)
        # Keep the cluster's logs with the test's tmp_path, then drop the private temp dir.
        logs = Path(temp_dir) / "session_latest" / "logs"
        if logs.is_dir():
            shutil.copytree(logs, tmp_path / "ray_logs", ignore_dangling_symlinks=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, "processes of the test's Ray cluster survived teardown:\n" + "\n".join(
            left
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_tiny(ray_cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job_id = f"raytuner-e2e-{secrets.token_hex(4)}"
    # The job's PATH need not contain the venv's bin dir: run the CLI with this interpreter.
    # jobs/tiny.toml's relative paths resolve against the uploaded working dir.
    submit = ray_cluster.ray(
        "job",
        "submit",
        "--address",
        ray_cluster.url,
        "--working-dir",
        str(REPO),
        "--submission-id",
        job_id,
        "--no-wait",
        "--",
        sys.executable,
        "-m",
        "raytuner",
        "run",
        "jobs/tiny.toml",
        "--set",
        f"train.output={out / 'runs'}",
        "--set",
        f"data.cache={out / 'cache'}",
    )
    assert submit.returncode == 0, f"ray job submit failed:\n{submit.stdout}\n{submit.stderr}"

    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = "UNKNOWN"
    while time.monotonic() < deadline:
        status = ray_cluster.get(f"/api/jobs/{job_id}")["status"]
        if status in TERMINAL:
            break
        time.sleep(3)
    logs = ray_cluster.job_logs(job_id)
    assert status == "SUCCEEDED", f"job {job_id} ended as {status}; `ray job logs`:\n{logs}"
    assert "trained 12 steps" in logs, logs

    lora = out / "runs" / "tiny" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.is_file() and lora.stat().st_size > 0, f"no LoRA at {lora}; logs:\n{logs}"
    from safetensors.torch import load_file

    weights = load_file(lora)
    assert weights and any("lora" in k for k in weights), sorted(weights)[:10]
