"""`raytuner check` refuses what a run would trip over later: run names that leave the run's
folder, written folders nested with image folders, image sizes off the model's pixel grid,
GPUs reserved by CPU workers, ``[objective.<kind>]`` settings of the objective kind the
family does not train with, image folders that are missing or hold no image, and relative
outputs inside Ray's copy of a job's working dir."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from PIL import Image

from raytuner.cli import main
from raytuner.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]

JOB = """
[model]
family = "{family}"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
"""


def image_folder(folder: Path, count: int = 1) -> Path:
    """``folder`` holding ``count`` small PNGs (what the check lists: names, never pixels)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(folder / f"{i}.png")
    return folder


def check(tmp_path: Path, capsys, *overrides: str, family: str = "sdxl", name: str = "job"):
    """`raytuner check` of a minimal job under ``tmp_path`` (its images/ holding an image):
    (exit code, stderr)."""
    image_folder(tmp_path / "images")
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
    image_folder(tmp_path / "images")
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
    image_folder(tmp_path / "img")
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


def test_a_misspelt_set_is_blamed_on_the_set_with_the_nearest_key(tmp_path, capsys):
    err = refused(tmp_path, capsys, "train.lerning_rate=1")
    assert (
        "--set train.lerning_rate=1: unknown key train.lerning_rate (did you mean "
        "learning_rate?); allowed keys in [train]: output, name" in err
    )
    (tmp_path / "job.toml").write_text(
        JOB.format(family="sdxl", root=tmp_path.as_posix()) + "lerning_rate = 1\n"
    )
    assert main(["check", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err
    shown = "unknown key train.lerning_rate (did you mean learning_rate?)"
    assert f"{tmp_path}/job.toml: {shown}" in err
    assert "--set" not in err


# --- issue 28 item 5: the image folders, and outputs in Ray's copy of a job's working dir ----


def test_a_missing_image_folder_is_refused_naming_the_key_and_the_path(tmp_path, capsys):
    err = refused(tmp_path, capsys, f"data.images={tmp_path}/photos")
    assert f"data.images = '{tmp_path}/photos': no such folder" in err
    # a relative one: the path it was looked for at
    code, err = check(tmp_path, capsys, "data.images=nowhere/photos")
    assert code == 2 and "data.images = 'nowhere/photos': no such folder (/" in err
    assert "nowhere/photos)" in err and "relative path is from the working directory" in err
    # a source: its own key
    job = tmp_path / "job.toml"
    job.write_text(
        JOB.format(family="sdxl", root=tmp_path.as_posix())
        + f'[[data.sources]]\npath = "{tmp_path.as_posix()}/kohya"\n'
    )
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"data.sources[0].path = '{tmp_path.as_posix()}/kohya': no such folder" in err
    (tmp_path / "kohya").write_text("a file")
    assert main(["check", str(job)]) == 2
    assert "data.sources[0].path" in (err := capsys.readouterr().err) and "not a folder" in err


def test_a_missing_references_folder_is_refused_before_any_image_is_read(tmp_path, capsys):
    """Edit pairs: a references folder that is not there would have every pair reported
    missing its reference after the whole folder was encoded."""
    err = refused(tmp_path, capsys, 'data.references="controls"', family="flux-kontext")
    assert "data.references = 'controls': no such folder" in err
    assert f"{tmp_path.as_posix()}/images/controls" in err and "reference images" in err
    image_folder(tmp_path / "images" / "controls")
    accepted(tmp_path, capsys, 'data.references="controls"', family="flux-kontext")


def test_an_image_folder_without_an_image_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "a.txt").write_text("a caption without its image")
    (empty / ".hidden.png").write_bytes(b"")  # hidden files are no input
    (empty / "notes.pdf").write_bytes(b"%PDF")
    err = refused(tmp_path, capsys, f"data.images={empty}")
    assert f"data.images = '{empty}': holds no image" in err and ".png" in err
    # images the listing would skip, all of them: a kohya folder of 0 repeats
    image_folder(empty / "0_ohwx person")
    job = tmp_path / "job.toml"
    job.write_text(
        JOB.format(family="sdxl", root=tmp_path.as_posix())
        + f'[[data.sources]]\npath = "{empty.as_posix()}"\nrepeats_from_folder = true\n'
    )
    image_folder(tmp_path / "images")
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert "data.sources[0].path" in err and "none of its 1 images would be encoded" in err
    assert "says 0 repeats" in err


def test_check_logs_the_image_count_and_keeps_stdout_json(tmp_path, capsys, caplog):
    image_folder(tmp_path / "images", count=3)
    (tmp_path / "images" / "3.txt").write_text("not an image")
    caplog.set_level(logging.INFO, logger="raytuner")
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(family="sdxl", root=tmp_path.as_posix()))
    assert main(["check", str(path)]) == 0
    assert f"data.images = '{tmp_path.as_posix()}/images': 3 images" in caplog.text
    assert json.loads(capsys.readouterr().out)["data"]["images"] == f"{tmp_path}/images"


