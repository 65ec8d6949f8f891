"""Flux.1: a flow-matching transformer on 2x2-packed 16-channel latents, conditioned on T5
sequence embeddings and the CLIP-L pooled embedding, with a guidance embedding in the
guidance-distilled checkpoints (dev)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytuner.families import base

TINY = "tiny"
VAE_FACTOR = 8


def _tiny_transformer():
    from diffusers import FluxTransformer2DModel

    with base.seeded(21):
        return FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(2, 2, 4),
        )


def _tiny_vae():
    return base.tiny_kl_vae(
        seed=22,
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _tiny_t5_tokenizer(max_length: int = 32):
    """A character-level T5 tokenizer built in code (Unigram over single characters)."""
    from transformers import T5Tokenizer

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?'-▁"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -1.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _tiny_text():
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    clip_tokenizer = base.tiny_clip_tokenizer()
    t5_tokenizer = _tiny_t5_tokenizer()
    with base.seeded(23):
        clip = CLIPTextModel(base.tiny_clip_config(clip_tokenizer))
    config = T5Config(
        vocab_size=len(t5_tokenizer), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4
    )
    with base.seeded(24):
        t5 = T5EncoderModel(config)
    return clip_tokenizer, t5_tokenizer, clip, t5


class _FluxText(base.FrozenTextEncoders):
    """T5's last hidden state (the sequence) and CLIP-L's pooled output."""

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        (clip_tok, t5_tok), (clip, t5) = self.tokenizers, self.encoders
        pooled = clip(base.tokenize(clip_tok, captions, self.device)).pooler_output
        sequence = t5(base.tokenize(t5_tok, captions, self.device)).last_hidden_state
        return {"prompt_embeds": sequence, "pooled_prompt_embeds": pooled}


@dataclass(frozen=True)
class Flux:
    name: str = "flux"
    default_resolution: int = 1024
    pixel_multiple: int = 16  # VAE factor 8 x the 2x2 packing
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    denoiser_part: str = "transformer"

    def cache_shapes(self, width: int, height: int) -> dict[str, tuple[int, ...]]:
        """What Flux.1's encoders store per image of a bucket: 16-channel latents at 1/8 of the
        pixels, T5-XXL's 512 x 4096 hidden states, CLIP-L's pooled 768."""
        latent = (16, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "prompt_embeds": (512, 4096), "pooled_prompt_embeds": (768,)}

    def image_encoder(self, pretrained: str, revision: str, device: str):
        from diffusers import AutoencoderKL

        if pretrained == TINY:
            vae = _tiny_vae()
        else:
            vae = AutoencoderKL.from_pretrained(pretrained, **base.hub_kwargs(revision, "vae"))
        vae = vae.to(device).eval().requires_grad_(False)
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor

        @torch.no_grad()
        def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            dist = vae.encode(pixels.to(device, vae.dtype)).latent_dist
            return (dist.mean - shift) * scale, dist.std * scale

        return encode

    def text_encoder(self, pretrained: str, revision: str, device: str):
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        if pretrained == TINY:
            clip_tok, t5_tok, clip, t5 = _tiny_text()
        else:
            kw = lambda sub: base.hub_kwargs(revision, sub)  # noqa: E731
            clip_tok = AutoTokenizer.from_pretrained(pretrained, **kw("tokenizer"))
            t5_tok = AutoTokenizer.from_pretrained(pretrained, **kw("tokenizer_2"))
            clip = CLIPTextModel.from_pretrained(pretrained, **kw("text_encoder"))
            t5 = T5EncoderModel.from_pretrained(pretrained, **kw("text_encoder_2"))
        return _FluxText([clip_tok, t5_tok], [clip, t5], device)

    def denoiser(self, pretrained: str, revision: str) -> nn.Module:
        from diffusers import FluxTransformer2DModel

        if pretrained == TINY:
            return _tiny_transformer()
        return FluxTransformer2DModel.from_pretrained(
            pretrained, **base.hub_kwargs(revision, "transformer")
        )

    def _guidance_embeds(self, pretrained: str, revision: str) -> bool:
        from diffusers import FluxTransformer2DModel

        if pretrained == TINY:
            return True
        config = FluxTransformer2DModel.load_config(
            pretrained, **base.hub_kwargs(revision, "transformer")
        )
        return bool(config.get("guidance_embeds", False))

    def loss(self, pretrained: str, revision: str, objective):
        from diffusers import FluxPipeline

        guided = self._guidance_embeds(pretrained, revision)

        def flux_loss(denoiser, batch, generators: Sequence[torch.Generator]) -> torch.Tensor:
            latents, text = batch["latent"], batch["prompt_embeds"]
            b, c, h, w = latents.shape
            guidance = (
                torch.full((b,), objective.guidance, device=latents.device) if guided else None
            )

            # the 2x2 packing and position ids of diffusers' own Flux pipeline and trainers
            img_ids = FluxPipeline._prepare_latent_image_ids(
                b, h // 2, w // 2, latents.device, latents.dtype
            )
            txt_ids = torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype)

            def predict(noisy, sigmas):
                out = denoiser(
                    hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w),
                    timestep=sigmas.to(latents.dtype),
                    guidance=guidance,
                    pooled_projections=batch["pooled_prompt_embeds"],
                    encoder_hidden_states=text,
                    txt_ids=txt_ids,
                    img_ids=img_ids,
                ).sample
                return FluxPipeline._unpack_latents(out, h * VAE_FACTOR, w * VAE_FACTOR, VAE_FACTOR)

            tokens = (h // 2) * (w // 2)
            return base.flow_loss(objective, latents, generators, predict, tokens)

        return flux_loss

    def save_lora(self, directory: str, lora_state: dict, adapter_config: dict) -> None:
        from diffusers import FluxPipeline

        base.save_lora(FluxPipeline, self.denoiser_part, directory, lora_state, adapter_config)

    def pipeline_options(self, pipe) -> dict:
        """T5 tokens as the cache kept them: the tokenizer's limit, at most the pipeline's 512."""
        return {"max_sequence_length": min(512, pipe.tokenizer_2.model_max_length)}

    def pipeline(self, pretrained: str, revision: str):
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        if pretrained != TINY:
            return FluxPipeline.from_pretrained(pretrained, **base.hub_kwargs(revision))
        clip_tok, t5_tok, clip, t5 = _tiny_text()
        scheduler = FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        return base.tiny_pipeline(
            FluxPipeline(
                scheduler=scheduler,
                vae=_tiny_vae(),
                text_encoder=clip,
                tokenizer=clip_tok,
                text_encoder_2=t5,
                tokenizer_2=t5_tok,
                transformer=_tiny_transformer(),
            )
        )
