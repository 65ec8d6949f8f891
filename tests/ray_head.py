"""A private Ray head for a test: `ray start --head --block` in a session of its own, on free
ports and a private temp dir, stopped by PID (never `ray stop`: other clusters on the machine,
other tests' and other people's, are left alone)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys

import psutil


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
