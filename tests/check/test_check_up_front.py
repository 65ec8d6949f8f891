"""`raytuner check` refuses what a run's workers would trip over later, and a bad job is exit 2
wherever it is found.

Before, a ``lora.init_from`` file of another rank (or model, or targets), target modules peft
cannot adapt or the family's kohya layout cannot name, and a validation size off the pixel grid
passed `check`; `train` then failed 73 s later inside every worker (a traceback each, exit 1),
and the validation actor failed at every render. Now `check` refuses them from the model's
architecture on the meta device and the LoRA file's header (its weights unread), naming the key.
What a worker still refuses as a ``ConfigError`` (docs/reliability.md lists it) reaches the user
as exit 2 and its one line, through Ray's wrappers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_jobcheck import accepted, refused
from test_lora_files import exported, meta

from raytuner.checkpoint import layout
from raytuner.config import ConfigError, LoraConfig


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """A rank-2, alpha-4 LoRA of the tiny SDXL UNet, exported in both layouts."""
    folder = tmp_path_factory.mktemp("known")
    exported("sdxl", folder, LoraConfig(rank=2, alpha=4.0))
    return folder / "lora"


@pytest.mark.parametrize("file", [layout.DIFFUSERS_FILE, layout.KOHYA_FILE])
def test_check_refuses_an_init_from_lora_of_another_rank_or_alpha(tmp_path, capsys, known, file):
    path = f"lora.init_from={known / file}"
    accepted(tmp_path, capsys, path, "lora.rank=2", "lora.alpha=4")
    err = refused(tmp_path, capsys, path, "lora.rank=4", "lora.alpha=4")
    assert "lora.init_from = " in err and file in err
    assert "rank 2 and alpha 4, the job lora.rank = 4" in err and "set lora.rank = 2" in err
    err = refused(tmp_path, capsys, path, "lora.rank=2")  # alpha: the default 16
    assert "set lora.rank = 2 and lora.alpha = 4" in err


def test_check_refuses_an_init_from_of_another_model_or_targets(tmp_path, capsys, known):
    kohya = known / layout.KOHYA_FILE
    err = refused(tmp_path, capsys, f"lora.init_from={kohya}", family="flux")
    assert "lora.init_from" in err and "name no module of this model" in err
    narrow = ["lora.rank=2", "lora.alpha=4", "lora.target_modules=['to_q']"]
    err = refused(tmp_path, capsys, f"lora.init_from={kohya}", *narrow)
    assert "lora.target_modules does not reach" in err
    tensors = load_file(str(kohya))  # a text encoder's LoRA in a job that trains none
    tensors["lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight"] = torch.zeros(4, 2)
    save_file(tensors, str(tmp_path / "te.safetensors"))
    err = refused(tmp_path, capsys, f"lora.init_from={tmp_path / 'te.safetensors'}", *narrow[:2])
    assert "set lora.text_encoder = true" in err
    (tmp_path / "not.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    err = refused(tmp_path, capsys, f"lora.init_from={tmp_path / 'not.safetensors'}")
    assert "not a safetensors file" in err


def test_check_reads_the_header_and_not_the_weights(tmp_path, capsys, known):
    """Weights overwritten with NaN bytes (the header and the alphas kept): `check` does not
    read them, so it accepts the file as it would an intact one."""
    path, source = tmp_path / "nan.safetensors", known / layout.DIFFUSERS_FILE
    tensors = load_file(str(source))
    nan = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    save_file(nan, str(path), metadata=meta(source))  # its alphas: the stored peft config
    accepted(tmp_path, capsys, f"lora.init_from={path}", "lora.rank=2", "lora.alpha=4")
    err = refused(tmp_path, capsys, f"lora.init_from={path}", "lora.rank=3", "lora.alpha=4")
    assert "rank 2" in err


@pytest.mark.parametrize(
    ("family", "overrides", "shown"),
    [
        ("sdxl", ["lora.target_modules=['nothing']"], "Target modules {'nothing'} not found"),
        ("sdxl", ["lora.target_modules=['norm1']"], "Target module GroupNorm"),
        ("flux", ["lora.target_modules=['to_q', 'norm_out.linear']"], "kohya layout"),
        (
            "sd15",
            ["lora.text_encoder=true", "lora.text_encoder_target_modules=['nothing']"],
            "lora.text_encoder_target_modules = ['nothing']: Target modules",
        ),
        ("sdxl", ["validation.width=36"], "validation.width = 36: sdxl renders sides"),
        ("sana", ["validation.height=48"], "validation.height = 48: sana renders sides"),
    ],
)
def test_check_refuses_what_workers_and_actors_refused(tmp_path, capsys, family, overrides, shown):
    assert shown in refused(tmp_path, capsys, *overrides, family=family)


def test_the_families_own_targets_and_grid_sizes_pass(tmp_path, capsys):
    accepted(tmp_path, capsys, "lora.target_modules=['to_q', 'to_k']", "validation.width=48")


@pytest.mark.slow
def test_a_config_error_in_a_training_worker_is_exit_2_with_its_line(ray_local, tmp_path, capsys):
    """A real Ray Train worker raising ConfigError: Ray wraps it (TrainingFailedError, the
    worker's exception with its traceback as text); the command still says what to change, in
    one line, exit 2."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from raytuner.cli import failed

    message = "lora.init_from = 'x.safetensors': its LoRA on to_q has rank 2"

    def loop():
        raise ConfigError(message)

    trainer = TorchTrainer(
        loop,
        scaling_config=ray.train.ScalingConfig(num_workers=1),
        run_config=ray.train.RunConfig(name="bad", storage_path=str(tmp_path)),
    )
    with pytest.raises(Exception) as caught:
        trainer.fit()
    assert not isinstance(caught.value, ConfigError)  # what Ray raises
    capsys.readouterr()
    assert failed("train", "job.toml", caught.value) == 2
    assert capsys.readouterr().err == f"raytuner: config error: job.toml: {message}\n"


def test_a_config_error_in_a_ray_task_is_exit_2_with_its_line(ray_local, capsys):
    from raytuner.cli import failed

    @ray_local.remote
    def encode():
        raise ConfigError("data.caption_errors = 'strict': a caption is not UTF-8")

    with pytest.raises(Exception) as caught:
        ray_local.get(encode.remote())
    assert failed("preprocess", None, caught.value) == 2  # RayTaskError(ConfigError)
    err = capsys.readouterr().err
    assert err == "raytuner: config error: data.caption_errors = 'strict': a caption is not UTF-8\n"
    assert failed("train", None, RuntimeError("boom")) == 1
