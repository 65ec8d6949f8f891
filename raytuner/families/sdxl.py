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


def _tiny_text():
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = base.tiny_clip_tokenizer()
    config = base.tiny_clip_config(tokenizer)
    with base.seeded(3):
        one = CLIPTextModel(config)
    with base.seeded(4):
        two = CLIPTextModelWithProjection(config)
    return tokenizer, tokenizer, one, two


class _SdxlText(base.FrozenTextEncoders):
    """Penultimate hidden states of both encoders, concatenated, plus encoder 2's pooled output."""

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        (tok1, tok2), (one, two) = self.tokenizers, self.encoders
        out1 = one(base.tokenize(tok1, captions, self.device), output_hidden_states=True)
        out2 = two(base.tokenize(tok2, captions, self.device), output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        return {"prompt_embeds": hidden, "pooled_prompt_embeds": out2.text_embeds}


@dataclass(frozen=True)
class SDXL:
    name: str = "sdxl"
    default_resolution: int = 1024
    pixel_multiple: int = 64
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    denoiser_part: str = "unet"

    def cache_shapes(self, width: int, height: int) -> dict[str, tuple[int, ...]]:
        """What the released model's encoders store per image of a bucket: 4-channel latents
        at 1/8 of the pixels, CLIP-L + OpenCLIP-bigG hidden states (77 x 2048), bigG's pooled
        projection (1280)."""
        latent = (4, height // 8, width // 8)
        return {"latent": latent, "prompt_embeds": (77, 2048), "pooled_prompt_embeds": (1280,)}

    def image_encoder(self, pretrained: str, revision: str, device: str):
        from diffusers import AutoencoderKL

        if pretrained == TINY:
            return base.kl_image_encoder(base.tiny_kl_vae(), device)
        vae = AutoencoderKL.from_pretrained(pretrained, **base.hub_kwargs(revision, "vae"))
        return base.kl_image_encoder(vae, device)

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

    def loss(self, pretrained: str, revision: str, objective):
        tiny = base.sd_scheduler_config() if pretrained == TINY else None
        scheduler = base.ddpm_scheduler(pretrained, revision, tiny)

        def sdxl_loss(denoiser, batch, generators: Sequence[torch.Generator]) -> torch.Tensor:
            time_ids = torch.cat(
                [batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1
            ).to(batch["latent"].dtype)
            cond = {"text_embeds": batch["pooled_prompt_embeds"], "time_ids": time_ids}

            def predict(noisy, steps):
                hidden = batch["prompt_embeds"]
                return denoiser(
                    noisy, steps, encoder_hidden_states=hidden, added_cond_kwargs=cond
                ).sample

            return base.ddpm_loss(scheduler, objective, batch["latent"], generators, predict)

        return sdxl_loss

    def save_lora(self, directory: str, lora_state: dict, adapter_config: dict) -> None:
        from diffusers import StableDiffusionXLPipeline

        base.save_lora(
            StableDiffusionXLPipeline, self.denoiser_part, directory, lora_state, adapter_config
        )

    def pipeline_options(self, pipe) -> dict:
        """None: the pipeline tokenizes captions as the cache did (77 CLIP tokens)."""
        return {}

    def pipeline(self, pretrained: str, revision: str):
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        if pretrained != TINY:
            return StableDiffusionXLPipeline.from_pretrained(
                pretrained, **base.hub_kwargs(revision)
            )
        tok1, tok2, one, two = _tiny_text()
        return base.tiny_pipeline(
            StableDiffusionXLPipeline(
                vae=base.tiny_kl_vae(),
                text_encoder=one,
                text_encoder_2=two,
                tokenizer=tok1,
                tokenizer_2=tok2,
                unet=_tiny_unet(),
                scheduler=EulerDiscreteScheduler(**base.sd_scheduler_config()),
            )
        )
