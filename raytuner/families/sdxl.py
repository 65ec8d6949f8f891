"""SDXL: UNet with two CLIP text encoders and size/crop micro-conditioning."""

from __future__ import annotations

import re

import torch

from raytuner.families import base, objectives, parts, text
from raytuner.lora import kohya

# sd-scripts names an SDXL LoRA in Stability's sgm block names: diffusers' names -> those
_RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1"}
_RESNET |= {"conv_shortcut": "skip_connection", "norm1": "in_layers.0", "norm2": "out_layers.0"}
_SGM_OUTER = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}


def sgm_names(config) -> kohya.Names:
    """SDXL's sgm block names for a UNet of this config (``layers_per_block`` resnets a down
    block, one more an up block), as sd-scripts writes them; the diffusers names too."""
    per = config.layers_per_block
    attn_up = ["CrossAttn" in t for t in config.up_block_types]

    def sgm(module: str) -> str | None:
        if module in _SGM_OUTER:
            return _SGM_OUTER[module]
        if m := re.fullmatch(r"down_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module):
            i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            rest = _RESNET.get(rest, rest) if kind == "resnets" else rest
            return f"input_blocks.{1 + i * (per + 1) + j}.{int(kind == 'attentions')}.{rest}"
        if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module):
            return f"input_blocks.{(int(m[1]) + 1) * (per + 1)}.0.op"
        if m := re.fullmatch(r"mid_block\.(attentions|resnets)\.(\d+)\.(.+)", module):
            kind, j, rest = m[1], int(m[2]), m[3]
            if kind == "attentions":
                return f"middle_block.1.{rest}"
            return f"middle_block.{2 * j}.{_RESNET.get(rest, rest)}"
        if m := re.fullmatch(r"up_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module):
            i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            rest = _RESNET.get(rest, rest) if kind == "resnets" else rest
            return f"output_blocks.{i * (per + 1) + j}.{int(kind == 'attentions')}.{rest}"
        if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", module):
            i = int(m[1])
            return f"output_blocks.{i * (per + 1) + per}.{1 + attn_up[i]}.conv"
        return None

    def names(module: str) -> list[tuple[str, tuple[str, ...]]]:
        name = sgm(module)
        return ([(kohya.flat(name), (module,))] if name else []) + kohya.unet_names(module)

    return names


def _tokenizers(source: parts.Source) -> list:
    names = ("tokenizer", "tokenizer_2")
    if source.preset:
        lengths = [parts.tokenizer_length("sdxl", source, name, 77) for name in names]
        return [text.tiny_clip_tokenizer(n) for n in lengths]
    from transformers import CLIPTokenizer

    return [CLIPTokenizer.from_pretrained(source.repo, **source.hub(n)) for n in names]


class _SdxlText(text.FrozenTextEncoders):
    """Penultimate hidden states of both encoders, concatenated, plus encoder 2's pooled output."""

    outputs = ("prompt_embeds", "pooled_prompt_embeds")

    def embed(self, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        one, two = self.encoders
        out1 = one(tokens["input_ids"], output_hidden_states=True)
        out2 = two(tokens["input_ids_2"], output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        return {"prompt_embeds": hidden, "pooled_prompt_embeds": out2.text_embeds}


class SDXL(base.DiffusersFamily):
    name = "sdxl"
    objective_kind = "ddpm"
    # the VAE's 8x; the UNet fits its skips to any latent size
    geometry = base.Geometry(pixel_multiple=64, pixel_grid=8)
    blocks = base.Blocks(
        shard=("down_blocks", "mid_block", "up_blocks"),
        shard_inner=("ResnetBlock2D", "BasicTransformerBlock"),
        compile=("BasicTransformerBlock",),
        compiled_on_gpu=1.27,  # H100 2026-11-26: 5.68 vs 4.48 samples/s
        channels_last=True,
    )
    adapters = base.Adapters(
        files=base.LoraFiles(
            "sgm",
            "sdxl_base_v1-0",
            "networks.lora",
            "stable-diffusion-xl-v1-base",
            "https://github.com/Stability-AI/generative-models",
            lycoris="lycoris_{flat}",  # ComfyUI: its unet_to_diffusers names
        ),
        kohya_names=sgm_names,
        # sd-scripts' lora_te1_text_model_encoder_layers_<i>_self_attn_q_proj (CLIP-L), lora_te2_…
        # (OpenCLIP bigG); CLIP-L's last layer feeds nothing (the penultimate hidden state is
        # used), so its LoRA stays as it started, as in sd-scripts
        text_encoders=(
            text.TextEncoderLora("text_encoder", "lora_te1"),
            text.TextEncoderLora("text_encoder_2", "lora_te2"),
        ),
        text_encoder_targets=text.CLIP_LORA_TARGETS,
    )
    # StableDiffusionXLPipeline's default; classifier-free guidance with a negative prompt
    guidance = base.Guidance(default_scale=5.0)
    parts = base.Parts(
        classes={
            "unet": "diffusers.UNet2DConditionModel",
            "vae": "diffusers.AutoencoderKL",
            "text_encoder": "transformers.CLIPTextModel",
            "text_encoder_2": "transformers.CLIPTextModelWithProjection",
        },
        denoiser="unet",
        pipeline="diffusers.StableDiffusionXLPipeline",
        # the original SGM layout of SDXL checkpoints (model sites' .safetensors)
        single_file=(
            ("unet", "model.diffusion_model."),
            ("vae", "first_stage_model."),
            ("text_encoder", "conditioner.embedders.0."),
            ("text_encoder_2", "conditioner.embedders.1."),
        ),
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """What the released model's encoders store per image of a bucket: 4-channel latents
        at 1/8 of the pixels, CLIP-L + OpenCLIP-bigG hidden states (77 x 2048), bigG's pooled
        projection (1280)."""
        latent = (4, height // 8, width // 8)
        return {"latent": latent, "prompt_embeds": (77, 2048), "pooled_prompt_embeds": (1280,)}

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return base.kl_image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoders = [
            self.part(source, name, device, weights) for name in ("text_encoder", "text_encoder_2")
        ]
        return _SdxlText(_tokenizers(source), encoders, device)

    def loss(self, source: parts.Source, objective):
        objective = objectives.objective_of_kind(self, objective)
        scheduler = objectives.ddpm_scheduler(source)

        def sdxl_loss(denoiser, batch) -> torch.Tensor:
            time_ids = torch.cat(
                [batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1
            ).to(batch["latent"].dtype)
            cond = {"text_embeds": batch["pooled_prompt_embeds"], "time_ids": time_ids}

            def predict(noisy, steps):
                hidden = batch["prompt_embeds"]
                return denoiser(
                    noisy, steps, encoder_hidden_states=hidden, added_cond_kwargs=cond
                ).sample

            return objectives.ddpm_loss(scheduler, objective, batch, predict, batch.get("mask"))

        return objectives.ddpm_objective(scheduler, objective, sdxl_loss)

    def preset_pipeline(self, source: parts.Source):
        from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

        tok1, tok2 = _tokenizers(source)
        return StableDiffusionXLPipeline(
            **self.preset_parts(source),
            tokenizer=tok1,
            tokenizer_2=tok2,
            scheduler=EulerDiscreteScheduler(**objectives.sd_scheduler_config()),
        )
