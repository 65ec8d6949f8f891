"""The SD1.5 family: tiny preset, loading through from_pretrained, the prediction type taken from
the scheduler config, and a LoRA the diffusers pipeline loads."""

from __future__ import annotations

import pytest
import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline
from run_checks import lora_changes_the_pipeline

from raytuner.config import DdpmObjective, LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.objectives import sd_scheduler_config
from raytuner.families.parts import Source
from raytuner.train.model import adapt

TINY = Source("tiny")

SD15 = FAMILIES["sd15"]
OBJ = DdpmObjective()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """The tiny pipeline written with save_pretrained, once per prediction type."""
    folders = {}
    for kind in ("epsilon", "v_prediction"):
        folder = tmp_path_factory.mktemp(f"tiny-sd15-{kind}")
        pipe = SD15.pipeline(TINY)
        pipe.scheduler = EulerDiscreteScheduler(**sd_scheduler_config(kind))
        pipe.save_pretrained(folder)
        folders[kind] = str(folder)
    return folders


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "latent": torch.randn(2, 4, 8, 8, generator=gen),
        "prompt_embeds": torch.randn(2, 77, 32, generator=gen),
    }


def _generators():
    return [torch.Generator().manual_seed(i) for i in range(2)]


def test_from_pretrained_folder_loads_the_same_model(saved):
    folder = saved["epsilon"]
    loaded, tiny = SD15.denoiser(Source(folder)), SD15.denoiser(TINY)
    for (name, a), b in zip(loaded.state_dict().items(), tiny.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    captions = ["a red circle", ""]
    text = SD15.text_encoder(Source(folder), "cpu")(captions)
    assert list(text) == ["prompt_embeds"] and text["prompt_embeds"].shape == (2, 77, 32)
    torch.testing.assert_close(text, SD15.text_encoder(TINY, "cpu")(captions))
    pixels = torch.rand(1, 3, 64, 48) * 2 - 1
    mean, std = SD15.image_encoder(Source(folder), "cpu")(pixels)
    assert mean.shape == std.shape == (1, 4, 8, 6)
    torch.testing.assert_close((mean, std), SD15.image_encoder(TINY, "cpu")(pixels))


def test_the_scheduler_config_chooses_epsilon_or_v_prediction(saved):
    unet = SD15.denoiser(TINY)
    losses = {
        kind: SD15.loss(Source(folder), OBJ)(unet, _batch(), _generators())
        for kind, folder in saved.items()
    }
    for loss in losses.values():
        assert loss.shape == (2,) and torch.isfinite(loss).all()
    assert torch.equal(losses["epsilon"], SD15.loss(TINY, OBJ)(unet, _batch(), _generators()))
    assert not torch.allclose(losses["epsilon"], losses["v_prediction"])


def test_a_trained_lora_loads_into_the_pipeline(tmp_path):
    unet = SD15.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(unet, mode="lora", lora=lora, targets=SD15.adapters.targets, ema_decay=0)
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss_fn = SD15.loss(TINY, OBJ)
    for _ in range(3):
        loss_fn(unet, _batch(), _generators()).mean().backward()
        opt.step(), opt.zero_grad()
    SD15.save_lora(str(tmp_path / "lora"), weights.state(), unet.peft_config["default"].to_dict())

    assert isinstance(SD15.pipeline(TINY), StableDiffusionPipeline)
    assert lora_changes_the_pipeline(str(tmp_path / "lora"), "sd15")
