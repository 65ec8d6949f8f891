"""Wan 2.2: the T2V A14B (a mixture of two Wan 2.1 T2V 14B transformers by noise level) and the
TI2V-5B (one 5.00 B transformer on the 48-channel Wan 2.2 VAE), both with Wan 2.1's text
encoder, caption rows, loss and LoRA names (``families/wan.py``).

A14B: ``transformer`` denoises the high noise levels (the pipeline hands it the steps whose
timestep, sigma x 1000, is at least ``boundary_ratio`` x 1000: 875 for T2V), ``transformer_2``
the low ones. A run trains one of them (``model.expert = "high" | "low"``), every sample's
noise level drawn in its range (the objective's density cut to it). Each expert's LoRA is a file
of its own, in both layouts under the same names as a Wan 2.1 LoRA (diffusers'
``transformer.blocks.N...``, Wan's ``diffusion_model.blocks.N...``): diffusers' WanPipeline loads
the low-noise one with ``load_lora_weights(..., load_into_transformer_2=True)``, ComfyUI loads
each file on the model of its expert; the run's name ends in the expert (``<job>-high``,
``<job>-low``) and its files carry ``raytuner.expert``.

TI2V-5B: its VAE encodes at 1/16 (a 2x2 pixel unshuffle inside, 48 channels, its own per-channel
latents_mean / latents_std) and the transformer still patches 2x2, so sides are multiples of 32;
its pipeline (``expand_timesteps``) hands the transformer one timestep per token, all the
step's timestep for text-to-video: the one timestep a sample the loss passes."""

from __future__ import annotations

from dataclasses import replace

from raytuner.families import base, wan
from raytuner.families.parts import Source, class_of

BOUNDARY_RATIO = 0.875  # WanPipeline's boundary_ratio of the T2V A14B (I2V: 0.9)
VAE22_FACTOR = 16  # the Wan 2.2 VAE's spatial factor (its 2x2 pixel patches included)
VAE22_CHANNELS = 48


def _scheduler(flow_shift: float):
    """The UniPC scheduler of the diffusers repos (convert_wan_to_diffusers.py: flow_shift 3.0
    for T2V, 5.0 for TI2V)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift
    )


class Wan22(wan.Wan):
    """Wan 2.2 T2V A14B: two experts by noise level, one trained a run (``model.expert``)."""

    name = "wan22"
    experts = (
        base.Expert(
            name="high",
            part="transformer",
            low=BOUNDARY_RATIO,
            high=1.0,
            about=f"'transformer', noise levels {BOUNDARY_RATIO} to 1 (layout and motion)",
        ),
        base.Expert(
            name="low",
            part="transformer_2",
            low=0.0,
            high=BOUNDARY_RATIO,
            lora_load={"load_into_transformer_2": True},
            about=f"'transformer_2', noise levels below {BOUNDARY_RATIO} (detail)",
        ),
    )
    adapters = replace(
        wan.Wan.adapters, files=replace(wan.Wan.adapters.files, base_model_version="wan2.2")
    )
    parts = replace(
        wan.Wan.parts,
        classes=wan.Wan.parts.classes | {"transformer_2": "diffusers.WanTransformer3DModel"},
    )

    @property
    def lora_part(self) -> str:
        """Either expert's LoRA under ``transformer.``: WanPipeline saves no other part's, and
        loads the low-noise one into ``transformer_2`` by ``load_into_transformer_2``."""
        return "transformer"

    def save_lora(
        self, directory: str, lora_state: dict, adapter_config: dict, text_encoders=None
    ) -> None:
        pipeline = class_of(self.parts.pipeline)
        base.save_lora(pipeline, self.lora_part, directory, lora_state, adapter_config)

    def preset_pipeline(self, source: Source):
        from diffusers import WanPipeline

        return WanPipeline(
            **self.preset_parts(source),
            tokenizer=wan._tokenizer(source),
            scheduler=_scheduler(3.0),
            boundary_ratio=BOUNDARY_RATIO,
        )


class Wan22TI2V(wan.Wan):
    """Wan 2.2 TI2V-5B, text to video, and image to video where a clip's first frame is kept
    clean (``objective.flow.first_frame_p``: its image-to-video pipeline's ``expand_timesteps``
    conditioning, a level a patch, 0 on the first frame's)."""

    name = "wan22-5b"
    # the VAE's 16 x the transformer's 2x2 patches (WanPipeline rounds sides to 32); 704x1280
    # is its native size
    geometry = replace(
        wan.Wan.geometry,
        default_resolution=960,
        pixel_multiple=32,
        pixel_grid=32,
        first_frame_clean=True,
    )
    adapters = replace(
        wan.Wan.adapters, files=replace(wan.Wan.adapters.files, base_model_version="wan2.2")
    )

    def cache_shapes(self, width: int, height: int, frames: int = 1) -> dict[str, tuple[int, ...]]:
        """Wan's, with 48-channel latents at 1/16: [48, T, h/16, w/16] (121 frames at 1280x704:
        48x31x44x80)."""
        shapes = super().cache_shapes(width, height, frames)
        _, t, _, _ = shapes["latent"]
        side = (height // VAE22_FACTOR, width // VAE22_FACTOR)
        return shapes | {"latent": (VAE22_CHANNELS, t, *side)}

    def preset_pipeline(self, source: Source):
        from diffusers import WanPipeline

        return WanPipeline(
            **self.preset_parts(source),
            tokenizer=wan._tokenizer(source),
            scheduler=_scheduler(5.0),
            expand_timesteps=True,
        )