def test_uri_folders_are_not_listed_and_reads_images_false_skips_the_folders(tmp_path):
    """Operations that read the committed cache (train, sample) or nothing (plan) do not need
    the image folders: a folder removed after its preprocess does not stop them."""
    from raytuner.api import check as api_check
    from raytuner.config import ConfigError, load_job

    path = tmp_path / "job.toml"
    path.write_text(JOB.format(family="sdxl", root=tmp_path.as_posix()))
    job = load_job(path)
    with pytest.raises(ConfigError, match="data.images = .*: no such folder"):
        api_check(job)
    api_check(job, reads_images=False)
    api_check(job, runs=False)
    api_check(load_job(path, ["data.images=s3://bucket/images"]))  # listed by the preprocess


def _in_ray_working_dir(tmp_path: Path, monkeypatch) -> Path:
    """The working directory and environment `ray job submit --working-dir .` gives the job's
    entrypoint (Ray 2.60): the upload unpacked under the session's runtime_resources, and the
    job config in RAY_JOB_CONFIG_JSON_ENV_VAR. jobs/ is copied into it."""
    copy = tmp_path / "session_2026" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1a2b"
    shutil.copytree(REPO / "jobs", copy / "jobs")
    config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_1a2b.zip"}, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    monkeypatch.chdir(copy)
    return copy


def test_relative_outputs_in_a_ray_jobs_working_dir_are_refused(tmp_path, capsys, monkeypatch):
    copy = _in_ray_working_dir(tmp_path, monkeypatch)
    assert main(["check", "jobs/tiny.toml"]) == 2
    err = capsys.readouterr().err
    assert "data.cache = 'runs/cache' and train.output = 'runs' are relative" in err
    assert f"a Ray job's working dir: they would be written under {copy}" in err
    assert "an absolute path every node reaches" in err and "s3://" in err
    assert len(err.strip().splitlines()) == 1, err
    one = ["--set", f"data.cache={tmp_path}/cache"]
    assert main(["check", "jobs/tiny.toml", *one]) == 2
    err = capsys.readouterr().err
    assert "train.output = 'runs' is relative" in err and "data.cache" not in err
    assert "--set train.output=s3://bucket/runs" in err


