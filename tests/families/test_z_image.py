"""The Z-Image family: its cache holds what ZImagePipeline's own encoders make (Qwen3's
second-to-last hidden states of the chat-templated caption's tokens alone, latents with the
VAE's shift and scale), its loss is a step of diffusers' train_dreambooth_lora_z_image.py (time
1 - sigma, the output negated), its LoRA loads through the pipeline, and `raytuner plan` builds
the released 6.15 B transformer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from run_checks import (
    assert_other_trainers_layouts_start_the_lora,
    cached_folder,
    lora_changes_the_pipeline,
)
from sharded_lora import assert_sharded_lora_matches

from raytuner.config import FlowObjective, LoraConfig
from raytuner.data.tensors import ragged_cell_column, stacked
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train.model import adapt

TINY = Source("tiny")
ZI = FAMILIES["z-image"]
CAPTIONS = ["a red circle", "a much longer caption: a blue square on a grey ground", ""]


@pytest.fixture(scope="module")
def pipe():
    return ZI.pipeline(TINY)


@pytest.fixture(scope="module")
def batch(pipe) -> dict[str, torch.Tensor]:
    pixels = torch.rand(3, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latent, std = ZI.image_encoder(TINY, "cpu")(pixels)
    assert latent.shape == std.shape == (3, 16, 8, 12)  # 16 channels at 1/8
    return {"latent": latent, "pixels": pixels, **ZI.text_encoder(TINY, "cpu")(CAPTIONS)}


def _direct_text(pipe) -> list[torch.Tensor]:
    """The pipeline's own encode_prompt: one [tokens, width] tensor a caption."""
    embeds, _ = pipe.encode_prompt(
        list(CAPTIONS), device=torch.device("cpu"), do_classifier_free_guidance=False,
        max_sequence_length=ZI.pipeline_options(pipe)["max_sequence_length"],
    )  # fmt: skip
    return embeds


def test_cached_text_is_the_pipelines_encode_prompt_and_stores_its_tokens_alone(pipe, batch):
    direct = _direct_text(pipe)
    lengths = [len(d) for d in direct]
    # the chat template's tokens are kept; a longer caption has more rows
    assert lengths[1] > lengths[0] > lengths[2] > 0
    text = batch["prompt_embeds"]
    assert text.shape == (3, max(lengths), 16)
    for rows, own, n in zip(text, direct, lengths, strict=True):
        torch.testing.assert_close(rows[:n], own, rtol=0, atol=0)
        assert not rows[n:].any()  # the batch's padding: zero rows
    # the cache stores each caption's rows alone (2 bytes a value in bfloat16: 2 x width a
    # token) and the feed pads them back to the batch's longest with zero rows
    cells, shapes, _ = ragged_cell_column(text, "bfloat16")
    assert shapes == [[n, 16] for n in lengths]
    assert [len(c.as_py()) for c in cells] == [n * 16 * 2 for n in lengths]
    read = [
        torch.frombuffer(bytearray(c.as_py()), dtype=torch.bfloat16).view(*s)
        for c, s in zip(cells, shapes, strict=True)
    ]
    torch.testing.assert_close(stacked(read, torch.float32), text.bfloat16().float())


def test_cached_latent_is_what_the_pipeline_decodes(pipe, batch):
    """The pipeline decodes latent / scaling_factor + shift_factor: the cache holds the VAE's
    mean put through the inverse, as the diffusers training script normalises it."""
    mean = pipe.vae.encode(batch["pixels"]).latent_dist.mean
    config = pipe.vae.config
    torch.testing.assert_close(batch["latent"] / config.scaling_factor + config.shift_factor, mean)
    assert config.scaling_factor == 0.3611 and config.shift_factor == 0.1159


