"""The Flux family: tiny preset, loading through from_pretrained, the flow-matching objective
(noise levels, resolution shift, guidance embedding) and a LoRA FluxPipeline loads."""

from __future__ import annotations

import pytest
import torch
from run_checks import lora_changes_the_pipeline

from raytuner.config import FlowObjective, LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.objectives import flow_draw
from raytuner.families.parts import Source
from raytuner.train.model import adapt

TINY = Source("tiny")

FLUX = FAMILIES["flux"]


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-flux")
    FLUX.pipeline(TINY).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mean, _ = FLUX.image_encoder(TINY, "cpu")(pixels)
    return {"latent": mean, **FLUX.text_encoder(TINY, "cpu")(["a red circle", ""])}


def _generators():
    return [torch.Generator().manual_seed(i) for i in range(2)]


def test_from_pretrained_folder_loads_the_same_model(saved_tiny, batch):
    loaded, tiny = FLUX.denoiser(Source(saved_tiny)), FLUX.denoiser(TINY)
    for (name, a), b in zip(loaded.state_dict().items(), tiny.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    text = FLUX.text_encoder(Source(saved_tiny), "cpu")(["a red circle", ""])
    assert text["prompt_embeds"].shape == (2, 32, 32)  # T5 sequence
    assert text["pooled_prompt_embeds"].shape == (2, 32)  # CLIP pooled
    torch.testing.assert_close(text, {k: batch[k] for k in text})
    assert batch["latent"].shape == (2, 16, 8, 6)  # 16 channels, shifted and scaled
    objective = FlowObjective()
    from_folder = FLUX.loss(Source(saved_tiny), objective)(loaded, batch, _generators())
    torch.testing.assert_close(from_folder, FLUX.loss(TINY, objective)(tiny, batch, _generators()))


def test_loss_is_per_sample_reproducible_and_uses_the_guidance_embedding(batch):
    model = FLUX.denoiser(TINY)
    loss = FLUX.loss(TINY, FlowObjective())
    first = loss(model, batch, _generators())
    assert first.shape == (2,) and torch.isfinite(first).all()
    assert torch.equal(first, loss(model, batch, _generators()))
    # sample 1 alone gets the same noise and level as inside the batch
    alone = loss(model, {k: v[1:] for k, v in batch.items()}, _generators()[1:])
    torch.testing.assert_close(alone[0], first[1])
    guided = FLUX.loss(TINY, FlowObjective(guidance=3.5))(model, batch, _generators())
    assert not torch.allclose(first, guided)


def test_noise_levels_follow_the_density_and_shift_up_with_resolution():
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(256)]  # noqa: E731

    def sigmas(objective, tokens):
        return flow_draw(objective, lambda shape: tokens)((256, 4, 2, 2), gens())["sigma"]

    small, large = sigmas(FlowObjective(), 256), sigmas(FlowObjective(), 4096)
    assert ((small > 0) & (small < 1)).all()
    assert (large > small).all()  # same draws, shifted towards noise for a larger image
    fixed = FlowObjective(resolution_shift=False, shift=1.0, timestep_sampling="uniform")
    uniform = sigmas(fixed, 4096)
    assert abs(uniform.mean().item() - 0.5) < 0.06  # no shift: uniform draws stay uniform


def test_a_trained_lora_loads_into_the_flux_pipeline(batch, tmp_path):
    model = FLUX.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(model, mode="lora", lora=lora, targets=FLUX.adapters.targets, ema_decay=0)
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss = FLUX.loss(TINY, FlowObjective())
    for _ in range(3):
        loss(model, batch, _generators()).mean().backward()
        opt.step(), opt.zero_grad()
    FLUX.save_lora(str(tmp_path / "lora"), weights.state(), model.peft_config["default"].to_dict())

    assert lora_changes_the_pipeline(str(tmp_path / "lora"), "flux")
