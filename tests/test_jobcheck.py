"""`raytuner check` refuses what a run would trip over later: run names that leave the run's
folder, written folders nested with image folders, image sizes off the model's pixel grid,
GPUs reserved by CPU workers and ``[objective.<kind>]`` settings of the objective kind the
family does not train with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytuner.cli import main

JOB = """
[model]
family = "{family}"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
"""


def check(tmp_path: Path, capsys, *overrides: str, family: str = "sdxl", name: str = "job"):
    """`raytuner check` of a minimal job under ``tmp_path``: (exit code, stderr)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(family=family, root=tmp_path.as_posix()))
    args = ["check", str(path)]
    for text in overrides:
        args += ["--set", text]
    code = main(args)
    return code, capsys.readouterr().err


def refused(tmp_path: Path, capsys, *overrides: str, family: str = "sdxl") -> str:
    code, err = check(tmp_path, capsys, *overrides, family=family)
    assert code == 2, f"accepted: {overrides} on {family}"
    assert len(err.strip().splitlines()) == 1, err
    return err


def accepted(tmp_path: Path, capsys, *overrides: str, family: str = "sdxl") -> None:
    code, err = check(tmp_path, capsys, *overrides, family=family)
    assert code == 0, err


# --- item 7: names and paths ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a/b", "a\\b", "..", "runs..old", "  ", ".hidden"])
def test_run_name_that_is_not_one_plain_folder_name_is_refused(tmp_path, capsys, name):
    err = refused(tmp_path, capsys, f"train.name={json.dumps(name)}")
    assert f"train.name = {name!r}" in err
    assert "use one plain folder name" in err


def test_run_name_from_a_hidden_job_file_is_refused(tmp_path, capsys):
    code, err = check(tmp_path, capsys, name=".lora")
    assert code == 2
    assert "train.name = '.lora' starts with '.'" in err


def test_plain_run_names_pass(tmp_path, capsys):
    accepted(tmp_path, capsys, "train.name='my-lora_v2.1'")


@pytest.mark.parametrize(
    "overrides, key, value",
    [
        (["data.cache={root}/images/cache"], "data.cache", "{root}/images/cache"),
        (["train.output={root}/images/./runs/"], "train.output", "{root}/images/./runs/"),
        (["data.cache={root}/images"], "data.cache", "{root}/images"),
        (["train.output={root}"], "train.output", "{root}"),  # the images inside the runs
        (["data.images=file://{root}/runs/imgs"], "data.images", "file://{root}/runs/imgs"),
        (
            ["data.images=s3://bucket/data/images", "data.cache=s3://bucket/data/images/cache"],
            "data.cache",
            "s3://bucket/data/images/cache",
        ),
        (["data.cache=gs://b/x", "data.images=gs://b//x/../x/y"], "data.cache", "gs://b/x"),
    ],
)
def test_written_folder_nested_with_an_image_folder_is_refused(
    tmp_path, capsys, overrides, key, value
):
    root = tmp_path.as_posix()
    err = refused(tmp_path, capsys, *(o.format(root=root) for o in overrides))
    assert f"{key} = {value.format(root=root)!r}" in err
    assert "data.images" in err
    assert "outside every image folder" in err


def test_a_source_folder_is_checked_like_data_images(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(
        JOB.format(family="sdxl", root=tmp_path.as_posix())
        + f'[[data.sources]]\npath = "{tmp_path.as_posix()}/more"\n'
    )
    assert main(["check", str(job), "--set", f"train.output={tmp_path}/more/runs"]) == 2
    err = capsys.readouterr().err
    assert f"train.output = '{tmp_path}/more/runs'" in err
    assert "data.sources[0].path" in err


def test_relative_paths_are_compared_absolute(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = refused(tmp_path, capsys, "data.images=imgs", f"data.cache={tmp_path}/imgs/c")
    assert "data.cache" in err and "data.images = 'imgs'" in err


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.images={root}/img", "data.cache={root}/images"],  # a name prefix, not a folder
        ["data.images=s3://bucket/data/img", "data.cache=s3://bucket/data/images"],
        ["data.images=s3://one/data", "data.cache=s3://two/data/cache"],  # other buckets
        ["data.images=s3://bucket/data", "data.cache={root}/data/cache"],  # other filesystems
    ],
)
def test_siblings_and_name_prefixes_pass(tmp_path, capsys, overrides):
    accepted(tmp_path, capsys, *(o.format(root=tmp_path.as_posix()) for o in overrides))


