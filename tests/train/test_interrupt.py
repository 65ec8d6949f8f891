"""Ctrl-C on `raytuner train` (SIGINT to the process group, as a terminal sends it): one line
saying where the run stands and that the same command resumes, exit 130; the next submission
resumes from the newest complete checkpoint on disk (Ray Train's own list may lack the newest,
its reports never taken), keeps at most ``checkpoint.keep`` + 1 checkpoint folders, logs no step
twice to TensorBoard and ends with the weights of an uninterrupted run (test_train_exact.py's
reference run, trained once per process). SIGTERM to `raytuner run` (`kill`, `ray job stop`)
stops it the same way; a second Ctrl-C during the stop ends the command at once, and no process
of its local Ray outlives it. Each stop is a `raytuner` subprocess of its own (its own local
Ray): the three stop the command each in another way, so none can serve two.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_train_exact import STEPS, assert_same_weights, reference, run

from raytuner.checkpoint import layout
from raytuner.train import sample_log

EVERY = 4  # the skewed job's checkpoint.every_steps


def _complete_steps(run_dir: Path) -> list[int]:
    _, folders = layout.complete_checkpoints(str(run_dir))
    steps = []
    for folder in folders:
        with contextlib.suppress(OSError, ValueError):  # being deleted by Ray's retention
            steps.append(json.loads(Path(folder, layout.STATE).read_text())["step"])
    return sorted(steps)


# (to whom, which signal, a line of stderr to wait for first): Ctrl-C, as a terminal sends it
# to the process group; again once the run says it is stopping
GROUP_SIGINT = ("group", signal.SIGINT, None)
AGAIN = ("group", signal.SIGINT, "Ctrl-C again to exit at once")


def _interrupt_after(
    job_file: Path,
    name: str,
    step: int,
    command: str = "train",
    signals=(GROUP_SIGINT,),
    block_sigint: bool = False,
    settings: tuple[str, ...] = (),
) -> tuple[int, str, float, int]:
    """`raytuner <command>` of a long run ``name`` in its own session; once a complete
    checkpoint of ``step`` or later exists, ``signals`` in turn, each to the process group
    ("group", as a terminal sends Ctrl-C) or to the process alone ("process", as `kill` and
    `ray job stop` send SIGTERM), once its stderr has the line it waits for: (exit code,
    stderr, seconds from the last signal to the exit, the process id, which is its session's).
    Its stderr is read as it comes (a full pipe would stop it). ``block_sigint``: SIGINT
    blocked in it, as in a `ray job submit` driver (Ray blocks it in its workers and the
    entrypoint inherits the mask). ``settings``: more ``--set`` of the job."""
    run_dir = job_file.parent / "runs" / name
    argv = [sys.executable, "-m", "raytuner", command, str(job_file)]
    for setting in (f'train.name="{name}"', "train.max_steps=400", *settings):
        argv += ["--set", setting]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_block_sigint if block_sigint else None,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lines.extend, args=(process.stderr,))  # line by line
    reader.start()
    try:
        _wait(process, lines, f"a checkpoint of step {step}",
              lambda: any(s >= step for s in _complete_steps(run_dir)))  # fmt: skip
        for to, signum, after in signals:
            if after:
                _wait(process, lines, repr(after), lambda: after in "".join(lines))  # noqa: B023
            if to == "group":
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)
        sent = time.monotonic()
        process.wait(timeout=90)
        seconds = time.monotonic() - sent
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        reader.join(timeout=60)
    return process.returncode, "".join(lines), seconds, process.pid


def _block_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _wait(process: subprocess.Popen, lines: list[str], what: str, found) -> None:
    deadline = time.monotonic() + 240
    while not found():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {what}: {''.join(lines)[-3000:]}")
        time.sleep(0.2)


def _left_in_session(session: int, wait_s: float = 30.0) -> list[str]:
    """The processes of ``session`` (a `raytuner` command's, and its local Ray's) still running
    after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for p in psutil.process_iter(["cmdline", "status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(p.pid) == session and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:80]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _resume_line(command: str, newest: int) -> str:
    return (
        rf"raytuner: {command} interrupted: the newest complete checkpoint is step {newest} "
        r"\(.+\): the same command resumes from it"
    )


def _tensorboard_steps(run_dir: Path) -> list[int]:
    """The steps of ``train/loss`` TensorBoard shows (an event file's purge applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / layout.TENSORBOARD))
    events.Reload()
    return [e.step for e in events.Scalars("train/loss")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_says_where_to_resume_and_the_rerun_resumes_from_the_newest_checkpoint(job_file):
    """Ctrl-C after the first checkpoint, then the rerun to the skewed job's 12 steps, whose
    weights are those of test_train_exact.py's uninterrupted reference run (trained once per
    process: shared where both files run in one). ``checkpoint.keep = 1``, so that the 3
    checkpoints of the 12 steps are more than the rerun may keep."""
    run_dir, keep = job_file.parent / "runs" / "interrupted", "checkpoint.keep=1"
    code, err, seconds, _ = _interrupt_after(job_file, "interrupted", EVERY, settings=(keep,))
    lines = [line for line in err.splitlines() if line.startswith("raytuner:")]
    newest = _complete_steps(run_dir)[-1]
    print(f"interrupted at checkpoint {newest}: exit {code} after {seconds:.1f} s")
    assert code == 130, err[-3000:]
    assert re.fullmatch(_resume_line("train", newest), lines[-1]), lines
    assert seconds < 30

    # Ray's own list may lack it (its controller never took the last reports): resume from disk
    final = STEPS if newest + EVERY <= STEPS else newest + 2 * EVERY  # a slow stop: run on
    summary, _ = run(job_file, "interrupted", f"train.max_steps={final}", keep)
    attempts = sample_log.read_attempts(str(run_dir))
    assert min(attempts[-1]) == newest + 1, "the rerun did not resume at the newest checkpoint"
    if final == STEPS:
        expected, _ = reference(job_file)
    else:
        expected, _ = run(job_file, f"uninterrupted-{final}", f"train.max_steps={final}")
    assert summary["step"] == final
    assert_same_weights(summary, expected, tolerance=1e-6)

    folders = layout.checkpoint_folders(str(run_dir))[1]
    assert len(folders) <= 1 + 1, f"checkpoint.keep = 1, yet {len(folders)} folders remain"
    steps = _tensorboard_steps(run_dir)
    assert steps == sorted(set(steps)), "a step was logged twice"
    assert steps[-1] == final


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_raytuner_run_as_ctrl_c_does(job_file):
    """SIGTERM to the process alone (`kill`; `ray job stop` sends it to a job's driver, whose
    SIGINT Ray has blocked): the same clean stop as Ctrl-C, the line naming the newest
    checkpoint, exit 130, no Ray "SIGTERM received ... PC: @" dump (``ray.init`` had replaced
    raytuner's handler with one that prints it and aborts), nothing of it left running."""
    code, err, seconds, session = _interrupt_after(
        job_file, "terminated", EVERY, command="run",
        signals=[("process", signal.SIGTERM, None)], block_sigint=True,
    )  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("raytuner:")]
    newest = _complete_steps(job_file.parent / "runs" / "terminated")[-1]
    print(f"SIGTERM at checkpoint {newest}: exit {code} after {seconds:.1f} s")
    assert code == 130, err[-3000:]
    assert "SIGTERM received" not in err and "PC: @" not in err, err[-3000:]
    assert re.fullmatch(_resume_line("run", newest), lines[-1]), lines
    assert seconds < 30
    assert _left_in_session(session) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_ctrl_c_during_the_stop_exits_at_once_and_leaves_no_process(job_file):
    """Ctrl-C twice: the first starts the clean stop, the second (once the run says it is
    stopping) ends the command at once, exit 130; its local Ray goes with it."""
    code, err, seconds, session = _interrupt_after(
        job_file, "twice", EVERY, signals=[GROUP_SIGINT, AGAIN]
    )
    lines = [line for line in err.splitlines() if line.startswith("raytuner:")]
    print(f"second Ctrl-C: exit {code} after {seconds:.1f} s")
    assert code == 130, err[-3000:]
    assert lines[-1] == "raytuner: interrupted again: exiting at once", lines
    assert seconds < 5
    assert _left_in_session(session) == []


def test_a_job_driver_given_3_s_says_where_the_run_stands_and_exits_before_the_sigkill():
    """`ray job stop` of a job submitted without jobs/runtime_env.yaml: Ray SIGKILLs the driver
    3 s after its SIGTERM (RAY_JOB_STOP_WAIT_TIME_S unset), too soon for the workers to stop.
    The driver warns of it when training starts, and once interrupted prints where the run
    stands and exits 130 1.5 s later, before the SIGKILL. A driver given 60 s waits on."""
    code = (
        "import logging, time\n"
        "from raytuner.train import stopping\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "stopping.warn_if_short()\n"
        "stopping.exit_before_sigkill(lambda: 'the newest complete checkpoint is step 8 (x)')\n"
        "time.sleep(4)\n"
        "print('still here', flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_JOB_STOP_WAIT_TIME_S"}
    env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = "{}"  # what Ray's job supervisor sets for its driver
    short = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert short.returncode == 130, short.stderr
    assert "gives this driver 3 s before Ray kills it" in short.stderr
    assert short.stderr.splitlines()[-1].startswith(
        "raytuner: train interrupted: the newest complete checkpoint is step 8 (x) (the workers "
        "did not stop within 1.5 s of `ray job stop`"
    ), short.stderr
    assert "still here" not in short.stdout  # gone before its 4 s were up
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "60"
    long = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert long.returncode == 0 and "still here" in long.stdout, long.stderr
    assert "gives this driver" not in long.stderr