def test_the_tiny_jobs_submit_example_passes_in_a_ray_working_dir(tmp_path, capsys, monkeypatch):
    """jobs/tiny.toml's header example, as the job's entrypoint runs it: absolute outputs, the
    images read (relative) from the uploaded copy."""
    header = (REPO / "jobs" / "tiny.toml").read_text().split("\n[")[0].splitlines()
    start = next(i for i, line in enumerate(header) if "ray job submit" in line)
    example = " ".join(line.strip("# \\") for line in header[start:])
    assert example.startswith("ray job submit --runtime-env jobs/runtime_env.yaml")
    sets = example.split(" -- raytuner run jobs/tiny.toml ")[1].split()
    assert sets == ["--set", "data.cache=/shared/cache", "--set", "train.output=/shared/runs"]
    _in_ray_working_dir(tmp_path, monkeypatch)
    assert main(["check", "jobs/tiny.toml", *sets]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["data"]["images"] == "jobs/tiny_images"


def test_relative_outputs_outside_a_ray_working_dir_pass(tmp_path, capsys, monkeypatch):
    """A folder of the same name elsewhere in the path, or Ray's variable alone (a job whose
    entrypoint changed directory first), is not Ray's copy."""
    image_folder(tmp_path / "runtime_resources" / "images")
    monkeypatch.chdir(tmp_path / "runtime_resources")
    config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_1a2b.zip"}, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    job = tmp_path / "runtime_resources" / "job.toml"
    job.write_text(JOB.format(family="sdxl", root=".").replace('"./', '"'))
    assert main(["check", str(job)]) == 0, capsys.readouterr().err


# --- issue 37: GPU switches -------------------------------------------------------------------


def test_gpu_kernel_choices_are_refused_for_cpu_workers(tmp_path, capsys):
    err = refused(tmp_path, capsys, 'train.attention="flash"')
    assert 'train.attention = "flash"' in err and "scaling.use_gpu = false" in err
    accepted(tmp_path, capsys, 'train.attention="flash"', "scaling.use_gpu=true")
    err = refused(tmp_path, capsys, 'train.attention="fa9"', "scaling.use_gpu=true")
    assert "must be one of auto, flash, efficient, cudnn, math" in err


def test_compile_is_true_false_or_auto_and_refused_where_it_failed_on_a_gpu(tmp_path, capsys):
    """Sana's compiled blocks failed on an H100: `true` is refused for GPU workers (naming the
    error), `auto` leaves it eager; on CPU workers it compiles as asked."""
    err = refused(tmp_path, capsys, 'train.compile="yes"')
    assert 'must be true, false or "auto"' in err
    err = refused(tmp_path, capsys, "train.compile=true", "scaling.use_gpu=true", family="sana")
    assert "failed on a GPU" in err and "last dimension must be contiguous" in err
    accepted(tmp_path, capsys, "scaling.use_gpu=true", family="sana")  # auto
    accepted(tmp_path, capsys, "train.compile=true", family="sana")  # CPU workers


def test_auto_compiles_on_gpus_where_it_was_measured_faster():
    import torch

    from raytuner.families import FAMILIES
    from raytuner.train.model import compiles

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = {name: compiles("auto", f, cuda) for name, f in FAMILIES.items()}
    assert auto == {"flux": True, "sdxl": True, "sd15": False, "sana": False, "z-image": False,
                    "wan": False, "wan22": False, "wan22-5b": False, "qwen-image": False,
                    "flux2-klein": False, "flux2-dev": False, "flux-kontext": False,
                    "qwen-image-edit": False, "ltx2": False}  # fmt: skip
    assert not compiles("auto", FAMILIES["flux"], cpu)
    assert not compiles("auto", FAMILIES["flux"], cuda, swapped=8)  # hooks dynamo cannot hold
    assert compiles(True, FAMILIES["sd15"], cpu) and not compiles(False, FAMILIES["flux"], cuda)
    assert not compiles(True, FAMILIES["flux"], torch.device("meta"))


# the families whose blocks' frozen linears may multiply in float8, as the registry says
FLOAT8_FAMILIES = [n for n, f in FAMILIES.items() if f.blocks.float8_matmul]


@pytest.mark.parametrize(
    "family, overrides, shown",
    [
        ("flux", [], "scaling.use_gpu = false: CPU workers have no FP8"),
        ("sdxl", ["scaling.use_gpu=true"], f"allowed for {', '.join(FLOAT8_FAMILIES)}"),
        ("flux", ["scaling.use_gpu=true", 'model.dtype="float8"'], "stored in float8 already"),
        ("flux", ["scaling.use_gpu=true", 'scaling.strategy="fsdp"'], "sharded weights"),
        ("flux", ["scaling.use_gpu=true", 'train.mode="full"'], "only frozen base weights"),
        (
            "flux",
            ["scaling.use_gpu=true", "memory.blocks_to_swap=2"]
            + ["train.gradient_checkpointing=true"],
            "streamed blocks",
        ),
    ],
)
def test_float8_matmul_is_refused_where_it_cannot_run(tmp_path, capsys, family, overrides, shown):
    err = refused(tmp_path, capsys, "train.float8_matmul=true", *overrides, family=family)
    assert "train.float8_matmul = true" in err and shown in err


def test_float8_matmul_passes_for_a_transformer_family_on_gpus(tmp_path, capsys):
    accepted(tmp_path, capsys, "train.float8_matmul=true", "scaling.use_gpu=true", family="sana")


# --- issue 41: adapter kinds ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        (['lora.kind="lokr"', "lora.dora=true"], "lora.dora = True is an option of lora.kind"),
        (['lora.kind="loha"', "lora.factor=4"], "lora.factor = 4 is an option of lora.kind"),
        (["lora.rank_dropout=0.1"], "lora.rank_dropout = 0.1 is an option of lora.kind"),
        (['lora.kind="lokr"', "lora.dropout=0.1"], "lora.dropout = 0.1 is an option"),
        (['lora.kind="lokr"', "lora.text_encoder=true"], "lora.text_encoder = true with"),
        (["lora.dora=true", "lora.text_encoder=true"], "lora.text_encoder = true with"),
        (['lora.kind="lokr"', 'train.mode="full"'], "lora.kind = 'lokr': train.mode"),
        (
            [
                'lora.kind="lokr"',
                'lora.target_modules=["time_embedding"]',
                'model.pretrained="tiny"',
            ],
            "lora.target_modules",
        ),
        (['lora.kind="lycoris"'], "lora.kind = 'lycoris': must be one of lora, lokr, loha"),
    ],
)
def test_adapter_kind_settings_peft_cannot_run_are_refused(tmp_path, capsys, overrides, shown):
    assert shown in refused(tmp_path, capsys, *overrides)


def test_each_adapter_kind_with_its_options_passes(tmp_path, capsys):
    for overrides in (
        ['lora.kind="lokr"', "lora.factor=8", "lora.decompose_both=true", "lora.rank_dropout=0.1"],
        ['lora.kind="loha"', "lora.module_dropout=0.1"],
        ["lora.dora=true", "lora.dropout=0.1"],
    ):
        accepted(tmp_path, capsys, *overrides, family="flux")


def test_a_frame_count_the_video_family_cannot_encode_is_refused_naming_the_nearest(
    tmp_path, capsys
):
    code, err = check(tmp_path, capsys, "data.frames=[17, 80]", family="wan")
    assert code == 2 and "data.frames holds 80" in err and "use e.g. 81" in err, err
    source = "data.sources=[{path = 'more', frames = [6]}]"
    code, err = check(tmp_path, capsys, source, family="wan", name="source")
    assert code == 2 and "data.sources[0].frames holds 6" in err and "e.g. 5" in err, err
    # an image family never encodes clips' frames: its frames are not checked
    assert check(tmp_path, capsys, "data.frames=[80]", name="sdxl")[0] == 0
