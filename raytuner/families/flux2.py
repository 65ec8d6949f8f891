"""FLUX.2: [klein] 4B and 9B (``flux2-klein``) and [dev] (``flux2-dev``), one flow-matching
transformer (``Flux2Transformer2DModel``: double-stream then single-stream blocks, their
modulation shared) on the FLUX.2 VAE's latents, conditioned on the stacked hidden states of
three layers of an LLM (``flux2_text``).

Latents: the VAE's mode (32 channels at 1/8), its 2x2 patches as 128 channels at 1/16,
normalised by the VAE's BatchNorm running statistics, as ``Flux2Pipeline._encode_vae_image``
makes them; 128 x 64 x 64 x 2 bytes = 1 MiB a 1024 px image in the cache, 4,096 tokens.

Text: every caption is 512 tokens, all stored (the transformer takes no text mask, and pad rows
are the caption's: see ``flux2_text``): 512 x 3 x 2,560 x 2 bytes = 7.5 MiB a caption for
[klein] 4B (Qwen3-4B), 512 x 3 x 4,096 x 2 = 12 MiB for [klein] 9B (Qwen3-8B), 512 x 3 x 5,120
x 2 = 15 MiB for [dev] (Mistral Small 3.1 24B), in the cache's bfloat16.

Training: x_t = (1 - s) x0 + s noise, the transformer at time s (x1000 inside) predicting
noise - x0, as diffusers' train_dreambooth_lora_flux2(_klein).py; the resolution shift is
Flux.1's line on the 1/16 token count (musubi-tuner's flux2_shift); [dev] has a guidance
embedding, trained at ``objective.flow.guidance`` (1.0, as musubi-tuner trains it), [klein]
none.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from raytuner import placement
from raytuner.families import base, flux2_lora, objectives, parts
from raytuner.families import flux2_text as text
from raytuner.families.flux2_text import MAX_TOKENS, Flux2Text, Recipe

# diffusers' flux2 scripts' default targets: every attention projection of the double blocks,
# the single blocks' fused q/k/v/MLP input and their output (named per block: ``attn.to_out``
# alone would also name the double blocks' ModuleList); 48: [dev]'s single blocks, the most
TARGETS = (
    "to_k",
    "to_q",
    "to_v",
    "to_out.0",
    "to_qkv_mlp_proj",
    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)),
)
BLOCKS = ("transformer_blocks", "single_transformer_blocks")


def image_encoder(vae, device: str) -> base.ImageEncoder:
    """Latent mean and std of the FLUX.2 VAE in the transformer's scale: the posterior's mode
    (its mean) patchified 2x2 into 128 channels, minus the BatchNorm's running mean, over the
    square root of its running variance plus its eps (``Flux2Pipeline._encode_vae_image``);
    the std patchified the same way, over the same root."""
    from diffusers import Flux2Pipeline

    vae = placement.move(vae, device).eval().requires_grad_(False)
    dtype, eps = vae.dtype, vae.config.batch_norm_eps

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(placement.inputs(pixels, device, dtype)).latent_dist
        mean = Flux2Pipeline._patchify_latents(dist.mode())
        std = Flux2Pipeline._patchify_latents(dist.std)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(mean)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + eps).to(mean)
        return (mean - bn_mean) / bn_std, std / bn_std

    return encode


def _adapters(base_model_version: str, architecture: str) -> base.Adapters:
    """diffusers' targets, and the kohya file in BFL's names (``flux2_lora``) with the values
    musubi-tuner writes for FLUX.2 LoRAs."""
    files = base.LoraFiles(
        "flux2",
        base_model_version,
        "networks.lora_flux_2",
        architecture,
        "https://github.com/black-forest-labs/flux2",
    )
    return base.Adapters(targets=TARGETS, files=files, kohya_names=flux2_lora.names)


class _Flux2(base.DiffusersFamily):
    """What [klein] and [dev] share: everything but the text encoder, the pipeline and the
    guidance embedding."""

    objective_kind = "flow"
    recipe: Recipe
    text_width: int  # the released model's caption features (3 x its LLM's hidden size)
    # the VAE's 8 x the 2x2 patches (the pipeline floors other sides to a multiple of 16)
    geometry = base.Geometry(pixel_multiple=16, pixel_grid=16)
    blocks = base.Blocks(
        swap=BLOCKS,
        shard=BLOCKS,
        compile=("Flux2TransformerBlock", "Flux2SingleTransformerBlock"),
        float8_matmul=True,
    )
    adapters: base.Adapters  # the LLM: not trained (no diffusers script trains it)

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """128 channels at 1/16 of the pixels and the released model's 512 caption rows."""
        latent = (128, height // 16, width // 16)
        return {"latent": latent, "prompt_embeds": (MAX_TOKENS, self.text_width)}

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoder = self.part(source, "text_encoder", device, weights)
        return Flux2Text(self.recipe, self.tokenizer(source), encoder, device)

    @abstractmethod
    def tokenizer(self, source: parts.Source):
        """Its LLM's tokenizer (a preset's built in code)."""

    def loss(self, source: parts.Source, objective):
        from diffusers import Flux2Pipeline

        objective = objectives.objective_of_kind(self, objective)
        path = self.parts.classes["transformer"]
        architecture = parts.config(self.name, source, "transformer", path)
        guided = bool(architecture.get("guidance_embeds", True))  # the class default: True
        ids: dict = {}  # position ids, made once per bucket and caption length on the device

        def position_ids(latents, text):
            key = (tuple(latents.shape[2:]), text.shape[1], str(latents.device))
            if key not in ids:  # as the pipeline makes them, for one sample (the model's [0])
                img = Flux2Pipeline._prepare_latent_ids(latents[:1])
                txt = Flux2Pipeline._prepare_text_ids(text[:1])
                ids[key] = (img.to(latents.device), txt.to(latents.device))
            return ids[key]

        def flux2_loss(denoiser, batch) -> torch.Tensor:
            latents, text = batch["latent"], batch["prompt_embeds"]
            b, c, h, w = latents.shape
            img_ids, txt_ids = position_ids(latents, text)
            guidance = (
                torch.full((b,), objective.guidance, device=latents.device) if guided else None
            )

            def predict(noisy, sigmas):
                out = denoiser(
                    hidden_states=Flux2Pipeline._pack_latents(noisy),
                    encoder_hidden_states=text,
                    timestep=sigmas.to(latents.dtype),
                    img_ids=img_ids,
                    txt_ids=txt_ids,
                    guidance=guidance,
                    return_dict=False,
                )[0]
                return out.permute(0, 2, 1).reshape(b, c, h, w)  # the packing's inverse

            return objectives.flow_loss(objective, batch, predict, batch.get("mask"))

        def tokens(shape: tuple[int, ...]) -> int:  # a token a latent pixel (already 1/16)
            return shape[2] * shape[3]

        return objectives.Objective(objectives.flow_draw(objective, tokens), flux2_loss)

    def pipeline_options(self, pipe) -> dict:
        """Caption tokens as the cache kept them: the tokenizer's limit, at most 512."""
        tokenizer = getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer)
        return {"max_sequence_length": min(MAX_TOKENS, tokenizer.model_max_length)}

    def preset_pipeline(self, source: parts.Source):
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        # FLUX.2's scheduler config (FLUX.1-dev's); the pipelines pass their own mu
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
        pipeline = getattr(diffusers, self.recipe.pipeline)
        tokenizer = self.tokenizer(source)
        return pipeline(**self.preset_parts(source), tokenizer=tokenizer, scheduler=scheduler)


