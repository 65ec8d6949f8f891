"""FLUX.2's reference images (edit training on pairs): the loss is a step of
``Flux2Pipeline``'s conditioning (each reference packed after the image's tokens, ids of time
coordinate 10, 20, ... from ``_prepare_image_ids``, the prediction of the image's tokens
alone), and the pipeline renders another image with a reference than without."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from test_flux2 import _direct_text

from raytuner.config import FlowObjective
from raytuner.families import FAMILIES
from raytuner.families.parts import Source

TINY = Source("tiny")


@pytest.fixture(scope="module")
def klein():
    family = FAMILIES["flux2-klein"]
    return family, family.pipeline(TINY)


def test_the_loss_with_references_is_a_step_of_the_pipelines_conditioning(klein):
    from diffusers import Flux2Pipeline

    family, pipe = klein
    model = family.denoiser(TINY)
    loss = family.loss(TINY, FlowObjective(timestep_sampling="uniform"))
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 16, 4, 6, generator=g)
    refs = torch.randn(3, 2, 16, 4, 6, generator=g)  # two references a sample
    text = _direct_text(family, pipe)
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(3)])
    batch = {"latent": x0, "prompt_embeds": text, **drawn}
    ours = loss(model, batch | {"reference_latent": refs})

    noise, sigmas = drawn["noise"], drawn["sigma"]
    s = sigmas[:, None, None, None]
    noisy = (1.0 - s) * x0 + s * noise
    img_ids = Flux2Pipeline._prepare_latent_ids(noisy)
    ref_ids = Flux2Pipeline._prepare_image_ids([refs[:1, 0], refs[:1, 1]])
    packed = [Flux2Pipeline._pack_latents(x) for x in (noisy, refs[:, 0], refs[:, 1])]
    with torch.no_grad():
        out = model(
            hidden_states=torch.cat(packed, dim=1),
            timestep=sigmas,
            guidance=None,
            encoder_hidden_states=text,
            txt_ids=Flux2Pipeline._prepare_text_ids(text),
            img_ids=torch.cat([img_ids, ref_ids.expand(3, -1, -1)], dim=1),
            return_dict=False,
        )[0][:, : 4 * 6]
    pred = Flux2Pipeline._unpack_latents_with_ids(out, img_ids)
    theirs = ((pred - (noise - x0)) ** 2).reshape(3, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    assert (loss(model, batch) - ours).abs().max() > 1e-4  # the references condition it


def test_the_pipeline_renders_another_image_with_a_reference(klein):
    _, pipe = klein
    reference = Image.fromarray(
        np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    )

    def render(**extra) -> np.ndarray:
        out = pipe(
            prompt="make it red", height=64, width=64, num_inference_steps=2,
            generator=torch.Generator().manual_seed(0), output_type="np",
            max_sequence_length=32, **extra,
        )  # fmt: skip
        return out.images[0]

    assert np.abs(render(image=[reference]) - render()).max() > 1e-3
