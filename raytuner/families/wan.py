"""Wan 2.1 text-to-video (1.3B, 14B), trained on clips of 4n + 1 frames and on images: an image
is a one-frame clip (the pipeline's own rule: 1 frame -> 1 latent frame, 4n + 1 -> n + 1). Its
cache holds [16, T, H/8, W/8] latents, always with the frame axis, and its transformer patches
[B, 16, T, H/8, W/8] latents of Wan's causal 3-D VAE (normalized per channel by the VAE
config's latents_mean and latents_std) 1x2x2, takes time as sigma x 1000 (no x1000 inside) and
predicts noise - x0; its caption is UMT5-XXL's last hidden state of the prompt's tokens,
zero-padded to 512 rows.

The zero rows are not neutral (a cross-attention key of a zero row is the projection's bias), so
the cache stores each caption's own rows (``ragged``: 8,192 bytes a token in bfloat16, at most
4 MiB a caption) and the loss pads them back with zeros to the pipeline's length exactly."""

from __future__ import annotations

import torch

from raytuner import placement
from raytuner.families import base, objectives, parts, text
from raytuner.lora import kohya

MAX_TOKENS = 512  # WanPipeline.__call__'s max_sequence_length: every caption padded to it
TEXT_WIDTH = 4096  # UMT5-XXL's d_model
VAE_FACTOR = 8
PATCH = 2  # the transformer's 1x2x2 patches
# a frame's pixels above which the VAE encodes in tiles (diffusers' enable_tiling: 256-pixel
# tiles, blended): 480x832 (Wan's 480p) whole, 720p and above tiled. Its memory grows with a
# frame's pixels, not the frame count (it encodes a clip 4 frames at a time, caching features)
TILE_ABOVE = 480 * 832
COMFY = "diffusion_model."  # ComfyUI's name of the denoiser in LoRA keys

# Wan's own module names (its releases, ComfyUI, musubi-tuner) of diffusers' names in a block
_NATIVE = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}


def kohya_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """The name of a LoRA on a block's module in Wan's own layout: ComfyUI's name of the
    denoiser and Wan's module path (``diffusion_model.blocks.0.self_attn.q``), with kohya's
    ``lora_down`` / ``lora_up`` / ``alpha``. ComfyUI maps it (its ``diffusion_model.`` rule for
    every key of the model: it has no map of diffusers' Wan names) and diffusers' Wan loader
    converts it with its alpha, whichever modules it holds (musubi-tuner's ``lora_unet_``
    layout, which diffusers reads only with every linear of every block, is read too)."""
    head, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if head != "blocks" or inner not in _NATIVE:
        return []
    native = f"blocks.{index}.{_NATIVE[inner]}"
    musubi = kohya.PREFIX + native.replace(".", "_")
    return [(COMFY + native, (module,)), (musubi, (module,))]


def _kohya_names(config) -> kohya.Names:
    """Wan's names, the same for every Wan transformer config."""
    return kohya_names


def _tokenizer(source: parts.Source):
    """UMT5's tokenizer of a folder or repo; a preset's is the tiny T5 one built in code."""
    if source.preset:
        return text.tiny_t5_tokenizer(parts.tokenizer_length("wan", source, "tokenizer", 512))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))


