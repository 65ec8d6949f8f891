"""Flux.1 Kontext (flux-kontext): the loss is a step of diffusers' Kontext conditioning (the
reference's packed latent after the image's tokens, its ids' first channel 1, the prediction
of the image's tokens alone), the cached reference latent is the pipeline's own encode of the
reference, and the pipeline renders another image with a reference than without."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from raytuner.config import FlowObjective
from raytuner.families import FAMILIES
from raytuner.families.parts import Source

TINY = Source("tiny")
KONTEXT = FAMILIES["flux-kontext"]


def _text(n: int) -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "prompt_embeds": torch.randn(n, 32, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(n, 32, generator=g),
    }


def test_the_loss_is_a_step_of_diffusers_kontext_conditioning():
    """x_t = (1 - s) x0 + s noise packed, the reference latent packed after it, the
    transformer at timestep s with the image's ids then the reference's (first channel 1) and
    the guidance embedding; its output's first tokens (the image's), unpacked, against
    noise - x0."""
    from diffusers import FluxKontextPipeline

    model = KONTEXT.denoiser(TINY)
    loss = KONTEXT.loss(TINY, FlowObjective(timestep_sampling="uniform", guidance=2.5))
    g = torch.Generator().manual_seed(1)
    x0, ref = torch.randn(2, 16, 4, 6, generator=g), torch.randn(2, 16, 4, 6, generator=g)
    batch = {"latent": x0, **_text(2)}
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(2)])
    refs = {"reference_latent": ref[:, None], "reference_count": torch.ones(2, dtype=torch.long)}
    ours = loss(model, batch | refs | drawn)

    noise, sigmas = drawn["noise"], drawn["sigma"]
    s = sigmas[:, None, None, None]
    noisy = (1.0 - s) * x0 + s * noise
    pack = FluxKontextPipeline._pack_latents
    latent_ids = FluxKontextPipeline._prepare_latent_image_ids(2, 2, 3, "cpu", x0.dtype)
    image_ids = latent_ids.clone()
    image_ids[..., 0] = 1
    with torch.no_grad():
        out = model(
            hidden_states=torch.cat([pack(noisy, 2, 16, 4, 6), pack(ref, 2, 16, 4, 6)], dim=1),
            timestep=sigmas,
            guidance=torch.full((2,), 2.5),
            pooled_projections=batch["pooled_prompt_embeds"],
            encoder_hidden_states=batch["prompt_embeds"],
            txt_ids=torch.zeros(32, 3),
            img_ids=torch.cat([latent_ids, image_ids], dim=0),
            return_dict=False,
        )[0][:, : 2 * 3]
    pred = FluxKontextPipeline._unpack_latents(out, 4 * 8, 6 * 8, 8)
    theirs = ((pred - (noise - x0)) ** 2).reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    # the reference conditions the loss: without it (plain Flux.1's step) another one
    alone = loss(model, batch | drawn)
    assert (alone - ours).abs().max() > 1e-4


def test_a_reference_latent_is_the_pipelines_own_encode_of_it():
    """``image_encoder`` (what the preprocess caches for a reference) equals
    ``FluxKontextPipeline``'s ``_encode_vae_image`` (argmax: the posterior's mean, shifted and
    scaled) of the same pixels."""
    pipe = KONTEXT.pipeline(TINY)
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(3)) * 2 - 1
    ours = KONTEXT.image_encoder(TINY, "cpu")(pixels)[0]
    with torch.no_grad():
        theirs = pipe._encode_vae_image(pixels, generator=None)
    torch.testing.assert_close(ours, theirs)


def test_the_pipeline_renders_another_image_with_a_reference():
    pipe = KONTEXT.pipeline(TINY)
    reference = Image.fromarray(
        np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    )

    def render(**extra) -> np.ndarray:
        out = pipe(
            prompt="make it red", height=32, width=32, num_inference_steps=2,
            generator=torch.Generator().manual_seed(0), output_type="np",
            max_sequence_length=32, max_area=32 * 32, _auto_resize=False, **extra,
        )  # fmt: skip
        return out.images[0]

    assert np.abs(render(image=reference) - render()).max() > 1e-3