@pytest.mark.parametrize("key", ["data.cache", "train.output"])
def test_empty_written_folder_is_refused(tmp_path, capsys, key):
    err = refused(tmp_path, capsys, f"{key}='  '")
    assert f"{key} is empty" in err


# --- item 8: configuration the model cannot run -----------------------------------------------


@pytest.mark.parametrize("family, step", [("flux", 8), ("flux", 24), ("sana", 16), ("sdxl", 12)])
def test_bucket_step_off_the_family_pixel_grid_is_refused(tmp_path, capsys, family, step):
    err = refused(tmp_path, capsys, f"preprocess.bucket_step={step}", family=family)
    assert f"preprocess.bucket_step = {step}: {family} runs only on image sides" in err


@pytest.mark.parametrize("family, step", [("flux", 16), ("sana", 32), ("sdxl", 16), ("sd15", 8)])
def test_bucket_steps_the_model_runs_pass(tmp_path, capsys, family, step):
    overrides = (f"preprocess.bucket_step={step}", "preprocess.resolution=64")
    accepted(tmp_path, capsys, *overrides, family=family)


def test_resolution_off_the_bucket_step_is_refused(tmp_path, capsys):
    err = refused(tmp_path, capsys, "preprocess.resolution=100", "preprocess.bucket_step=16")
    assert "preprocess.resolution = 100 is not a multiple of the bucket step 16" in err
    # no bucket_step: the family's pixel multiple (Sana: 32)
    err = refused(tmp_path, capsys, "preprocess.resolution=1000", family="sana")
    assert "preprocess.resolution = 1000" in err and "e.g. 992" in err
    # no resolution: the family's default (SD1.5: 512) must be a multiple of the step
    err = refused(tmp_path, capsys, "preprocess.bucket_step=48", family="sd15")
    assert "preprocess.bucket_step = 48 does not divide sd15's default resolution 512" in err


def test_gpus_per_worker_needs_use_gpu(tmp_path, capsys):
    err = refused(tmp_path, capsys, "scaling.gpus_per_worker=1")
    assert "scaling.gpus_per_worker = 1.0 with scaling.use_gpu = false" in err
    accepted(tmp_path, capsys, "scaling.use_gpu=true")  # gpus_per_worker 0: Ray's default
    accepted(tmp_path, capsys, "scaling.use_gpu=true", "scaling.gpus_per_worker=0.5")


@pytest.mark.parametrize(
    "family, override, shown",
    [
        ("flux", 'objective.ddpm.weighting="min_snr"', "objective.ddpm.weighting = 'min_snr'"),
        ("sana", "objective.ddpm.noise_offset=0.1", "objective.ddpm.noise_offset = 0.1"),
        ("flux", "objective.ddpm.min_snr_gamma=3", "objective.ddpm.min_snr_gamma = 3.0"),
        ("sdxl", 'objective.flow.weighting="cosmap"', "objective.flow.weighting = 'cosmap'"),
        ("sd15", 'objective.flow.timestep_sampling="uniform"', "objective.flow.timestep_sampl"),
        ("sdxl", "objective.flow.logit_mean=0.5", "objective.flow.logit_mean = 0.5"),
        ("sdxl", "objective.flow.logit_std=2", "objective.flow.logit_std = 2.0"),
        ("sd15", "objective.flow.mode_scale=1", "objective.flow.mode_scale = 1.0"),
        ("sdxl", "objective.flow.shift=3", "objective.flow.shift = 3.0"),
        ("sdxl", "objective.flow.resolution_shift=false", "objective.flow.resolution_shift = F"),
        ("sana", "objective.flow.guidance=3.5", "objective.flow.guidance = 3.5"),
        ("sdxl", "objective.flow.guidance=3.5", "objective.flow.guidance = 3.5"),
    ],
)
def test_objective_keys_the_family_ignores_are_refused(tmp_path, capsys, family, override, shown):
    err = refused(tmp_path, capsys, override, family=family)
    assert shown in err and family in err


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("flux", ["objective.flow.guidance=3.5", 'objective.flow.weighting="cosmap"']),
        ("sana", ["objective.flow.resolution_shift=false", "objective.flow.shift=3"]),
        ("sana", ['objective.flow.timestep_sampling="mode"', "objective.flow.mode_scale=1"]),
        ("sd15", ['objective.ddpm.weighting="min_snr"', "objective.ddpm.min_snr_gamma=3"]),
        ("sdxl", ["objective.ddpm.noise_offset=0.05", "objective.flow.shift=1.0"]),
    ],
)
def test_objective_keys_the_family_reads_pass(tmp_path, capsys, family, overrides):
    accepted(tmp_path, capsys, *overrides, family=family)
