"""The suite's own Ctrl-C (``tests/conftest.py``): one SIGINT to the process group, as a terminal
sends it, stops the whole pytest run with exit 130, although the test it lands in swallows the
KeyboardInterrupt (as ``raytuner.cli.main`` does: one line, exit 130); and a process the run
started in a session of its own (a `raytuner` subprocess, the local Ray it started) is stopped
on the way out. A pytest run of two tests, with this suite's conftest, in a process of its own."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

INNER = """
import os, subprocess, sys, time
from pathlib import Path

OUT = Path({out!r})


def test_a_test_that_swallows_ctrl_c():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               start_new_session=True)
    (OUT / "sleeper").write_text(str(sleeper.pid))
    (OUT / "ready").touch()
    try:
        time.sleep(120)
    except KeyboardInterrupt:  # what raytuner.cli.main does with it: exit 130
        pass
    assert False, "interrupted"


def test_the_next_test():
    (OUT / "next ran").touch()
"""


FOREGROUND = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


def _signal_masks(pid: int) -> str:
    """A process's blocked and ignored signals, as /proc shows them (a SIGINT blocked or ignored
    there never reaches Python's handler)."""
    with open(f"/proc/{pid}/status") as f:
        return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn")))


def test_one_ctrl_c_stops_the_run_and_the_processes_it_started(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER.format(out=str(out)))
    # a pytest run in a terminal's foreground: Python's own Ctrl-C handler, even where this run
    # was started in the background (a shell's `&` ignores SIGINT, and its children inherit that)
    command = [sys.executable, "-c", FOREGROUND, "-q", "-p", "no:cacheprovider", "test_inner.py"]
    # the sleeper never exits by itself: no grace before it is stopped (default 5 s)
    env = os.environ | {"RAYTUNER_TEST_EXIT_GRACE_S": "0"}
    inner = subprocess.Popen(
        command, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    sleeper = None
    try:
        deadline = time.monotonic() + 120
        while not (out / "ready").exists():
            assert inner.poll() is None and time.monotonic() < deadline, inner.stdout.read()
            time.sleep(0.1)
        sleeper = psutil.Process(int((out / "sleeper").read_text()))
        inherited = _signal_masks(inner.pid)  # what the run got from this process
        os.killpg(inner.pid, signal.SIGINT)
        try:
            output, _ = inner.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            inner.kill()
            output, _ = inner.communicate()
            raise AssertionError(f"no exit 60 s after Ctrl-C ({inherited}): {output}") from None
        assert inner.returncode == 130, output
        assert not (out / "next ran").exists(), output
        assert "interrupted (Ctrl-C)" in output, output
        assert not sleeper.is_running() or sleeper.status() == psutil.STATUS_ZOMBIE, output
    finally:
        for process in (inner, sleeper):
            with contextlib.suppress(psutil.Error, OSError, AttributeError):
                process.kill()
