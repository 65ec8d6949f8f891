"""The Sana family: tiny preset, loading through from_pretrained, Gemma-2 embeddings with their
attention mask (made by the Sana pipeline's own encode_prompt), DC-AE latents, flow matching."""

from __future__ import annotations

import pytest
import torch

from raytuner.config import FlowObjective
from raytuner.families import FAMILIES
from raytuner.families.parts import Source

TINY = Source("tiny")

SANA = FAMILIES["sana"]


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-sana")
    SANA.pipeline(TINY).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    pixels = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latent, std = SANA.image_encoder(TINY, "cpu")(pixels)
    assert latent.shape == (2, 32, 2, 3) and not std.any()  # 32 channels, 32x down, no noise
    return {"latent": latent, **SANA.text_encoder(TINY, "cpu")(["a red circle", ""])}


def _generators():
    return [torch.Generator().manual_seed(i) for i in range(2)]


def test_from_pretrained_folder_loads_the_same_model(saved_tiny, batch):
    loaded, tiny = SANA.denoiser(Source(saved_tiny)), SANA.denoiser(TINY)
    for (name, a), b in zip(loaded.state_dict().items(), tiny.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    text = SANA.text_encoder(Source(saved_tiny), "cpu")(["a red circle", ""])
    torch.testing.assert_close(text, {k: batch[k] for k in text})
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    torch.testing.assert_close(
        SANA.image_encoder(Source(saved_tiny), "cpu")(pixels),
        SANA.image_encoder(TINY, "cpu")(pixels),
    )


def test_the_caption_mask_hides_padding_from_the_transformer(batch):
    mask = batch["prompt_attention_mask"]
    # "a red circle" keeps its 12 characters plus the boundary tokens; "" keeps only those
    assert mask.shape == (2, 32) and mask[0].sum() > mask[1].sum() > 0
    model, loss = SANA.denoiser(TINY), SANA.loss(TINY, FlowObjective())
    base = loss(model, batch, _generators())
    assert base.shape == (2,) and torch.isfinite(base).all()
    padded = batch["prompt_embeds"].clone()
    padded[mask == 0] += 10.0  # what the mask hides may change freely
    torch.testing.assert_close(loss(model, {**batch, "prompt_embeds": padded}, _generators()), base)
    seen = batch["prompt_embeds"].clone()
    seen[mask == 1] += 10.0
    assert not torch.allclose(loss(model, {**batch, "prompt_embeds": seen}, _generators()), base)
