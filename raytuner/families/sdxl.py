"""SDXL: UNet with two CLIP text encoders and size/crop micro-conditioning."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytuner.families import base

TINY = "tiny"


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    with base.seeded(1):
        return UNet2DConditionModel(
            sample_size=8,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 1),
            projection_class_embeddings_input_dim=6 * 8 + 32,
            cross_attention_dim=64,
            norm_num_groups=8,
        )


def _tiny_vae():
    from diffusers import AutoencoderKL

    with base.seeded(2):
        return AutoencoderKL(
            block_out_channels=(8, 16, 16, 16),
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            sample_size=64,
        )


def _tiny_text():
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = base.tiny_clip_tokenizer()
    config = base.tiny_clip_config(tokenizer)
    with base.seeded(3):
        one = CLIPTextModel(config)
    with base.seeded(4):
        two = CLIPTextModelWithProjection(config)
    return tokenizer, tokenizer, one, two


def _scheduler_config() -> dict:
    return dict(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        prediction_type="epsilon",
        steps_offset=1,
        timestep_spacing="leading",
    )


class _SdxlText:
    """Penultimate hidden states of both encoders, concatenated, plus encoder 2's pooled output."""

    def __init__(self, tokenizers, encoders, device: str):
        self.tokenizers = tokenizers
        self.encoders = [e.to(device).eval().requires_grad_(False) for e in encoders]
        self.device = device

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        (tok1, tok2), (one, two) = self.tokenizers, self.encoders
        out1 = one(base.tokenize(tok1, captions, self.device), output_hidden_states=True)
        out2 = two(base.tokenize(tok2, captions, self.device), output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        return {"prompt_embeds": hidden, "pooled_prompt_embeds": out2.text_embeds}

    def truncated(self, captions: list[str]) -> list[bool]:
        return base.truncated(self.tokenizers, captions)


@dataclass(frozen=True)
class SDXL:
    name: str = "sdxl"
    default_resolution: int = 1024
    pixel_multiple: int = 64
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")

    def image_encoder(self, pretrained: str, revision: str, device: str):
        from diffusers import AutoencoderKL

        if pretrained == TINY:
            vae = _tiny_vae()
        else:
            vae = AutoencoderKL.from_pretrained(pretrained, **base.hub_kwargs(revision, "vae"))
        vae = vae.to(device).eval().requires_grad_(False)
        scale = vae.config.scaling_factor

        @torch.no_grad()
        def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            dist = vae.encode(pixels.to(device, vae.dtype)).latent_dist
            return dist.mean * scale, dist.std * scale

        return encode

    def text_encoder(self, pretrained: str, revision: str, device: str):
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        if pretrained == TINY:
            tok1, tok2, one, two = _tiny_text()
        else:
            tok1 = CLIPTokenizer.from_pretrained(
                pretrained, **base.hub_kwargs(revision, "tokenizer")
            )
            tok2 = CLIPTokenizer.from_pretrained(
                pretrained, **base.hub_kwargs(revision, "tokenizer_2")
            )
            one = CLIPTextModel.from_pretrained(
                pretrained, **base.hub_kwargs(revision, "text_encoder")
            )
            two = CLIPTextModelWithProjection.from_pretrained(
                pretrained, **base.hub_kwargs(revision, "text_encoder_2")
            )
        return _SdxlText([tok1, tok2], [one, two], device)

    def denoiser(self, pretrained: str, revision: str) -> nn.Module:
        from diffusers import UNet2DConditionModel

        if pretrained == TINY:
            return _tiny_unet()
        return UNet2DConditionModel.from_pretrained(pretrained, **base.hub_kwargs(revision, "unet"))

    def _scheduler(self, pretrained: str, revision: str):
        from diffusers import DDPMScheduler

        if pretrained == TINY:
            return DDPMScheduler(**_scheduler_config())
        return DDPMScheduler.from_pretrained(pretrained, **base.hub_kwargs(revision, "scheduler"))

    def loss(self, pretrained: str, revision: str):
        scheduler = self._scheduler(pretrained, revision)

        def sdxl_loss(denoiser, batch, generators: Sequence[torch.Generator]) -> torch.Tensor:
            latents = batch["latent"]
            noise = base.per_sample_noise(latents, generators)
            steps = base.per_sample_timesteps(
                scheduler.config.num_train_timesteps, generators, latents.device
            )
            noisy = scheduler.add_noise(latents, noise, steps)
            time_ids = torch.cat(
                [batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1
            ).to(latents.dtype)
            cond = {"text_embeds": batch["pooled_prompt_embeds"], "time_ids": time_ids}
            prediction = denoiser(
                noisy, steps, encoder_hidden_states=batch["prompt_embeds"], added_cond_kwargs=cond
            ).sample
            return base.mse_per_sample(
                prediction, base.ddpm_target(scheduler, latents, noise, steps)
            )

        return sdxl_loss

    def save_lora(self, directory: str, lora_state: dict[str, torch.Tensor]) -> None:
        from diffusers import StableDiffusionXLPipeline
        from diffusers.utils import convert_state_dict_to_diffusers

        StableDiffusionXLPipeline.save_lora_weights(
            directory, unet_lora_layers=convert_state_dict_to_diffusers(lora_state)
        )

    def pipeline(self, pretrained: str, revision: str):
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        if pretrained != TINY:
            return StableDiffusionXLPipeline.from_pretrained(
                pretrained, **base.hub_kwargs(revision)
            )
        tok1, tok2, one, two = _tiny_text()
        return StableDiffusionXLPipeline(
            vae=_tiny_vae(),
            text_encoder=one,
            text_encoder_2=two,
            tokenizer=tok1,
            tokenizer_2=tok2,
            unet=_tiny_unet(),
            scheduler=EulerDiscreteScheduler(**_scheduler_config()),
        )