class Flux2Klein(_Flux2):
    """FLUX.2 [klein] 4B (``random``) and 9B (``random-9b``): base models (train on these) and
    their step-distilled releases, one architecture each; no guidance embedding."""

    name = "flux2-klein"
    recipe = text.KLEIN
    text_width = 3 * 2560  # the 4B model's (Qwen3-4B); the 9B's: 3 x 4096
    # musubi-tuner writes flux_2_klein_4b / _9b: one family holds both sizes
    adapters = _adapters("flux_2_klein", "flux-2-klein")
    # Flux2KleinPipeline's default: classifier-free guidance against the empty prompt (the
    # distilled releases ignore it); it takes no negative prompt of the user's
    # a step-distilled release (its pipeline's is_distilled: FLUX.2-klein-4B / -9B) renders
    # in 4 steps at guidance 1 (validation.distilled)
    guidance = base.Guidance(
        default_scale=4.0, negative_prompt=False, distilled_steps=4, distilled_scale=1.0
    )
    parts = base.Parts(
        classes={
            "transformer": "diffusers.Flux2Transformer2DModel",
            "vae": "diffusers.AutoencoderKLFlux2",
            "text_encoder": "transformers.Qwen3ForCausalLM",
        },
        denoiser="transformer",
        pipeline="diffusers.Flux2KleinPipeline",
    )

    def tokenizer(self, source: parts.Source):
        return text.qwen_tokenizer(self.name, source)


class Flux2Dev(_Flux2):
    """FLUX.2 [dev], 32 B, guidance-distilled: its guidance embedding is trained at
    ``objective.flow.guidance`` and renders at the pipeline's 4."""

    name = "flux2-dev"
    recipe = text.DEV
    text_width = 3 * 5120  # Mistral Small 3.1's hidden size
    adapters = _adapters("flux_2_dev", "flux-2-dev")
    guidance = base.Guidance(default_scale=4.0, embedding=True, negative_prompt=False)
    parts = base.Parts(
        classes={
            "transformer": "diffusers.Flux2Transformer2DModel",
            "vae": "diffusers.AutoencoderKLFlux2",
            "text_encoder": "transformers.Mistral3ForConditionalGeneration",
        },
        denoiser="transformer",
        pipeline="diffusers.Flux2Pipeline",
    )

    def tokenizer(self, source: parts.Source):
        return text.mistral_tokenizer(self.name, source)