class _UMT5Text:
    """UMT5's last hidden state of each caption's tokens through the pipeline's own prompt
    encoder, zero rows after them (``ragged``: the cache stores the caption's rows alone)."""

    ragged = ("prompt_embeds",)

    def __init__(self, tokenizer, encoder, device: str):
        from diffusers import WanPipeline

        encoder = placement.move(encoder, device).eval().requires_grad_(False)
        self.pipe = WanPipeline(
            tokenizer=tokenizer, text_encoder=encoder, vae=None, scheduler=None, transformer=None
        )
        # encoders: what an encoder actor may split over its GPUs or offload (text.place)
        self.tokenizer, self.device, self.encoders = tokenizer, device, [encoder]
        self.max_tokens = min(MAX_TOKENS, tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if self.device == "meta":  # raytuner plan: the encoder's pass over every token
            ids = torch.zeros(len(captions), self.max_tokens, dtype=torch.int64, device="meta")
            hidden = self.pipe.text_encoder(ids).last_hidden_state
            return {"prompt_embeds": hidden}
        embeds = self.pipe._get_t5_prompt_embeds(
            list(captions), max_sequence_length=self.max_tokens, device=torch.device(self.device)
        )
        return {"prompt_embeds": embeds}

    def truncated(self, captions: list[str]) -> list[bool]:
        return text.truncated([self.tokenizer], captions)


def wan_image_encoder(vae, device: str) -> base.ImageEncoder:
    """Latent mean and std of Wan's 3-D VAE of images [B, 3, H, W] (one frame each) or clips
    [B, 3, F, H, W] (F = 4n + 1), [B, 16, T, h, w] (T = n + 1; an image: 1) in the transformer's
    scale: (mean - latents_mean) / latents_std per channel, as WanPipeline decodes them
    (``base.clip_encoder``: a sample at a time, frames over ``TILE_ABOVE`` pixels in tiles)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def scale(dist) -> tuple[torch.Tensor, torch.Tensor]:
        m, s = (placement.inputs(t, str(dist.mean.device), dist.mean.dtype) for t in (mean, std))
        return (dist.mean - m) / s, dist.std / s

    return base.clip_encoder(vae, device, TILE_ABOVE, scale)


class Wan(base.DiffusersFamily):
    name = "wan"
    objective_kind = "flow"
    # the VAE's 8 x the transformer's 2x2 patches (WanPipeline's check_inputs: multiples of 16)
    geometry = base.Geometry(
        default_resolution=640, pixel_multiple=16, pixel_grid=16, frame_multiple=4
    )
    blocks = base.Blocks(
        swap=("blocks",),
        shard=("blocks",),
        compile=("WanTransformerBlock",),
        float8_matmul=True,
    )
    # the attention projections of self- and cross-attention (diffusers' Wan LoRA tests); the
    # kohya file in Wan's own names is the one ComfyUI loads (it maps no diffusers Wan names)
    adapters = base.Adapters(
        files=base.LoraFiles("wan", "wan2.1", "networks.lora_wan"),
        kohya_names=_kohya_names,
    )
    # WanPipeline's default classifier-free guidance with the empty negative prompt
    guidance = base.Guidance(default_scale=5.0)
    parts = base.Parts(
        classes={
            "transformer": "diffusers.WanTransformer3DModel",
            "vae": "diffusers.AutoencoderKLWan",
            "text_encoder": "transformers.UMT5EncoderModel",
        },
        denoiser="transformer",
        pipeline="diffusers.WanPipeline",
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """Per sample of a bucket: 16-channel latents at 1/8 and 1/4 of the frames (4n + 1 ->
        n + 1; an image, one) and UMT5-XXL's 4096-wide rows of a caption of at most 512 tokens
        (stored: its own tokens, 8,192 bytes each). 81 frames at 480x832: 16x21x60x104."""
        t = base.latent_frames(self.geometry, frames)
        latent = (16, t, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "prompt_embeds": (MAX_TOKENS, TEXT_WIDTH)}

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return wan_image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoder = self.part(source, "text_encoder", device, weights)
        return _UMT5Text(_tokenizer(source), encoder, device)

    def loss(self, source: parts.Source, objective):
        objective = objectives.objective_of_kind(self, objective)
        # the pipeline's caption length: its tokenizer's limit, at most 512
        rows = min(MAX_TOKENS, _tokenizer(source).model_max_length)

        def wan_loss(denoiser, batch) -> torch.Tensor:
            latents, captions = batch["latent"], batch["prompt_embeds"]
            # the caption's rows, then zero rows up to the pipeline's length, as it renders
            padded = torch.nn.functional.pad(captions, (0, 0, 0, rows - captions.shape[1]))
            # a clean first frame (objective.flow.first_frame_p: Wan 2.2 TI2V-5B's image to
            # video), a level a 1x2x2 patch as its pipeline's expand_timesteps gives them
            noised = objectives.noised_frames(batch.get("first_frame"), latents.shape)

            def predict(noisy, sigmas):  # [B, C, T, h, w] as the transformer takes them
                time = sigmas.to(latents.dtype) * 1000
                if noised is not None:
                    patches = (latents.shape[3] // PATCH) * (latents.shape[4] // PATCH)
                    time = objectives.token_levels(time, noised, patches)
                return denoiser(
                    hidden_states=noisy, timestep=time, encoder_hidden_states=padded,
                    return_dict=False,
                )[0]  # fmt: skip

            if noised is not None:
                return objectives.first_frame_loss(objective, batch, predict, noised)
            return objectives.flow_loss(objective, batch, predict, batch.get("mask"))

        def tokens(shape: tuple[int, ...]) -> int:  # a token a 1x2x2 patch: T x h/2 x w/2
            return shape[2] * (shape[3] // PATCH) * (shape[4] // PATCH)

        draw = objectives.flow_draw(objective, tokens, levels=self.noise_levels)
        # model.expert = "both": each expert's steps draw in its own range
        turns = [objectives.flow_draw(objective, tokens, levels=lv) for lv in self.level_turns]
        return objectives.Objective(turns[0] if turns else draw, wan_loss, turns)

    def vae_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """Cached latents [B, 16, T, h, w] are what its VAE decodes, frame axis and all."""
        return latent

    def pipeline_options(self, pipe) -> dict:
        return base.video_options(pipe, MAX_TOKENS)

    def preset_pipeline(self, source: parts.Source):
        from diffusers import UniPCMultistepScheduler, WanPipeline

        # the scheduler of the diffusers T2V repos (flow_shift 3.0)
        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        return WanPipeline(**self.preset_parts(source), tokenizer=_tokenizer(source),
                           scheduler=scheduler)  # fmt: skip
