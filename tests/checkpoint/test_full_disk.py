"""A checkpoint on a filesystem that really fills up, a size-limited tmpfs the tests mount
(root only; skipped where mounting is not permitted). Rank 0 writes each checkpoint into a
``raytuner-ckpt-*`` folder under TMPDIR (``Worker.checkpoint``); when the disk fills up, the
folder is removed and the run fails naming the folder and the room needed.

In process, the disk fills up at each file the checkpoint writes (each library says so in its
own way: safetensors, torch.save, json). End to end, `raytuner train` of the skewed job runs
with TMPDIR on the tmpfs: the training workers inherit it from the driver (`raytuner train`
starts its own local Ray), the tmpfs holds their start but not the checkpoint, and the run
fails (exit 1) with one line, leaving no ``raytuner-ckpt-*`` folder behind."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_checkpoint_damage import trained

from raytuner.checkpoint import files, layout

# The skewed job's LoRA (rank 4 on the tiny SDXL UNet) holds 262,144 bytes of float32 weights:
# its checkpoint is about 1.3 MB (weights, optimizer state twice their size, two exported
# files). 384 KiB takes the weights file and fails in the optimizer state's: the folder is
# half written when the disk fills up.
TMPFS_BYTES = 384 * 1024


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int):
    """A tmpfs of ``size`` bytes mounted at ``path`` (skips the test where that is refused)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        # a Ray worker may still be exiting: a lazy unmount detaches it all the same
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def _pages(path: Path) -> int:
    """The bytes a file takes on a tmpfs: whole 4 KiB pages."""
    return -(-path.stat().st_size // 4096) * 4096


def _room_message(folder: Path, step: int, need: int) -> str:
    """The one line the failure says, as a pattern."""
    return (
        rf"checkpoint of step {step} could not be written to "
        + re.escape(str(folder))
        + r"/raytuner-ckpt-\w+ \((.+)\): it needs room for the trained weights \("
        + f"{need:,}"
        + r" bytes\) about three times over \(weights, optimizer state, export\), [\d,]+ bytes "
        r"are free there; free space there or set TMPDIR"
    )


# where the disk fills up: the room the tmpfs has, from the sizes of the files a worker's
# checkpoint folder gets (weights, optimizer state, export, then the JSON records: the run's
# identity, the job, the dataset; state.json is written into the run folder after the upload,
# never here), in the order they are written, and what the writer of that file raises then
FULL_AT = {
    "weights": (lambda s: s["weights"] // 2, "SafetensorError"),
    "optimizer state": (lambda s: s["weights"] + s["optimizer"] // 2, "RuntimeError"),  # torch
    "export": (lambda s: s["weights"] + s["optimizer"] + 4096, "SafetensorError"),
    "records": (lambda s: s["all"] - s["records"], "OSError"),
}


def _worker(tmp_path: Path, steps: int = 1):
    """Rank 0 of a run as far as its checkpoint goes: a LoRA on the tiny SD1.5 UNet after
    ``steps`` steps, and the worker's own ``save`` (the files and records of a real run)."""
    from raytuner import config as c
    from raytuner.checkpoint.checkpointer import Checkpointer
    from raytuner.families import FAMILIES
    from raytuner.train.loop import LoopConfig, Worker

    weights, opt, sched, _ = trained(steps)
    model = c.ModelConfig(family="sd15", pretrained="tiny")
    train = c.TrainConfig(output=str(tmp_path / "runs"))
    worker = Worker.__new__(Worker)
    worker.cfg = LoopConfig(
        family=FAMILIES["sd15"], model=model, train=train, lora=c.LoraConfig(rank=2, alpha=2.0),
        objective=c.ObjectiveConfig(), checkpoint=c.CheckpointConfig(), cache=str(tmp_path),
        fingerprint="0" * 16, manifest={}, dataset={"id": "0" * 16, "rows": 1},
        run_dir=str(tmp_path / "runs" / "run"), job={"model": {"family": "sd15"}},
    )  # fmt: skip
    worker.rank, worker.state = 0, files.TrainState(step=steps)
    worker.weights, worker.opt, worker.sched = weights, opt, sched
    worker.checkpoints = Checkpointer(
        worker.cfg.run_dir, worker.cfg.checkpoint, rank=0, sharded=False, max_steps=100
    )
    worker.observer = None
    return worker


@pytest.mark.parametrize("where", list(FULL_AT))
def test_a_full_disk_at_any_checkpoint_file_removes_the_folder_and_names_it(
    where, tmp_path, monkeypatch
):
    worker = _worker(tmp_path)
    reference = tmp_path / "reference"
    reference.mkdir()
    worker.checkpoints.write(str(reference), worker.state, worker.contents())
    files = [p for p in reference.rglob("*") if p.is_file()]
    assert not (reference / layout.STATE).exists()  # written after the upload, elsewhere
    records = [reference / name for name in (layout.RUN, layout.JOB, layout.DATASET)]
    sizes = {
        "weights": _pages(reference / layout.WEIGHTS),
        "optimizer": _pages(reference / layout.OPTIMIZER),
        "records": sum(_pages(p) for p in records),
        "all": sum(_pages(p) for p in files),
    }
    need = sum(p.numel() * p.element_size() for p in worker.weights.params)
    room, raised = FULL_AT[where]
    with small_tmpfs(tmp_path / "small", room(sizes)) as small:
        monkeypatch.setattr(tempfile, "tempdir", str(small))  # TMPDIR, as the process read it
        with pytest.raises(RuntimeError) as failed:
            worker.checkpoint({}, preempted=False)
        left = sorted(p.name for p in small.iterdir())
    assert re.fullmatch(_room_message(small, 1, need), str(failed.value)), str(failed.value)
    assert type(failed.value.__cause__).__name__ == raised, repr(failed.value.__cause__)
    assert left == []


def _trained_bytes(job_file: Path) -> int:
    """What the message must name: the bytes of the run's trained weights (float32 LoRA)."""
    import torch

    from raytuner.config import load_job
    from raytuner.families import get_family
    from raytuner.train.model import trainable_model

    job = load_job(job_file)
    family = get_family(job.model.family)
    trained = trainable_model(job.model, job.train, job.lora, family, torch.device("cpu"))
    return sum(p.numel() * p.element_size() for p in trained.weights.params)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_disk_fails_the_checkpoint_naming_the_folder_and_leaves_nothing(job_file, tmp_path):
    name = "full-disk"
    run_dir = job_file.parent / "runs" / name
    command = [sys.executable, "-m", "raytuner", "train", str(job_file), "--set"]
    command += [f'train.name="{name}"', "--set", "checkpoint.max_failures=0"]
    command += ["--set", "train.max_steps=4"]  # the first checkpoint is the last step
    with small_tmpfs(tmp_path / "small", TMPFS_BYTES) as small:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
        # Ray puts its session folder (sockets, logs, spilled objects) under TMPDIR on Linux,
        # unless RAY_TMPDIR says otherwise: only the workers' own temporary files go there
        env |= {"TMPDIR": str(small), "RAY_TMPDIR": tempfile.gettempdir()}
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=480, cwd=tmp_path
        )
        left = sorted(p.name for p in small.iterdir())
    print(result.stderr[-3000:])
    assert result.returncode == 1, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("raytuner:")]
    assert len(lines) == 1, lines
    message = _room_message(small, 4, _trained_bytes(job_file))
    assert re.fullmatch("raytuner: train failed: RuntimeError: " + message, lines[0]), lines[0]
    assert not [n for n in left if n.startswith("raytuner-ckpt-")], left
    assert layout.complete_checkpoints(str(run_dir))[1] == []  # nothing reached the run folder
