"""Stable Diffusion 1.5 class: UNet with one CLIP text encoder (last hidden state); epsilon or
v-prediction, as the scheduler config says."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raytuner.families import base, parts, text
from raytuner.lora import kohya

PARTS = {
    "unet": "diffusers.UNet2DConditionModel",
    "vae": "diffusers.AutoencoderKL",
    "text_encoder": "transformers.CLIPTextModel",
}


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


@dataclass(frozen=True)
class SD15:
    name: str = "sd15"
    default_resolution: int = 512
    pixel_multiple: int = 64
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    denoiser_part: str = "unet"
    lora_files: base.LoraFiles = base.LoraFiles(
        "unet", "sd_v1", "networks.lora", "stable-diffusion-v1", "diffusers"
    )
    swap_blocks: tuple[str, ...] = ()
    shard_blocks: tuple[str, ...] = ("down_blocks", "mid_block", "up_blocks")
    shard_inner: tuple[str, ...] = ("ResnetBlock2D", "BasicTransformerBlock")
    compile_blocks: tuple[str, ...] = ("BasicTransformerBlock",)
    compiled_on_gpu: float | str = 0.98  # H100 2026-11-26: 58.2 vs 59.6 samples/s
    float8_matmul: bool = False
    channels_last: bool = True
    objective_kind: str = "ddpm"
    guidance_embedding: bool = False
    default_guidance_scale: float = 7.5  # StableDiffusionPipeline's default
    negative_prompt: bool = True  # classifier-free guidance with a negative prompt
    # sd-scripts' lora_te_text_model_encoder_layers_<i>_self_attn_q_proj, ...
    text_encoder_loras: tuple[text.TextEncoderLora, ...] = (
        text.TextEncoderLora("text_encoder", "lora_te"),
    )
    text_encoder_lora_targets: tuple[str, ...] = text.CLIP_LORA_TARGETS
    pixel_grid: int = 8  # the VAE's 8x; the UNet fits its skips to any latent size
    # the original LDM layout of SD1.5 checkpoints (model sites' .safetensors)
    single_file_parts: tuple[tuple[str, str], ...] = (
        ("unet", "model.diffusion_model."),
        ("vae", "first_stage_model."),
        ("text_encoder", "cond_stage_model."),
    )

    def cache_shapes(self, width: int, height: int) -> dict[str, tuple[int, ...]]:
        """What the released model's encoders store per image of a bucket: 4-channel latents
        at 1/8 of the pixels, CLIP-L's 77 x 768 hidden states."""
        return {"latent": (4, height // 8, width // 8), "prompt_embeds": (77, 768)}

    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> base.Batch:
        """Random cached tensors and the per-image conditioning (``base.example_batch``)."""
        return base.example_batch(shapes, n, size, device, dtype)

    def kohya_names(self, config):
        """sd-scripts' SD1.5 UNet uses the diffusers module names."""
        return kohya.unet_names

    def part_classes(self) -> dict[str, str]:
        return dict(PARTS)

    def single_file_state(self, part: str, state: dict) -> dict:
        """Its single file's tensors are in the layout diffusers' converters read."""
        return state

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return base.kl_image_encoder(_part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return _ClipText(
            [_tokenizer(source)], [_part(source, "text_encoder", device, weights)], device
        )

    def denoiser(self, source: parts.Source, device: str = "cpu", weights: bool = True):
        return _part(source, "unet", device, weights)

    def loss(self, source: parts.Source, objective):
        objective = base.objective_of_kind(self, objective)
        scheduler = base.ddpm_scheduler(source)

        def sd15_loss(denoiser, batch) -> torch.Tensor:
            def predict(noisy, steps):
                return denoiser(noisy, steps, encoder_hidden_states=batch["prompt_embeds"]).sample

            return base.ddpm_loss(scheduler, objective, batch, predict, batch.get("mask"))

        return base.ddpm_objective(scheduler, objective, sd15_loss)

    def save_lora(
        self, directory: str, lora_state: dict, adapter_config: dict, text_encoders=None
    ) -> None:
        from diffusers import StableDiffusionPipeline

        pipeline, part = StableDiffusionPipeline, self.denoiser_part
        base.save_lora(pipeline, part, directory, lora_state, adapter_config, text_encoders)

    def pipeline_options(self, pipe) -> dict:
        """None: the pipeline tokenizes captions as the cache did (77 CLIP tokens)."""
        return {}

    def pipeline(self, source: parts.Source):
        from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

        if not source.preset:
            return StableDiffusionPipeline.from_pretrained(
                source.repo,
                safety_checker=None,
                **base.hub_kwargs(source),
                **base.file_parts(_part, source, self.single_file_parts),
            )
        return base.preset_pipeline(
            StableDiffusionPipeline(
                **{name: _part(source, name) for name in PARTS},
                tokenizer=_tokenizer(source),
                scheduler=EulerDiscreteScheduler(**base.sd_scheduler_config()),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        )


# (source, part name, device="cpu", weights=True) -> the part, for the methods above
_part = parts.loader(SD15(), PARTS)
