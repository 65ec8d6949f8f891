"""Flux.1 Kontext: Flux.1 [dev]'s transformer trained to edit: the reference image's latent,
packed as the image's are, is concatenated to the image tokens with position ids whose first
channel is 1 (``FluxKontextPipeline.prepare_latents``), and the prediction of the image's own
tokens is kept. Everything else (VAE, CLIP-L and T5, the guidance embedding, the LoRA layouts)
is Flux.1's."""

from __future__ import annotations

import dataclasses

import torch

from raytuner.families import base, parts
from raytuner.families.flux import Flux


class FluxKontext(Flux):
    name = "flux-kontext"
    # Flux.1's blocks; compiled_on_gpu 1.0 (eager under train.compile = "auto") until
    # `raytuner bench gpu` measured it with the reference's tokens
    blocks = dataclasses.replace(Flux.blocks, compiled_on_gpu=1.0)
    references = base.References(argument="image", most=1, area_argument="max_area")
    parts = base.Parts(
        classes=dict(Flux.parts.classes),
        denoiser="transformer",
        pipeline="diffusers.FluxKontextPipeline",
        single_file=(("transformer", ""),),
    )

    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> base.Batch:
        """Flux.1's, with one reference latent of the target's shape per sample."""
        batch = super().example_batch(shapes, n, size, device, dtype)
        return base.with_one_reference(batch, device, dtype)

    def pipeline_options(self, pipe) -> dict:
        """Flux.1's, and the reference image at the size asked (trained so: a pair's images
        share the target's bucket), not resized to Kontext's preferred resolutions."""
        return super().pipeline_options(pipe) | {"_auto_resize": False}

    def preset_pipeline(self, source: parts.Source):
        from diffusers import FluxKontextPipeline

        flux = super().preset_pipeline(source)
        return FluxKontextPipeline(**flux.components)
