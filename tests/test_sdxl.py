"""The SDXL family: tiny preset, loading through from_pretrained, and a LoRA diffusers can load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from raytuner.config import ObjectiveConfig, load_job
from raytuner.data.preprocess import preprocess
from raytuner.families import FAMILIES
from raytuner.train.trainer import train

SDXL = FAMILIES["sdxl"]


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """The tiny pipeline written with save_pretrained: a local diffusers folder like a real one."""
    folder = tmp_path_factory.mktemp("tiny-sdxl")
    SDXL.pipeline("tiny", "").save_pretrained(folder)
    return str(folder)


def test_tiny_parts_are_identical_in_every_process():
    one, two = SDXL.denoiser("tiny", ""), SDXL.denoiser("tiny", "")
    assert all(
        torch.equal(a, b)
        for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True)
    )


def test_from_pretrained_folder_loads_the_same_model(saved_tiny):
    loaded, tiny = SDXL.denoiser(saved_tiny, ""), SDXL.denoiser("tiny", "")
    for (name, a), b in zip(loaded.state_dict().items(), tiny.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    captions = ["a red circle", ""]
    from_folder = SDXL.text_encoder(saved_tiny, "", "cpu")(captions)
    built = SDXL.text_encoder("tiny", "", "cpu")(captions)
    for name in built:
        torch.testing.assert_close(from_folder[name], built[name])
    pixels = torch.rand(1, 3, 64, 48) * 2 - 1
    torch.testing.assert_close(
        SDXL.image_encoder(saved_tiny, "", "cpu")(pixels),
        SDXL.image_encoder("tiny", "", "cpu")(pixels),
    )


def test_micro_conditioning_reaches_the_unet():
    loss = SDXL.loss("tiny", "", ObjectiveConfig())
    unet = SDXL.denoiser("tiny", "")
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


@pytest.mark.slow
def test_train_from_a_pretrained_folder_and_load_the_lora(
    ray_local, saved_tiny, demo_images, tmp_path
):
    from diffusers import StableDiffusionXLPipeline

    job_file = tmp_path / "folder.toml"
    job_file.write_text(f"""
[model]
family = "sdxl"
pretrained = "{saved_tiny}"
[data]
images = "{demo_images}"
cache = "{tmp_path / "cache"}"
[preprocess]
resolution = 64
bucket_step = 16
[train]
output = "{tmp_path / "runs"}"
max_steps = 6
global_batch_size = 4
learning_rate = 1e-2
log_every = 3
[scaling]
workers = 2
[checkpoint]
every_steps = 3
""")
    job = load_job(job_file)
    report = preprocess(job.model, job.data, job.preprocess)
    assert report["encoded"] == 12
    summary = train(job)
    assert summary["step"] == 6
    assert np.isfinite(summary["loss"])
    lora = load_file(summary["lora"])
    ups = [v for k, v in lora.items() if "lora.up" in k or "lora_B" in k]
    assert ups and all(v.abs().sum() > 0 for v in ups)  # B starts at zero: training moved it

    pipe = StableDiffusionXLPipeline.from_pretrained(saved_tiny)
    before = pipe(
        "a red circle",
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    pipe.load_lora_weights(str(tmp_path / "runs" / "folder" / "lora"))
    after = pipe(
        "a red circle",
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert after.shape == (1, 64, 64, 3) and np.isfinite(after).all()
    assert not np.allclose(before, after)
