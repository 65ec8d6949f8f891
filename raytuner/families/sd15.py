"""Stable Diffusion 1.5 class: UNet with one CLIP text encoder (last hidden state); epsilon or
v-prediction, as the scheduler config says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytuner.families import base

TINY = "tiny"


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    with base.seeded(11):
        return UNet2DConditionModel(
            sample_size=8,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            cross_attention_dim=32,
            norm_num_groups=8,
        )


def _tiny_text():
    from transformers import CLIPTextModel

    tokenizer = base.tiny_clip_tokenizer()
    with base.seeded(13):
        return tokenizer, CLIPTextModel(base.tiny_clip_config(tokenizer))


class _ClipText(base.FrozenTextEncoders):
    """The last hidden state of one CLIP text encoder."""

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        (tokenizer,), (encoder,) = self.tokenizers, self.encoders
        ids = base.tokenize(tokenizer, captions, self.device)
        return {"prompt_embeds": encoder(ids).last_hidden_state}


@dataclass(frozen=True)
class SD15:
    name: str = "sd15"
    default_resolution: int = 512
    pixel_multiple: int = 64
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    denoiser_part: str = "unet"

    def cache_shapes(self, width: int, height: int) -> dict[str, tuple[int, ...]]:
        """What the released model's encoders store per image of a bucket: 4-channel latents
        at 1/8 of the pixels, CLIP-L's 77 x 768 hidden states."""
        return {"latent": (4, height // 8, width // 8), "prompt_embeds": (77, 768)}

    def image_encoder(self, pretrained: str, revision: str, device: str):
        from diffusers import AutoencoderKL

        if pretrained == TINY:
            return base.kl_image_encoder(base.tiny_kl_vae(seed=12), device)
        vae = AutoencoderKL.from_pretrained(pretrained, **base.hub_kwargs(revision, "vae"))
        return base.kl_image_encoder(vae, device)

    def text_encoder(self, pretrained: str, revision: str, device: str):
        from transformers import CLIPTextModel, CLIPTokenizer

        if pretrained == TINY:
            tokenizer, encoder = _tiny_text()
            return _ClipText([tokenizer], [encoder], device)
        tokenizer = CLIPTokenizer.from_pretrained(
            pretrained, **base.hub_kwargs(revision, "tokenizer")
        )
        encoder = CLIPTextModel.from_pretrained(
            pretrained, **base.hub_kwargs(revision, "text_encoder")
        )
        return _ClipText([tokenizer], [encoder], device)

    def denoiser(self, pretrained: str, revision: str) -> nn.Module:
        from diffusers import UNet2DConditionModel

        if pretrained == TINY:
            return _tiny_unet()
        return UNet2DConditionModel.from_pretrained(pretrained, **base.hub_kwargs(revision, "unet"))

    def loss(self, pretrained: str, revision: str, objective):
        tiny = base.sd_scheduler_config() if pretrained == TINY else None
        scheduler = base.ddpm_scheduler(pretrained, revision, tiny)

        def sd15_loss(denoiser, batch, generators: Sequence[torch.Generator]) -> torch.Tensor:
            def predict(noisy, steps):
                return denoiser(noisy, steps, encoder_hidden_states=batch["prompt_embeds"]).sample

            return base.ddpm_loss(scheduler, objective, batch["latent"], generators, predict)

        return sd15_loss

    def save_lora(self, directory: str, lora_state: dict, adapter_config: dict) -> None:
        from diffusers import StableDiffusionPipeline

        base.save_lora(
            StableDiffusionPipeline, self.denoiser_part, directory, lora_state, adapter_config
        )

    def pipeline_options(self, pipe) -> dict:
        """None: the pipeline tokenizes captions as the cache did (77 CLIP tokens)."""
        return {}

    def pipeline(self, pretrained: str, revision: str):
        from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

        if pretrained != TINY:
            return StableDiffusionPipeline.from_pretrained(
                pretrained, safety_checker=None, **base.hub_kwargs(revision)
            )
        tokenizer, encoder = _tiny_text()
        return base.tiny_pipeline(
            StableDiffusionPipeline(
                vae=base.tiny_kl_vae(seed=12),
                text_encoder=encoder,
                tokenizer=tokenizer,
                unet=_tiny_unet(),
                scheduler=EulerDiscreteScheduler(**base.sd_scheduler_config()),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        )
