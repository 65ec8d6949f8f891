"""A private Ray head for a test: `ray start --head --block` in a session of its own, on free
ports and a private temp dir, stopped by PID (never `ray stop`: other clusters on the machine,
other tests' and other people's, are left alone)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest


def free_ports(n: int) -> list[int]:
    """n distinct ports that are free on 127.0.0.1 (all held open at once, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def terminate_with_parent() -> None:
    """Popen preexec_fn: if pytest is killed before its teardown runs (SIGKILL, a CI timeout),
    the kernel sends SIGTERM to `ray start --block`, which then shuts its node down (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def own_processes(leader: int, temp_dir: str, known: list[psutil.Process]) -> list[psutil.Process]:
    """Live processes of this cluster: those of `known` (a snapshot of the leader's process
    tree), those in the leader's session, and those whose command line names the temp dir."""
    names_temp_dir = re.compile(re.escape(temp_dir) + r"(/|\s|$)")
    found = {p.pid: p for p in known if p.is_running()}
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == leader or names_temp_dir.search(cmdline):
                found.setdefault(p.pid, p)
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_cluster(head: subprocess.Popen, temp_dir: str) -> list[str]:
    """Stop the cluster started as `head`; returns the processes that survived (none, normally).

    `ray start --block` shuts its whole node down on SIGTERM (GCS, raylet, dashboard, agents,
    workers, in ~3 s). It is the leader of its own session (start_new_session=True), but only
    Ray's system processes stay in its process group: every worker gets a process group of
    its own, and a job's driver and its watchdog run in sessions of their own, so a killpg
    would miss them. Hence: snapshot the process tree, SIGTERM the leader, then SIGTERM and
    SIGKILL whatever is left of the snapshot, of the leader's session, or names the private
    temp dir. Nothing outside this cluster is touched.
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
        procs = own_processes(head.pid, temp_dir, tree)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
        psutil.wait_procs(procs, timeout=15)
    left = []
    for p in own_processes(head.pid, temp_dir, tree):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:  # dead, only not yet reaped by its parent
                left.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
    return left


def private_env(token: str, **extra: str) -> dict[str, str]:
    """This process's environment for a private head, its nodes and its clients: no inherited
    cluster address, the fresh auth ``token`` in RAY_AUTH_TOKEN (it wins over ~/.ray's file),
    a head that shuts down on SIGTERM without first draining its work; plus ``extra``."""
    drop = {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # default: wait up to 30 s for running work
        **extra,
    )
    return env


def start_head(
    ray: str, temp_dir: str, ports: list[int], env: dict[str, str], log: Path, *extra: str
) -> subprocess.Popen:
    """`ray start --head --block` on ``ports`` (gcs, dashboard, client, agent, metrics, from
    `free_ports(5)`), the private ``temp_dir``, its output in ``log``; ``extra``: more flags."""
    gcs, dashboard, client, agent, metrics = ports
    cmd = [
        ray, "start", "--head", "--block", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", f"--port={gcs}", *extra,
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        # These default to fixed ports (10001, 52365, 10002-19999) that other clusters use
        # too; worker ports 0 = ports the OS picks. The other ports are random by default.
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
        "--min-worker-port=0", "--max-worker-port=0", f"--metrics-export-port={metrics}",
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=terminate_with_parent,
        )


def stop_and_keep_logs(head: subprocess.Popen, temp_dir: str, keep: Path) -> list[str]:
    """`stop_cluster`, then the cluster's logs copied to ``keep``/ray_logs (a test's tmp_path)
    and its private temp dir removed; returns the processes that survived (none, normally)."""
    left = stop_cluster(head, temp_dir)
    logs = Path(temp_dir) / "session_latest" / "logs"
    if logs.is_dir():
        shutil.copytree(logs, keep / "ray_logs", ignore_dangling_symlinks=True)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return left


def private_temp_dir() -> str:
    """A fresh /tmp/rtXXXXXXXX for a head: Ray's unix sockets live in <temp dir>/session_*/
    sockets/ and a socket path may not exceed ~107 bytes, too short under pytest's tmp_path."""
    return tempfile.mkdtemp(prefix="rt")


def wait_until_ready(
    head: subprocess.Popen, ready: Callable[[], bool], log: Path, timeout_s: float
) -> None:
    """Poll ``ready()`` every second until it is true; fail (with the end of ``log``, the
    output of `ray start`) if the head exits first or ``timeout_s`` passes. ``ready`` may
    raise OSError, ValueError or KeyError while the dashboard comes up."""

    def tail() -> str:
        return "\n".join(log.read_text(errors="replace").splitlines()[-40:])

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"`ray start` exited with {head.returncode}:\n{tail()}")
        try:
            if ready():
                return
        except (OSError, ValueError, KeyError) as e:
            last = e
        time.sleep(1)
    pytest.fail(f"Ray head not ready after {timeout_s}s ({last!r}):\n{tail()}")
