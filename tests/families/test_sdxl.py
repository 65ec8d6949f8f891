"""The SDXL family: tiny preset, loading through from_pretrained, and a LoRA diffusers can load."""

from __future__ import annotations

import pytest
import torch

from raytuner.config import DdpmObjective
from raytuner.families import FAMILIES
from raytuner.families.parts import Source

TINY = Source("tiny")

SDXL = FAMILIES["sdxl"]


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """The tiny pipeline written with save_pretrained: a local diffusers folder like a real one."""
    folder = tmp_path_factory.mktemp("tiny-sdxl")
    SDXL.pipeline(TINY).save_pretrained(folder)
    return str(folder)


def test_tiny_parts_are_identical_in_every_process():
    one, two = SDXL.denoiser(TINY), SDXL.denoiser(TINY)
    assert all(
        torch.equal(a, b)
        for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True)
    )


def test_from_pretrained_folder_loads_the_same_model(saved_tiny):
    loaded, tiny = SDXL.denoiser(Source(saved_tiny)), SDXL.denoiser(TINY)
    for (name, a), b in zip(loaded.state_dict().items(), tiny.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    captions = ["a red circle", ""]
    from_folder = SDXL.text_encoder(Source(saved_tiny), "cpu")(captions)
    built = SDXL.text_encoder(TINY, "cpu")(captions)
    for name in built:
        torch.testing.assert_close(from_folder[name], built[name])
    pixels = torch.rand(1, 3, 64, 48) * 2 - 1
    torch.testing.assert_close(
        SDXL.image_encoder(Source(saved_tiny), "cpu")(pixels),
        SDXL.image_encoder(TINY, "cpu")(pixels),
    )


def test_micro_conditioning_reaches_the_unet():
    loss = SDXL.loss(TINY, DdpmObjective())
    unet = SDXL.denoiser(TINY)
    batch = {
        "latent": torch.randn(2, 4, 8, 8),
        "prompt_embeds": torch.randn(2, 32, 64),
        "pooled_prompt_embeds": torch.randn(2, 32),
        "original_size": torch.tensor([[64, 64], [64, 64]]),
        "crop_top_left": torch.tensor([[0, 0], [0, 0]]),
        "target_size": torch.tensor([[64, 64], [64, 64]]),
    }
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(2)]  # noqa: E731
    same = loss(unet, batch, gens())
    assert torch.equal(same, loss(unet, batch, gens()))  # per-sample generators: reproducible
    cropped = loss(unet, {**batch, "crop_top_left": torch.tensor([[0, 0], [32, 16]])}, gens())
    assert same[0] == cropped[0] and same[1] != cropped[1]