def test_the_loss_is_a_step_of_diffusers_z_image_script(pipe, batch):
    """Same noise and noise levels: x_t = (1 - s) x0 + s noise, the transformer called on lists
    at time (1000 - 1000 s) / 1000, its output negated, against noise - x0."""
    model = ZI.denoiser(TINY)
    objective = FlowObjective(resolution_shift=False, shift=3.0, timestep_sampling="uniform")
    loss = ZI.loss(TINY, objective)
    x0 = batch["latent"]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    drawn = loss.draw(tuple(x0.shape), gens)
    ours = loss(model, {"latent": x0, "prompt_embeds": batch["prompt_embeds"], **drawn})

    noise, sigmas = drawn["noise"], drawn["sigma"]
    s = sigmas[:, None, None, None]
    noisy = (1.0 - s) * x0 + s * noise
    timesteps = sigmas * 1000
    with torch.no_grad():
        out = model(
            list(noisy.unsqueeze(2).unbind(dim=0)),
            (1000 - timesteps) / 1000,
            _direct_text(pipe),
            return_dict=False,
        )[0]
    pred = -torch.stack(out, dim=0).squeeze(2)
    target = noise - x0
    theirs = ((pred.float() - target.float()) ** 2).reshape(3, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    # the sign matters: the unnegated output is far off
    assert not torch.allclose(((-pred - target) ** 2).reshape(3, -1).mean(1), theirs)
    # the shift: 3 u / (1 + 2 u) of uniform draws, each in (0, 1)
    assert ((sigmas > 0) & (sigmas < 1)).all()


def test_a_trained_lora_loads_into_the_z_image_pipeline(batch, tmp_path):
    model = ZI.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(model, mode="lora", lora=lora, targets=ZI.adapters.targets, ema_decay=0)
    # diffusers' targets: every attention projection of the layers and both refiners
    names = [n for n in weights.names if "lora_B" in n]
    assert {n.split(".")[0] for n in names} == {"layers", "noise_refiner", "context_refiner"}
    assert len(names) == 4 * (2 + 1 + 1)
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss = ZI.loss(TINY, FlowObjective())
    train = {k: v for k, v in batch.items() if k != "pixels"}
    for _ in range(3):
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        loss(model, train, gens).mean().backward()
        opt.step(), opt.zero_grad()
    ZI.save_lora(str(tmp_path / "lora"), weights.state(), model.peft_config["default"].to_dict())

    assert lora_changes_the_pipeline(str(tmp_path / "lora"), "z-image")


def test_the_tiny_pipeline_renders(pipe):
    image = pipe(
        "a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
        generator=torch.Generator().manual_seed(0), **ZI.pipeline_options(pipe),
    ).images  # fmt: skip
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


@pytest.mark.slow
def test_the_cache_holds_each_captions_own_rows_of_encode_prompt(ray_local, tmp_path):
    """Preprocessed by Ray Data from a diffusers folder: a row read alone is its caption's
    encode_prompt, of its own length; rows read together are padded with zero rows."""
    with cached_folder("z-image", tmp_path) as (data, captions, _):
        pipe = ZI.pipeline(TINY)
        direct, _ = pipe.encode_prompt(
            list(captions), device=torch.device("cpu"), do_classifier_free_guidance=False,
            max_sequence_length=ZI.pipeline_options(pipe)["max_sequence_length"],
        )  # fmt: skip
        lengths = [len(d) for d in direct]
        assert len(set(lengths)) > 1  # captions of several lengths
        for i, own in enumerate(direct):
            alone = data.batch([i])["prompt_embeds"][0]
            assert alone.shape == own.shape  # its tokens alone, no padding stored
            torch.testing.assert_close(alone, own.bfloat16().float(), rtol=0, atol=0)
        together = data.batch(list(range(len(data))))["prompt_embeds"]
        assert together.shape == (len(data), max(lengths), 16)
        for rows, own in zip(together, direct, strict=True):
            torch.testing.assert_close(rows[: len(own)], own.bfloat16().float())
            assert not rows[len(own) :].any()


@pytest.mark.slow
def test_a_sharded_lora_trains_what_one_process_trains(tmp_path):
    """Captions of several lengths on each rank (each batch padded to its own longest): two
    sharded gloo workers end where one process on the whole batch does."""
    assert_sharded_lora_matches("z-image", tmp_path)


def test_init_from_reads_the_layouts_other_z_image_trainers_write(pipe, tmp_path):
    """The diffusers names under ComfyUI's ``diffusion_model.`` with ``.alpha`` keys, and in
    kohya's ``lora_unet_`` keys: each starts the run from the same LoRA, and diffusers'
    ZImagePipeline loads each as the same LoRA as raytuner's own file."""
    assert_other_trainers_layouts_start_the_lora("z-image", pipe, tmp_path)


