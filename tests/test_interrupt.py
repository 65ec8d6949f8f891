"""Ctrl-C on `raytuner train` (SIGINT to the process group, as a terminal sends it): one line
saying where the run stands and that the same command resumes, exit 130; the next submission
resumes from the newest complete checkpoint on disk (Ray Train's own list may lack the newest,
its reports never taken), keeps at most ``checkpoint.keep`` + 1 checkpoint folders, logs no step
twice to TensorBoard and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_exact import assert_same_weights, run

from raytuner import runs
from raytuner.train import sample_log

EVERY = 4  # the skewed job's checkpoint.every_steps


def _complete_steps(run_dir: Path) -> list[int]:
    _, folders = runs.complete_checkpoints(str(run_dir))
    steps = []
    for folder in folders:
        with contextlib.suppress(OSError, ValueError):  # being deleted by Ray's retention
            steps.append(json.loads(Path(folder, runs.STATE).read_text())["step"])
    return sorted(steps)


def _interrupt_after(
    job_file: Path, run_dir: Path, step: int, as_ray_job_stop: bool = False
) -> tuple[int, str, float]:
    """`raytuner train` of a long run in its own session; SIGINT to its process group once a
    complete checkpoint of ``step`` or later exists: (exit code, stderr, seconds to exit).
    ``as_ray_job_stop``: as Ray's job supervisor runs and stops a driver instead: SIGINT
    blocked in it (Ray blocks it in its workers, the entrypoint inherits the mask), SIGTERM to
    it."""
    command = [sys.executable, "-m", "raytuner", "train", str(job_file)]
    command += ["--set", f'train.name="{run_dir.name}"', "--set", "train.max_steps=400"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    block = lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # noqa: E731
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=block if as_ray_job_stop else None,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not any(s >= step for s in _complete_steps(run_dir)):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no checkpoint of step {step}: {process.stderr.read()[-2000:]}")
        time.sleep(0.2)
    if as_ray_job_stop:  # the driver alone: here its children are the local Ray's processes
        process.send_signal(signal.SIGTERM)
    else:
        os.killpg(process.pid, signal.SIGINT)
    sent = time.monotonic()
    try:
        _, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, err, time.monotonic() - sent


def _tensorboard_steps(run_dir: Path) -> list[int]:
    """The steps of ``train/loss`` TensorBoard shows (an event file's purge applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / runs.TENSORBOARD))
    events.Reload()
    return [e.step for e in events.Scalars("train/loss")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ctrl_c_says_where_to_resume_and_the_rerun_resumes_from_the_newest_checkpoint(job_file):
    run_dir = job_file.parent / "runs" / "interrupted"
    code, err, seconds = _interrupt_after(job_file, run_dir, 2 * EVERY)
    lines = [line for line in err.splitlines() if line.startswith("raytuner:")]
    newest = _complete_steps(run_dir)[-1]
    print(f"interrupted at checkpoint {newest}: exit {code} after {seconds:.1f} s")
    assert code == 130, err[-3000:]
    assert re.fullmatch(
        rf"raytuner: train interrupted: the newest complete checkpoint is step {newest} "
        r"\(.+\): the same command resumes from it",
        lines[-1],
    ), lines
    assert seconds < 30

    # Ray's own list may lack it (its controller never took the last reports): resume from disk
    final = newest + 2 * EVERY
    summary, _ = run(job_file, "interrupted", f"train.max_steps={final}")
    attempts = sample_log.read_attempts(str(run_dir))
    assert min(attempts[-1]) == newest + 1, "the rerun did not resume at the newest checkpoint"
    expected, _ = run(job_file, f"uninterrupted-{final}", f"train.max_steps={final}")
    assert summary["step"] == final
    assert_same_weights(summary, expected, tolerance=1e-6)

    folders = runs.checkpoint_folders(str(run_dir))[1]
    assert len(folders) <= 2 + 1, f"checkpoint.keep = 2, yet {len(folders)} folders remain"
    steps = _tensorboard_steps(run_dir)
    assert steps == sorted(set(steps)), "a step was logged twice"
    assert steps[-1] == final


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_as_ray_job_stop_sends_it_says_where_to_resume_and_exits_130(job_file):
    """What `ray job stop` does to a job's driver (README step 7): the run stops as on Ctrl-C,
    the last line names the newest complete checkpoint, exit 130, and Ray's C++ "SIGTERM
    received ... PC: @" dump is not printed (``ray.init`` had replaced raytuner's handler)."""
    run_dir = job_file.parent / "runs" / "terminated"
    code, err, seconds = _interrupt_after(job_file, run_dir, EVERY, as_ray_job_stop=True)
    newest = _complete_steps(run_dir)[-1]
    print(f"SIGTERM at checkpoint {newest}: exit {code} after {seconds:.1f} s")
    assert code == 130, err[-3000:]
    assert "SIGTERM received" not in err and "PC: @" not in err, err[-3000:]
    assert re.fullmatch(
        rf"raytuner: train interrupted: the newest complete checkpoint is step {newest} "
        r"\(.+\): the same command resumes from it",
        err.splitlines()[-1],
    ), err[-3000:]
    assert seconds < 30


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
