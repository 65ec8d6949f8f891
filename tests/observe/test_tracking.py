"""Experiment tracking: rank 0's reporting (``Observer``) and the validation actor's
(``ValidationReport``) in a Weights & Biases offline run, read back from the files W&B writes
under the run folder: the scalars on the ``train/step`` axis, the grid as an image file, the
resolved job as the run config, and one W&B run id for every attempt of the raytuner run (a
resume logs into the same W&B run). TensorBoard event files of an ``s3://`` run reach the
bucket as training goes. `raytuner check` refuses ``tracking.wandb`` without the package."""

from __future__ import annotations

import glob
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import test_s3
from PIL import Image

from raytuner import storage
from raytuner.checkpoint.layout import WANDB_RUN_ID
from raytuner.cli import main
from raytuner.config import TrackingConfig, load_job
from raytuner.observe.observer import Observer, ValidationReport

s3 = test_s3.s3  # the moto S3 server on 127.0.0.1 (module scope: one for this file)
JOB = """
[model]
family = "sd15"
pretrained = "tiny"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
name = "tracked"
max_steps = 6
[tracking]
wandb = true
wandb_mode = "offline"
"""
WINDOW = {"loss": 0.25, "samples_per_s": 40.0, "step_time_s": 0.1, "data_wait_fraction": 0.05}


def wandb_records(path: str):
    """The records of a ``.wandb`` file (W&B's transaction log: a 7-byte header, then
    LevelDB-log chunks in 32 KiB blocks, each chunk a 7-byte header: CRC, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = Path(path).read_bytes(), 7, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left  # a block's tail too small for a chunk header is padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_run(folder: str) -> dict:
    """What one offline run folder holds: its id, config, history rows and files."""
    (log,) = glob.glob(os.path.join(folder, "run-*.wandb"))
    out: dict = {"config": {}, "history": [], "folder": folder}
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"] = r.run.run_id
            for u in r.run.config.update:
                out["config"][u.key] = json.loads(u.value_json)
        elif kind == "history":
            row: dict = {}
            for item in r.history.item:
                key = "/".join(item.nested_key) if item.nested_key else item.key
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
    out["config"].pop("_wandb", None)
    return out


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A run folder with two attempts of rank 0 (the second a resume) and a validation grid,
    all logged to W&B offline; yields (run folder, resolved job, the grid, offline runs)."""
    root = tmp_path_factory.mktemp("tracked")
    job_file = root / "job.toml"
    job_file.write_text(JOB.format(root=root.as_posix()))
    job = load_job(str(job_file), [])
    run_dir = str(root / "runs" / "tracked")
    quiet = {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB__DISABLE_STATS": "true"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in quiet.items():
            mp.setenv(key, value)
        mp.chdir(root)  # nothing may land in the working directory
        first = Observer(run_dir, 6, True, job.tracking, job.to_dict())
        first.window(2, WINDOW, 1e-4)
        first.window(4, WINDOW | {"loss": 0.2}, 1e-4)
        first.checkpoint(4, 1.5)
        first.close()
        resumed = Observer(run_dir, 6, True, job.tracking, job.to_dict())  # a restart
        resumed.window(6, WINDOW | {"loss": 0.15}, 5e-5)
        resumed.close()
        grid = np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)
        report = ValidationReport(run_dir, True, job.tracking)
        report.image(4, grid, 2.5)
        report.close()
        assert sorted(os.listdir(root)) == ["job.toml", "runs"]
    runs = [offline_run(f) for f in sorted(glob.glob(f"{run_dir}/wandb/offline-run-*"))]
    return run_dir, job, grid, runs


def _rows(runs: list[dict], key: str) -> list[dict]:
    return [row for r in runs for row in r["history"] if key in row]


def test_one_wandb_run_for_every_attempt_and_the_validation_actor(tracked):
    run_dir, _, _, runs = tracked
    ident = Path(run_dir, WANDB_RUN_ID).read_text().strip()
    assert len(runs) == 3  # two attempts of rank 0 and the validation actor, offline each
    assert {r["id"] for r in runs} == {ident}  # `wandb sync` joins them into one W&B run


