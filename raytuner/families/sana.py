"""Sana: a linear-attention flow-matching transformer on 32-channel DC-AE latents (32x
downsampling), conditioned on Gemma-2 hidden states with their attention mask."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from raytuner.families import base

TINY = "tiny"
MAX_TOKENS = 300  # caption tokens the Sana pipeline keeps (a tiny tokenizer keeps fewer)


def _tiny_transformer():
    from diffusers import SanaTransformer2DModel

    with base.seeded(31):
        return SanaTransformer2DModel(
            in_channels=32,
            out_channels=32,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_cross_attention_heads=2,
            cross_attention_head_dim=8,
            cross_attention_dim=16,
            caption_channels=32,
            sample_size=2,
        )


def _tiny_vae():
    from diffusers import AutoencoderDC

    with base.seeded(32):
        return AutoencoderDC(
            latent_channels=32,
            attention_head_dim=4,
            encoder_block_out_channels=(8, 8, 8, 16, 16, 32),
            decoder_block_out_channels=(8, 8, 8, 16, 16, 32),
            encoder_layers_per_block=(1,) * 6,
            decoder_layers_per_block=(1,) * 6,
            encoder_qkv_multiscales=((),) * 6,
            decoder_qkv_multiscales=((),) * 6,
            scaling_factor=0.41407,
        )


def _tiny_text():
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'\"-()\n▁"
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    tokenizer = GemmaTokenizer(vocab=vocab, model_max_length=32)
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        pad_token_id=0,
    )
    with base.seeded(33):
        return tokenizer, Gemma2Model(config)


def _instruction() -> list[str]:
    """The instruction the Sana pipeline puts before every prompt at inference: the cached
    embeddings are made the same way, so training sees what sampling will feed."""
    from diffusers import SanaPipeline

    return inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


class _GemmaText:
    """Gemma-2 hidden states and attention mask, through the Sana pipeline's own encode_prompt."""

    def __init__(self, tokenizer, encoder, device: str):
        from diffusers import SanaPipeline

        encoder = encoder.to(device).eval().requires_grad_(False)
        self.pipe = SanaPipeline(
            tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None, scheduler=None
        )
        self.tokenizer, self.device = tokenizer, device
        self.max_tokens = min(MAX_TOKENS, tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, _, _ = self.pipe.encode_prompt(
            captions,
            do_classifier_free_guidance=False,
            device=torch.device(self.device),
            max_sequence_length=self.max_tokens,
            complex_human_instruction=_instruction(),
        )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.to(embeds.dtype)}

    def truncated(self, captions: list[str]) -> list[bool]:
        ids = self.tokenizer(captions, add_special_tokens=True, verbose=False).input_ids
        return [len(i) > self.max_tokens for i in ids]


@dataclass(frozen=True)
class Sana:
    name: str = "sana"
    default_resolution: int = 1024
    pixel_multiple: int = 32  # DC-AE downsamples 32x; the transformer patch is 1
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    denoiser_part: str = "transformer"

    def cache_shapes(self, width: int, height: int) -> dict[str, tuple[int, ...]]:
        """What Sana 1600M's encoders store per image of a bucket: 32-channel DC-AE latents at
        1/32 of the pixels, Gemma-2-2B's 300 x 2304 hidden states and their attention mask."""
        latent = (32, height // 32, width // 32)
        tokens = (MAX_TOKENS,)
        return {"latent": latent, "prompt_embeds": (*tokens, 2304), "prompt_attention_mask": tokens}

    def image_encoder(self, pretrained: str, revision: str, device: str):
        from diffusers import AutoencoderDC

        if pretrained == TINY:
            vae = _tiny_vae()
        else:
            vae = AutoencoderDC.from_pretrained(pretrained, **base.hub_kwargs(revision, "vae"))
        vae = vae.to(device).eval().requires_grad_(False)
        scale = vae.config.scaling_factor

        @torch.no_grad()
        def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            latent = vae.encode(pixels.to(device, vae.dtype)).latent * scale
            return latent, torch.zeros_like(latent)  # DC-AE is deterministic

        return encode

    def text_encoder(self, pretrained: str, revision: str, device: str):
        from transformers import AutoModel, AutoTokenizer

        if pretrained == TINY:
            return _GemmaText(*_tiny_text(), device)
        tokenizer = AutoTokenizer.from_pretrained(
            pretrained, **base.hub_kwargs(revision, "tokenizer")
        )
        encoder = AutoModel.from_pretrained(pretrained, **base.hub_kwargs(revision, "text_encoder"))
        return _GemmaText(tokenizer, encoder, device)

    def denoiser(self, pretrained: str, revision: str) -> nn.Module:
        from diffusers import SanaTransformer2DModel

        if pretrained == TINY:
            return _tiny_transformer()
        return SanaTransformer2DModel.from_pretrained(
            pretrained, **base.hub_kwargs(revision, "transformer")
        )

    def loss(self, pretrained: str, revision: str, objective):
        def sana_loss(denoiser, batch, generators: Sequence[torch.Generator]) -> torch.Tensor:
            latents = batch["latent"]

            def predict(noisy, sigmas):
                # the pipeline feeds the flow scheduler's timesteps, sigma x 1000
                return denoiser(
                    noisy,
                    encoder_hidden_states=batch["prompt_embeds"],
                    encoder_attention_mask=batch["prompt_attention_mask"],
                    timestep=sigmas.to(latents.dtype) * 1000,
                ).sample

            tokens = latents.shape[2] * latents.shape[3]
            return base.flow_loss(objective, latents, generators, predict, tokens)

        return sana_loss

    def save_lora(self, directory: str, lora_state: dict, adapter_config: dict) -> None:
        from diffusers import SanaPipeline

        base.save_lora(SanaPipeline, self.denoiser_part, directory, lora_state, adapter_config)

    def pipeline_options(self, pipe) -> dict:
        """Gemma tokens as the cache kept them; resolution binning only for the sample sizes
        the pipeline has bins for (the real models'; a tiny one has none)."""
        binned = pipe.transformer.config.sample_size in (16, 32, 64, 128)
        tokens = min(MAX_TOKENS, pipe.tokenizer.model_max_length)
        return {"max_sequence_length": tokens, "use_resolution_binning": binned}

    def pipeline(self, pretrained: str, revision: str):
        from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

        if pretrained != TINY:
            return SanaPipeline.from_pretrained(pretrained, **base.hub_kwargs(revision))
        tokenizer, encoder = _tiny_text()
        return base.tiny_pipeline(
            SanaPipeline(
                tokenizer=tokenizer,
                text_encoder=encoder,
                vae=_tiny_vae(),
                transformer=_tiny_transformer(),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            )
        )
