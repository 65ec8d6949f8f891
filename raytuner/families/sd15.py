"""Stable Diffusion 1.5 class: UNet with one CLIP text encoder (last hidden state); epsilon or
v-prediction, as the scheduler config says."""

from __future__ import annotations

import torch

from raytuner.families import base, objectives, parts, text
from raytuner.lora import kohya


def _tokenizer(source: parts.Source):
    if source.preset:
        return text.tiny_clip_tokenizer(parts.tokenizer_length("sd15", source, "tokenizer", 77))
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))


class _ClipText(text.FrozenTextEncoders):
    """The last hidden state of one CLIP text encoder."""

    outputs = ("prompt_embeds",)

    def embed(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        (encoder,) = self.encoders
        return {"prompt_embeds": encoder(tokens["input_ids"]).last_hidden_state}


def _kohya_names(config) -> kohya.Names:
    """sd-scripts' SD1.5 UNet uses the diffusers module names."""
    return kohya.unet_names


class SD15(base.DiffusersFamily):
    name = "sd15"
    objective_kind = "ddpm"
    # the VAE's 8x; the UNet fits its skips to any latent size
    geometry = base.Geometry(default_resolution=512, pixel_multiple=64, pixel_grid=8)
    blocks = base.Blocks(
        shard=("down_blocks", "mid_block", "up_blocks"),
        shard_inner=("ResnetBlock2D", "BasicTransformerBlock"),
        compile=("BasicTransformerBlock",),
        compiled_on_gpu=0.98,  # H100 2026-11-26: 58.2 vs 59.6 samples/s
        channels_last=True,
    )
    adapters = base.Adapters(
        files=base.LoraFiles(
            "unet", "sd_v1", "networks.lora", "stable-diffusion-v1", "diffusers",
            lycoris="lycoris_{flat}",  # ComfyUI: its unet_to_diffusers names
        ),
        kohya_names=_kohya_names,
        # sd-scripts' lora_te_text_model_encoder_layers_<i>_self_attn_q_proj, ...
        text_encoders=(text.TextEncoderLora("text_encoder", "lora_te"),),
        text_encoder_targets=text.CLIP_LORA_TARGETS,
    )
    # StableDiffusionPipeline's default; classifier-free guidance with a negative prompt
    guidance = base.Guidance(default_scale=7.5)
    parts = base.Parts(
        classes={
            "unet": "diffusers.UNet2DConditionModel",
            "vae": "diffusers.AutoencoderKL",
            "text_encoder": "transformers.CLIPTextModel",
        },
        denoiser="unet",
        pipeline="diffusers.StableDiffusionPipeline",
        # the original LDM layout of SD1.5 checkpoints (model sites' .safetensors)
        single_file=(
            ("unet", "model.diffusion_model."),
            ("vae", "first_stage_model."),
            ("text_encoder", "cond_stage_model."),
        ),
        unused=("safety_checker",),
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """What the released model's encoders store per image of a bucket: 4-channel latents
        at 1/8 of the pixels, CLIP-L's 77 x 768 hidden states."""
        return {"latent": (4, height // 8, width // 8), "prompt_embeds": (77, 768)}

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return base.kl_image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return _ClipText(
            [_tokenizer(source)], [self.part(source, "text_encoder", device, weights)], device
        )

    def loss(self, source: parts.Source, objective):
        objective = objectives.objective_of_kind(self, objective)
        scheduler = objectives.ddpm_scheduler(source)

        def sd15_loss(denoiser, batch) -> torch.Tensor:
            def predict(noisy, steps):
                return denoiser(noisy, steps, encoder_hidden_states=batch["prompt_embeds"]).sample

            return objectives.ddpm_loss(scheduler, objective, batch, predict, batch.get("mask"))

        return objectives.ddpm_objective(scheduler, objective, sd15_loss)

    def preset_pipeline(self, source: parts.Source):
        from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

        return StableDiffusionPipeline(
            **self.preset_parts(source),
            tokenizer=_tokenizer(source),
            scheduler=EulerDiscreteScheduler(**objectives.sd_scheduler_config()),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
