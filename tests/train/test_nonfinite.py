"""A run whose loss (or weights) stop being finite ends at once, naming the step, and keeps what
it had before: no checkpoint after that step, no exported LoRA of NaNs, exit 1 with a
``raytuner:`` line (``train/finite.py``). Before, a run trained to NaN and exported a LoRA of
NaNs with exit 0.

The NaN comes as it does in real runs: frozen weights in float16 (``model.dtype``) and a
learning rate far too high for them (1.0, which ``check`` accepts: Prodigy's), so that the
float16 activations overflow after a few steps. The same run checks that every checkpoint's
temporary copy (``raytuner-ckpt-*`` under TMPDIR, one per checkpoint) is gone once Ray has
uploaded it: Ray 2.60's synchronous ``ray.train.report`` leaves it to its caller."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import SKEWED_JOB
from safetensors.torch import load_file

from raytuner.checkpoint import layout
from raytuner.train.finite import FiniteGuard

STEP = re.compile(r"not finite (?:at|after) step (\d+)")


def test_a_non_finite_loss_is_named_by_its_step_a_step_late_or_at_once():
    """The check of a step is read at the next step (the device never waited for), or at once
    where the loop waits anyway; a finite run is never stopped."""
    guard, ok = FiniteGuard(torch.device("cpu")), torch.tensor(1.5)
    assert guard.add(1, ok, ok) is None
    assert guard.add(2, torch.tensor(float("nan")), ok) is None  # known at the next step
    late = guard.add(3, ok, ok)
    assert late is not None and STEP.search(late).group(1) == "2", late
    assert "loss nan" in late
    assert guard.add(4, ok, torch.tensor(float("inf"))) is None
    now = guard.now()
    assert now is not None and now.startswith("the gradients are not finite at step 4"), now
    assert guard.now() is None and guard.add(5, ok, ok) is None
    assert guard.weights_finite([torch.ones(3)])
    assert not guard.weights_finite([torch.ones(3), torch.tensor([1.0, float("-inf")])])


def _steps(run_dir: Path) -> list[int]:
    _, folders = layout.complete_checkpoints(str(run_dir))
    return sorted(json.loads(Path(f, layout.STATE).read_text())["step"] for f in folders)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_that_turns_to_nan_stops_at_that_step_and_keeps_its_last_good_checkpoint(
    job_file, tmp_path
):
    """The skewed job's images, preprocessed and trained by one `raytuner run` (float16 frozen
    weights are a cache version of their own)."""
    shutil.copytree(job_file.parent / "images", tmp_path / "images")
    job = tmp_path / "job.toml"
    job.write_text(SKEWED_JOB.format(root=tmp_path))
    run_dir = tmp_path / "runs" / "nan"
    with tempfile.TemporaryDirectory(prefix="rt-tmp-") as tmp:
        command = [sys.executable, "-m", "raytuner", "run", str(job)]
        for setting in (
            'train.name="nan"',
            'model.dtype="float16"',
            "train.learning_rate=1.0",
            "train.max_steps=60",
            "checkpoint.every_steps=1",
            "train.log_every=5",
        ):
            command += ["--set", setting]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
        # the workers' temporary files under a TMPDIR of this test alone (Ray's session folder
        # stays where it was: its socket paths must stay short)
        env |= {"TMPDIR": tmp, "RAY_TMPDIR": tempfile.gettempdir()}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
        left = sorted(p.name for p in Path(tmp).glob("raytuner-ckpt-*"))
    lines = [line for line in done.stderr.splitlines() if line.startswith("raytuner:")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert lines and lines[-1].startswith("raytuner: run failed: TrainingStopped: "), lines
    step = int(STEP.search(lines[-1]).group(1))
    print(lines[-1])

    steps = _steps(run_dir)
    assert steps and steps[-1] < step, (steps, step)  # no checkpoint of the NaN or after it
    assert steps == list(range(1, steps[-1] + 1))  # every step's before it
    assert f"The newest complete checkpoint is step {steps[-1]} (" in lines[-1]
    newest = Path(layout.complete_checkpoints(str(run_dir))[1][0])
    assert all(torch.isfinite(t).all() for t in load_file(newest / layout.WEIGHTS).values())
    assert not (run_dir / layout.LORA_DIR).exists(), "a LoRA of the NaN weights was exported"
    assert not left, f"checkpoints' temporary copies left in TMPDIR: {left}"
