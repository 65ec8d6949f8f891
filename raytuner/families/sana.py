"""Sana: a linear-attention flow-matching transformer on 32-channel DC-AE latents (32x
downsampling), conditioned on Gemma-2 hidden states with their attention mask."""

from __future__ import annotations

import inspect

import torch

from raytuner import placement
from raytuner.families import base, objectives, parts

MAX_TOKENS = 300  # caption tokens the Sana pipeline keeps (a tiny tokenizer keeps fewer)


def _tokenizer(source: parts.Source):
    if not source.preset:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))
    from transformers import GemmaTokenizer

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'\"-()\n▁"
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    length = parts.tokenizer_length("sana", source, "tokenizer", MAX_TOKENS)
    return GemmaTokenizer(vocab=vocab, model_max_length=length)


def _instruction() -> list[str]:
    """The instruction the Sana pipeline puts before every prompt at inference: the cached
    embeddings are made the same way, so training sees what sampling will feed."""
    from diffusers import SanaPipeline

    return inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


class _GemmaText:
    """Gemma-2 hidden states and attention mask, through the Sana pipeline's own encode_prompt."""

    def __init__(self, tokenizer, encoder, device: str):
        from diffusers import SanaPipeline

        encoder = placement.move(encoder, device).eval().requires_grad_(False)
        self.pipe = SanaPipeline(
            tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None, scheduler=None
        )
        self.tokenizer, self.device, self.encoders = tokenizer, device, [encoder]
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


class Sana(base.DiffusersFamily):
    name = "sana"
    objective_kind = "flow"
    # DC-AE downsamples 32x; the transformer patch is 1
    geometry = base.Geometry(pixel_multiple=32, pixel_grid=32)
    blocks = base.Blocks(
        swap=("transformer_blocks",),
        shard=("transformer_blocks",),
        compile=("SanaTransformerBlock",),
        compiled_on_gpu=(  # H100, torch 2.11, 2026-11-26: the first compiled step
            "RuntimeError: (*bias): last dimension must be contiguous"
        ),
        float8_matmul=True,
    )
    # adapters: the defaults. The diffusers layout only: no tool reads a kohya Sana LoRA
    # (sd-scripts has no Sana); Gemma-2: not trained (no trainer or loader takes a Sana
    # text-encoder LoRA)

    # SanaPipeline's default; classifier-free guidance with a negative prompt
    guidance = base.Guidance(default_scale=4.5)
    parts = base.Parts(
        classes={
            "transformer": "diffusers.SanaTransformer2DModel",
            "vae": "diffusers.AutoencoderDC",
            "text_encoder": "transformers.Gemma2Model",
        },
        denoiser="transformer",
        pipeline="diffusers.SanaPipeline",
        # no single file: Sana ships as diffusers folders (its original checkpoints are
        # pickled .pth files)
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """What Sana 1600M's encoders store per image of a bucket: 32-channel DC-AE latents at
        1/32 of the pixels, Gemma-2-2B's 300 x 2304 hidden states and their attention mask."""
        latent = (32, height // 32, width // 32)
        tokens = (MAX_TOKENS,)
        return {"latent": latent, "prompt_embeds": (*tokens, 2304), "prompt_attention_mask": tokens}

    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> objectives.Batch:
        """Random cached tensors and the per-image conditioning (``base.example_batch``), the
        Gemma attention mask all ones: every caption token attended, as for a caption that
        fills the tokens kept."""
        batch = base.example_batch(shapes, n, size, device, dtype)
        batch["prompt_attention_mask"] = torch.ones_like(batch["prompt_attention_mask"])
        return batch

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        vae = self.part(source, "vae", device, weights).requires_grad_(False)
        scale = vae.config.scaling_factor
        dtype = vae.dtype  # diffusers walks every module to answer: once, not each batch

        @torch.no_grad()
        def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            latent = vae.encode(placement.inputs(pixels, device, dtype)).latent * scale
            return latent, torch.zeros_like(latent)  # DC-AE is deterministic

        return encode

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return _GemmaText(
            _tokenizer(source), self.part(source, "text_encoder", device, weights), device
        )

    def loss(self, source: parts.Source, objective):
        objective = objectives.objective_of_kind(self, objective)

        def sana_loss(denoiser, batch) -> torch.Tensor:
            latents = batch["latent"]

            def predict(noisy, sigmas):
                # the pipeline feeds the flow scheduler's timesteps, sigma x 1000
                return denoiser(
                    noisy,
                    encoder_hidden_states=batch["prompt_embeds"],
                    encoder_attention_mask=batch["prompt_attention_mask"],
                    timestep=sigmas.to(latents.dtype) * 1000,
                ).sample

            return objectives.flow_loss(objective, batch, predict, batch.get("mask"))

        def tokens(shape: tuple[int, ...]) -> int:  # a token a latent pixel
            return shape[2] * shape[3]

        return objectives.Objective(objectives.flow_draw(objective, tokens), sana_loss)

    def pipeline_options(self, pipe) -> dict:
        """Gemma tokens as the cache kept them; resolution binning only for the sample sizes
        the pipeline has bins for (the real models'; a tiny one has none)."""
        binned = pipe.transformer.config.sample_size in (16, 32, 64, 128)
        tokens = min(MAX_TOKENS, pipe.tokenizer.model_max_length)
        return {"max_sequence_length": tokens, "use_resolution_binning": binned}

    def preset_pipeline(self, source: parts.Source):
        from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

        return SanaPipeline(
            **self.preset_parts(source),
            tokenizer=_tokenizer(source),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
