"""What `raytuner check` warns of and does not refuse (exit 0, a line on stderr naming the keys
and what to change): a warm-up that does not end before the run does (``train.warmup_steps``
>= ``train.max_steps``: the learning rate never reaches ``train.learning_rate``). Every
command checks its job first, so `train` and `run` print the same line before they start;
with ``train.epochs`` the steps are known at train, which warns then."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image

from raytuner.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]

JOB = """
[model]
family = "sdxl"
pretrained = "tiny"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
max_steps = 50
"""


def check(tmp_path: Path, warmup: int) -> subprocess.CompletedProcess:
    """`raytuner check` of a job of 50 steps with ``warmup`` warm-up steps, in a process."""
    (tmp_path / "images").mkdir(exist_ok=True)
    Image.new("RGB", (64, 64), (9, 0, 0)).save(tmp_path / "images" / "a.png")
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(root=tmp_path.as_posix()))
    command = [sys.executable, "-m", "raytuner", "check", str(job)]
    command += ["--set", f"train.warmup_steps={warmup}"]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)


def warnings_of(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "train.warmup_steps" in line]


def test_check_warns_of_a_warmup_as_long_as_the_run_and_accepts_the_job(tmp_path):
    result = check(tmp_path, 50)
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"warmup_steps": 50' in result.stdout  # the resolved job, printed as always
    (line,) = warnings_of(result)
    assert "train.warmup_steps = 50 is not below train.max_steps = 50" in line
    assert "never reaches train.learning_rate" in line
    assert "Set train.warmup_steps below train.max_steps (e.g. 5" in line
    shorter = check(tmp_path, 49)
    assert shorter.returncode == 0 and warnings_of(shorter) == [], shorter.stderr[-3000:]


def test_the_steps_of_epochs_are_warned_of_once_known():
    """``train.epochs``: no steps at check (no warning), the steps of the epochs at train."""
    epochs = TrainConfig(output="runs", epochs=2, warmup_steps=40)
    assert epochs.warmup_warning() == ""
    assert "train.max_steps = 40:" in epochs.for_epochs(20).warmup_warning()
    assert epochs.for_epochs(21).warmup_warning() == ""
