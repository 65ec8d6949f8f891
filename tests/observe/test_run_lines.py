"""What `raytuner run` prints while it runs, timed line by line as a user's terminal sees it: a
line at least every ~10 s (longer only inside one step a line named: Ray's start, loading the
training code), preprocess progress that counts the files read, cached and skipped from the
start, a line when the workers start, build the model and restore, and none of Ray's noise (its
C++ "core_worker.cc ... E" lines, Ray Data's INFO lines, Ray Train's state-API traceback where
no dashboard runs), transformers' "Loading weights" bars or the same prompts-file note twice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUIET_S = 15.0  # ~10 s: the progress lines' period, and what a busy machine delays them
# lines after which the run may be busy longer, in the one step they name
NAMED_STEPS = re.compile(
    "|".join(
        [
            r"raytuner\.runtime: starting a local Ray",
            r"raytuner: train: loading Ray Train",
            r"raytuner\.validation: validation: loading the \w+ pipeline",
            r"raytuner\.validation: training done: waiting for the last validation",
        ]
    )
)
OWN = re.compile(r" raytuner(\.[\w.]+)?: ")  # a line of raytuner's log, the driver's or an actor's
NOISE = re.compile(
    "|".join(
        [
            r"core_worker\.cc:\d+: Actor with class name",
            r"Starting execution of Dataset",
            r"Execution plan of Dataset",
            r"execution finished in",
            r"Data sink \w+ finished",
            r"Loading weights",
            r"State API unavailable",
        ]
    )
)


def timed_run(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, list]:
    """`python -m raytuner <args>`, stdout and stderr as one stream: (exit code, [(seconds
    since the start, line)])."""
    process = subprocess.Popen(
        [sys.executable, "-m", "raytuner", *args],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started, lines = time.monotonic(), []

    def read() -> None:
        for text in process.stdout:
            lines.append((time.monotonic() - started, text.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=30)
    return code, lines


def silences(lines: list) -> list[str]:
    """The gaps over QUIET_S between printed lines that no named step explains: the last line
    of raytuner's before the gap (Ray's own may come between) names one."""
    gaps, step = [], ""
    for (t0, before), (t1, after) in zip(lines, lines[1:], strict=False):
        step = before if OWN.search(before) else step
        if t1 - t0 > QUIET_S and not NAMED_STEPS.search(step):
            gaps.append(f"{t1 - t0:.1f} s after {before!r} (next: {after!r})")
    return gaps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_says_what_it_does_every_10_s_and_nothing_else(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --ss euler_a --s 2\n")  # sd-scripts' sampler: noted once
    sets = {
        "data.cache": str(tmp_path / "cache"),
        "train.output": str(tmp_path / "runs"),
        "lora.text_encoder": "true",  # a LoRA on the text encoders: transformers' bars
        "validation.prompts_file": str(prompts),
    }
    args = ["run", "jobs/tiny.toml"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    # Ray Train's state actor asks the state API every second (default: 30 s): a local Ray
    # without a dashboard (the tests' default) has none
    env = {"RAYTUNER_LOCAL_DASHBOARD": "0", "RAY_TRAIN_STATE_ACTOR_RECONCILIATION_INTERVAL_S": "1"}
    code, lines = timed_run(args, env, timeout=540)
    text = "\n".join(f"{t:6.1f} {s}" for t, s in lines)
    print(text)
    assert code == 0, text[-5000:]
    assert silences(lines) == []
    assert [s for _, s in lines if NOISE.search(s)] == []
    assert sum("--ss euler_a (line 1) is not used" in s for _, s in lines) == 1

    said = [s for _, s in lines]
    final = [s for s in said if "preprocess: images encoded 12/12 in" in s]
    assert len(final) == 1 and "files read 12/12 (0 cached, 0 skipped)" in final[0], text
    for step in (
        # scaling.strategy = "auto" decided before the workers, with its reason
        r"raytuner: train: strategy auto → ddp: CPU workers \(scaling\.use_gpu = false\)",
        r"raytuner\.train\.trainer: run tiny: starting 2 training worker\(s\) \(ddp\)",
        r"2 worker\(s\) started: building the model on cpu",
        r"model built in [\d.]+ s",
        r"no checkpoint in .+: training from step 1",
        r"step 1 took [\d.]+ s",
    ):
        assert any(re.search(step, s) for s in said), f"no line {step!r}:\n{text}"


def test_the_progress_line_counts_from_the_first_second():
    """Before an image is encoded the line says what was read and that the encoders load; a
    rerun over a cached dataset says so, not "0/0"."""
    from raytuner.preprocess.progress import line

    loading = line({"read": 5, "cached": 1, "skipped": 1, "to_encode": 3}, 12, 12, 4.0, False)
    assert loading == (
        "images encoded 0/12 (the encoders are loading); files read 5/12 (1 cached, 1 skipped)"
    )
    counts = {"read": 12, "cached": 2, "skipped": 1, "to_encode": 9, "ready": 1, "encoded": 3}
    assert line(counts, 12, 12, 10.0, False) == (
        "images encoded 3/9 (0.3/s) ETA 0:00:20; files read 12/12 (2 cached, 1 skipped)"
    )
    assert line(counts | {"encoded": 9}, 12, 12, 30.0, True) == (
        "images encoded 9/9 in 30.0 s (0.3/s); files read 12/12 (2 cached, 1 skipped)"
    )
    cached = {"read": 12, "cached": 12}
    assert line(cached, 12, 0, 3.0, True) == (
        "nothing to encode; files read 12/12 (12 cached, 0 skipped) in 3.0 s"
    )


def test_the_progress_line_counts_files_as_files_and_clip_samples_as_samples():
    """A clip in chunks is one file read and several samples to encode: the files part counts
    files (never more read than listed), the encode part images and clip samples, the files
    not read yet guessed one image each."""
    from raytuner.preprocess.progress import line

    # 4 files listed, 3 guessed new: an image and a clip of 3 chunks read, a cached clip read,
    # one file not read yet
    reading = {"read": 3, "cached": 1, "to_encode": 4, "samples": 3, "ready": 1, "encoded": 2}
    assert line(reading, 4, 3, 10.0, False) == (
        "images and clip samples encoded 2/5 (0.2/s) ETA 0:00:15; "
        "files read 3/4 (1 cached, 0 skipped)"
    )
    clips = {"read": 2, "to_encode": 6, "samples": 6, "ready": 1, "encoded": 6}
    assert line(clips, 2, 2, 12.0, True) == (
        "clip samples encoded 6/6 in 12.0 s (0.5/s); files read 2/2 (0 cached, 0 skipped)"
    )
