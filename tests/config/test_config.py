"""Job config: strict TOML loading, typed overrides, and `raytuner check` exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raytuner.config import ConfigError, load_job, parse_override
from raytuner.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """
[model]
family = "sdxl"
[data]
images = "imgs"
cache = "cache"
[train]
output = "runs"
"""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raytuner", *args], capture_output=True, text=True, cwd=REPO
    )


def test_minimal_job_gets_defaults_and_run_name_from_file(tmp_path):
    job = load_job(write(tmp_path, MINIMAL, "my_lora.toml"))
    assert job.model.pretrained == "tiny"
    assert job.train.name == "my_lora"
    assert job.scaling.workers == 1
    assert job.checkpoint.keep == 2


def test_unknown_key_names_file_key_and_allowed_keys(tmp_path):
    path = write(tmp_path, MINIMAL + "learning_rat = 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_job(path)
    message = str(err.value)
    assert str(path) in message
    assert "train.learning_rat" in message
    assert "learning_rate" in message and "max_steps" in message


def test_unknown_section_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[optimiser\].*allowed sections"):
        load_job(write(tmp_path, MINIMAL + "[optimiser]\nlr = 1\n"))


def test_wrong_type_names_key_and_expected_type(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.max_steps = '10'.*expected integer"):
        load_job(write(tmp_path, MINIMAL + 'max_steps = "10"\n'))
    with pytest.raises(
        ConfigError, match=r"scaling\.workers.*expected integer or array of integer"
    ):
        load_job(write(tmp_path, MINIMAL + '[scaling]\nworkers = "two"\n'))


def test_bool_is_not_an_int_and_int_is_a_float(tmp_path):
    with pytest.raises(ConfigError, match="train.max_steps"):
        load_job(write(tmp_path, MINIMAL + "max_steps = true\n"))
    job = load_job(write(tmp_path, MINIMAL + "learning_rate = 1\n"))
    assert job.train.learning_rate == 1.0 and isinstance(job.train.learning_rate, float)


def test_missing_required_key(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required key\(s\) data.cache"):
        load_job(write(tmp_path, MINIMAL.replace('cache = "cache"', "")))


def test_values_are_validated(tmp_path):
    # the family registry (not a copy of its names in the config) decides what is known
    unknown = cli("check", str(write(tmp_path, MINIMAL.replace('"sdxl"', '"sd3"'))))
    assert unknown.returncode == 2
    known = ", ".join(FAMILIES)  # in the registry's order
    assert f"model.family = 'sd3' is unknown; available: {known}" in unknown.stderr
    with pytest.raises(ConfigError, match=r"scaling.workers = \[4, 2\]"):
        load_job(write(tmp_path, MINIMAL + "[scaling]\nworkers = [4, 2]\n"))
    with pytest.raises(ConfigError, match="global_batch_size = 2 is smaller than the 4 workers"):
        load_job(write(tmp_path, MINIMAL + "global_batch_size = 2\n[scaling]\nworkers = 4\n"))


def test_epochs_or_max_steps_one_of_them(tmp_path):
    job = write(tmp_path, MINIMAL)
    assert load_job(job).train.max_steps == 100  # neither: the default length
    epochs = load_job(job, ["train.epochs=3"]).train
    assert (epochs.epochs, epochs.max_steps) == (3, 0)  # its steps are counted at train
    assert epochs.for_epochs(7).max_steps == 21
    with pytest.raises(ConfigError, match=r"train.max_steps = 20 and train.epochs = 3: set one"):
        load_job(job, ["train.epochs=3", "train.max_steps=20"])


def test_overrides_are_typed_like_toml(tmp_path):
    job = load_job(
        write(tmp_path, MINIMAL),
        [
            "train.max_steps=7",
            "train.learning_rate=3e-4",
            "scaling.workers=[1, 3]",
            "data.images=/abs/path with spaces",
            'model.pretrained="a/b"',
            "checkpoint.resume=false",
        ],
    )
    assert job.train.max_steps == 7
    assert job.train.learning_rate == 3e-4
    assert job.scaling.workers == [1, 3]
    assert job.data.images == "/abs/path with spaces"
    assert job.model.pretrained == "a/b"
    assert job.checkpoint.resume is False


def test_override_errors_are_config_errors(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match="train.max_steps = 'many'"):
        load_job(path, ["train.max_steps=many"])
    with pytest.raises(ConfigError, match="unknown key train.steps"):
        load_job(path, ["train.steps=3"])
    with pytest.raises(ConfigError, match="use --set section.key=value"):
        parse_override("max_steps=3")


@pytest.mark.parametrize("job", sorted(p.name for p in (REPO / "jobs").glob("*.toml")))
def test_every_shipped_job_passes_check(job, capsys, monkeypatch, tmp_path):
    """Through the CLI's own ``main`` in this process (the exit-code tests below start it),
    from the repository root. The GPU jobs' ``/data/images`` placeholder is refused until it is
    pointed at a folder with images."""
    from PIL import Image

    from raytuner.cli import main

    monkeypatch.chdir(REPO)
    path = str(REPO / "jobs" / job)
    sets = []
    if not Path(images := load_job(path).data.images).is_dir():
        assert main(["check", path]) == 2
        assert f"data.images = {images!r}: no such folder" in capsys.readouterr().err
        (tmp_path / "images").mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
        if references := load_job(path).data.references:  # an edit job's: refused if missing
            (tmp_path / "images" / references).mkdir()
            Image.new("RGB", (8, 8)).save(tmp_path / "images" / references / "a.png")
        sets = ["--set", f"data.images={tmp_path / 'images'}"]
    assert main(["check", path, *sets]) == 0
    assert '"family"' in capsys.readouterr().out


def test_check_prints_only_json_on_stdout_and_the_image_count_on_stderr():
    result = cli("check", "jobs/tiny.toml")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["data"]["images"] == "jobs/tiny_images"
    assert "raytuner: data.images = 'jobs/tiny_images': 12 images" in result.stderr


@pytest.mark.parametrize(
    "extra, overrides, where, shown",
    [
        ("", ["train.lerning_rate=1"], "--set train.lerning_rate=1", "train.lerning_rate"),
        ("lerning_rate = 1\n", [], "{path}", "train.lerning_rate"),
        ("", ["objective.flow.shif=3"], "--set objective.flow.shif=3", "objective.flow.shif"),
        ("[objective.flow]\nshif = 3\n", [], "{path}", "objective.flow.shif"),
    ],
)
def test_unknown_key_names_where_it_came_from_and_the_nearest_key(
    tmp_path, extra, overrides, where, shown
):
    path = write(tmp_path, MINIMAL + extra)
    with pytest.raises(ConfigError) as err:
        load_job(path, overrides)
    near = "shift" if shown.endswith("shif") else "learning_rate"
    assert str(err.value).startswith(
        f"{where.format(path=path)}: unknown key {shown} (did you mean {near}?); allowed keys"
    ), err.value


def test_unknown_section_names_where_it_came_from_and_the_nearest_section(tmp_path):
    path = write(tmp_path, MINIMAL + "[valdation]\nsteps = 2\n")
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert str(err.value).startswith(
        f"{path}: unknown section [valdation] (did you mean [validation]?); allowed sections"
    )
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, MINIMAL), ["traning.max_steps=3"])
    assert str(err.value).startswith(
        "--set traning.max_steps=3: unknown section [traning] (did you mean [train]?)"
    )
    # nothing near: no guess
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, MINIMAL), ["zzz.x=3", "train.max_steps=3"])
    assert "did you mean" not in str(err.value)


def test_a_set_below_a_value_is_blamed_on_the_set(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, MINIMAL), ["train.max_steps.x=3"])
    assert str(err.value).startswith(
        "--set train.max_steps.x=3: train.max_steps is a value in the job file (integer)"
    )


def test_check_misspelt_key_exits_2_with_the_key_and_allowed_keys(tmp_path):
    path = write(tmp_path, MINIMAL + "max_stepz = 3\n")
    result = cli("check", str(path))
    assert result.returncode == 2
    assert "train.max_stepz" in result.stderr and "max_steps" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_usage_errors_exit_2():
    assert cli().returncode == 2
    assert cli("check").returncode == 2
    assert cli("check", "no/such/job.toml").returncode == 2


def test_runtime_failure_exits_1_with_one_line(ray_local, tmp_path, capsys):
    """Through the CLI's own ``main`` on the session's Ray (a subprocess costs an interpreter,
    a torch import and a Ray start, ~20 s; main's code is what `python -m raytuner` exits
    with, and the exit-2 tests above run it as a subprocess)."""
    from raytuner.cli import main

    # a valid job whose cache was never built: training must refuse with a reason
    path = write(tmp_path, MINIMAL.replace('"cache"', f'"{tmp_path / "cache"}"'))
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "no committed cache" in err
    assert "raytuner preprocess" in err
    assert len(err.strip().splitlines()) == 1, err