def test_scalars_on_the_train_step_axis(tracked):
    *_, runs = tracked
    losses = {row["train/step"]: row["train/loss"] for row in _rows(runs, "train/loss")}
    assert losses == {2: 0.25, 4: 0.2, 6: 0.15}
    (ckpt,) = _rows(runs, "train/checkpoint_time_s")
    assert ckpt["train/step"] == 4 and ckpt["train/checkpoint_time_s"] == 1.5
    for key in ("samples_per_s", "step_time_s", "data_wait_fraction", "lr"):
        assert len(_rows(runs, f"train/{key}")) == 3, key


def test_the_resolved_job_is_the_run_config(tracked):
    _, job, _, runs = tracked
    expected = json.loads(json.dumps(job.to_dict()))
    primary = [r for r in runs if _rows([r], "train/loss")]
    assert len(primary) == 2
    assert all(r["config"] == expected for r in primary)


def test_the_validation_grid_is_an_image_of_the_run(tracked):
    *_, grid, runs = tracked
    (row,) = _rows(runs, "validation/grid/_type")
    assert row["validation/grid/_type"] == "image-file"
    assert row["validation/step"] == 4 and row["validation/time_s"] == 2.5
    (holder,) = [r for r in runs if row in r["history"]]
    image = Path(holder["folder"], "files", row["validation/grid/path"])
    assert np.array_equal(np.asarray(Image.open(image).convert("RGB")), grid)


def test_tensorboard_beside_wandb(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, *_ = tracked
    events = EventAccumulator(f"{run_dir}/tensorboard", size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in events.Images("validation")] == [4]


def test_a_run_on_s3_gets_its_tensorboard_and_offline_wandb_files(s3, tmp_path, monkeypatch):
    """Written locally, copied to the bucket: event files as training goes, W&B at the end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    run_dir = f"s3://{test_s3.BUCKET}/runs/on-s3-tracked"
    fs, folder = storage.resolve(storage.join(run_dir, "tensorboard"))
    offline = TrackingConfig(wandb=True, wandb_mode="offline")
    observer = Observer(run_dir, 10, True, offline, {"train": {"max_steps": 10}})
    observer.window(5, WINDOW, 1e-4)
    assert [i.base_name for i in storage.listdir(fs, folder)]  # copied as training goes
    observer.window(10, WINDOW | {"loss": 0.125}, 1e-4)
    observer.close()
    assert os.listdir(tmp_path) == []
    for info in storage.listdir(fs, folder):
        (tmp_path / info.base_name).write_bytes(storage.read_bytes(fs, info.path))
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(5, 0.25), (10, 0.125)]

    _, root = storage.resolve(run_dir)
    (run,) = [i for i in storage.listdir(fs, f"{root}/wandb") if "offline-run-" in i.base_name]
    copy = tmp_path / run.base_name
    for info in storage.listdir(fs, run.path):
        if info.base_name.endswith(".wandb"):
            copy.mkdir()
            (copy / info.base_name).write_bytes(storage.read_bytes(fs, info.path))
    pulled = offline_run(str(copy))
    assert pulled["id"] == storage.read_bytes(fs, f"{root}/{WANDB_RUN_ID}").decode()
    assert pulled["config"] == {"train": {"max_steps": 10}}
    assert [row["train/loss"] for row in pulled["history"]] == [0.25, 0.125]


def test_check_refuses_wandb_without_the_package(tmp_path, capsys, monkeypatch):
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(root=tmp_path.as_posix()))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert "tracking.wandb = true" in err and "pip install 'raytuner[tracking]'" in err
    (tmp_path / "images").mkdir()  # `check` lists the image folder: one image in it
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    assert main(["check", str(job), "--set", "tracking.wandb=false"]) == 0
