"""Qwen-Image: a 60-block double-stream flow-matching transformer (20.43 B) on the 16-channel
latents of a causal 3-D VAE (an image is one frame; each channel normalized by the VAE's
``latents_mean`` / ``latents_std``), packed 2x2, conditioned on Qwen2.5-VL-7B's last hidden
states of the caption in the pipeline's prompt template, the template's leading tokens dropped,
with a mask over the caption's own tokens. It takes time as sigma and predicts noise - x0, as
diffusers' ``QwenImagePipeline`` and ``train_dreambooth_lora_qwen_image.py``.

Bytes a caption: 3,584 x 2 = 7,168 a token in bfloat16; the cache keeps a caption's own rows
(its tokens after the template's prefix, plus the template's 5 closing tokens), at most
``MAX_TOKENS`` = 512 (the pipeline's default ``max_sequence_length``: 3.67 MB; its limit 1024
would be 7.34 MB); a 77-token caption 82 rows, 587,776 bytes. The feed pads a batch's captions
with zero rows and the loss rebuilds the pipeline's mask from the rows kept."""

from __future__ import annotations

import torch

from raytuner import placement
from raytuner.families import base, objectives, parts
from raytuner.families.text import hidden_states_only, rows_kept

MAX_TOKENS = 512  # caption tokens the pipeline renders with by default
LIMIT = 1024  # the most it keeps (its tokenizer_max_length)
TEXT_WIDTH = 3584  # Qwen2.5-VL-7B's hidden size
VAE_FACTOR = 8
PATCH = 2  # the transformer's 2x2 patches
# Qwen-Image's scheduler: use_dynamic_shifting on the line 0.5 at 256 tokens, 0.9 at 8192
# (then shift_terminal 0.02 at inference); training draws on the same line
SHIFT_LINE = objectives.ShiftLine(base_tokens=256, base_shift=0.5, max_tokens=8192, max_shift=0.9)
SPECIALS = (  # Qwen2's special tokens the template and the VL model know
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip


def _tokenizer(source: parts.Source):
    """Qwen2's tokenizer of a folder or repo; a preset's is byte-level, built in code, with
    Qwen2's special tokens (the pipeline writes the template itself: no chat template)."""
    if not source.preset:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab |= {s: len(vocab) + i for i, s in enumerate(SPECIALS)}
    length = parts.tokenizer_length("qwen-image", source, "tokenizer", LIMIT)
    return Qwen2Tokenizer(
        vocab=vocab, merges=[], model_max_length=length, extra_special_tokens=list(SPECIALS[1:])
    )


def prefix_tokens(pipe) -> int:
    """How many tokens of the pipeline's template come before the caption (``user\\n``
    included): what ``_get_qwen_prompt_embeds`` drops from each caption's hidden states."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    return len(pipe.tokenizer(prefix).input_ids)


def _pipeline(pipe):
    """The pipeline with the drop of its template's prefix counted by its own tokenizer: the
    pipeline's 34 is the released Qwen2 tokenizer's count (whose pre-tokenizer splits the
    prefix's closing newline from any caption, so the count is the same alone), which a
    byte-level tokenizer (a preset's, or a folder saved from one) writes in more tokens."""
    pipe.prompt_template_encode_start_idx = prefix_tokens(pipe)
    return pipe


class _QwenText:
    """Qwen2.5-VL's last hidden states of each caption's own tokens through the pipeline's
    ``encode_prompt``: a batch, each caption's rows then zero rows up to the longest (``ragged``:
    the cache stores only its rows; the pipeline's mask is where the rows are)."""

    ragged = ("prompt_embeds",)

    def __init__(self, tokenizer, encoder, device: str):
        from diffusers import QwenImagePipeline

        encoder = hidden_states_only(placement.move(encoder, device).eval())
        encoder.requires_grad_(False)
        pipe = QwenImagePipeline(
            scheduler=None, vae=None, text_encoder=encoder, tokenizer=tokenizer, transformer=None
        )
        self.pipe, self.tokenizer, self.device = _pipeline(pipe), tokenizer, device
        self.encoders = [encoder]  # what an encoder actor may split or offload (text.place)
        self.max_tokens = min(MAX_TOKENS, tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if self.device == "meta":  # raytuner plan: the encoder's pass over all its tokens
            return {"prompt_embeds": self._every_token(captions)}
        embeds, _ = self.pipe.encode_prompt(
            list(captions), device=torch.device(self.device), max_sequence_length=self.max_tokens
        )
        return {"prompt_embeds": embeds}

    def _every_token(self, captions: list[str]) -> torch.Tensor:
        """The encoder's pass as the pipeline makes it, over the prefix and ``max_tokens``
        tokens, every row kept, without the padding mask (whose values the meta device has
        none of)."""
        drop = self.pipe.prompt_template_encode_start_idx
        tokens = self.tokenizer(
            self._templated(captions),
            padding="max_length",
            max_length=drop + self.max_tokens,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.pipe.text_encoder(input_ids=tokens.input_ids, output_hidden_states=True)
        return out.hidden_states[-1][:, drop:]

    def _templated(self, captions: list[str]) -> list[str]:
        return [self.pipe.prompt_template_encode.format(c) for c in captions]

    def truncated(self, captions: list[str]) -> list[bool]:
        """Whether the caption keeps more tokens than the pipeline renders with (the
        template's prefix not counted, its closing tokens counted)."""
        drop = self.pipe.prompt_template_encode_start_idx
        ids = self.tokenizer(self._templated(captions), truncation=False, verbose=False).input_ids
        return [len(i) - drop > self.max_tokens for i in ids]


def text_mask(text: torch.Tensor) -> torch.Tensor | None:
    """The pipeline's ``prompt_embeds_mask`` of a batch's caption rows [B, L, D] (each
    caption's rows, then zero rows up to the longest, as the text encoder and the feed make
    them): 1 on a caption's rows, 0 after; None where every caption fills the batch (the
    pipeline's own None) and on the meta device (``raytuner plan``: every row counts)."""
    if text.device.type == "meta":
        return None
    kept = torch.tensor(rows_kept(text), device=text.device)
    if bool((kept == text.shape[1]).all()):
        return None
    return (torch.arange(text.shape[1], device=text.device)[None] < kept[:, None]).long()


def _rope_tables(model):
    """Its rotary tables made on the CPU where they were made on meta (``raytuner plan``, a
    sharded worker's empty model): diffusers keeps them as plain attributes, not buffers, so
    nothing fills them later."""
    rope = getattr(model, "pos_embed", None)
    if rope is not None and rope.pos_freqs.is_meta:
        with torch.device("cpu"):
            fresh = type(rope)(rope.theta, rope.axes_dim, scale_rope=rope.scale_rope)
        rope.pos_freqs, rope.neg_freqs = fresh.pos_freqs, fresh.neg_freqs
    return model


class QwenImage(base.DiffusersFamily):
    name = "qwen-image"
    objective_kind = "flow"
    # the VAE's 8 x the 2x2 packing (the pipeline resizes other sides)
    geometry = base.Geometry(pixel_multiple=16, pixel_grid=16)
    blocks = base.Blocks(
        swap=("transformer_blocks",),
        shard=("transformer_blocks",),
        compile=("QwenImageTransformerBlock",),
        float8_matmul=True,
    )
    # adapters: the defaults, diffusers' attention projections to_q/k/v/out.0 of the 60 blocks'
    # image stream, as train_dreambooth_lora_qwen_image.py adapts them; the diffusers file,
    # which ComfyUI also loads (its module names are diffusers'); Qwen2.5-VL: not trained.
    # A LyCORIS file (LoKr, LoHa, DoRA) in SimpleTuner's names, ComfyUI's QwenImage rule
    adapters = base.Adapters(files=base.LoraFiles(lycoris="lycoris_{flat}"))

    # true classifier-free guidance: the scale is the pipeline's true_cfg_scale (default 4),
    # which guides only with a negative prompt: " " where none is set (its model card)
    guidance = base.Guidance(
        default_scale=4.0, scale_argument="true_cfg_scale", default_negative_prompt=" "
    )
    parts = base.Parts(
        classes={
            "transformer": "diffusers.QwenImageTransformer2DModel",
            "vae": "diffusers.AutoencoderKLQwenImage",
            "text_encoder": "transformers.Qwen2_5_VLForConditionalGeneration",
        },
        denoiser="transformer",
        pipeline="diffusers.QwenImagePipeline",
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """What Qwen-Image's encoders store per image of a bucket at most: the VAE's 16
        channels at 1/8 of the pixels (its one frame dropped) and Qwen2.5-VL-7B's 3584-wide
        rows of a caption of 512 tokens (a caption stores only its own: 7,168 bytes each)."""
        latent = (16, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "prompt_embeds": (MAX_TOKENS, TEXT_WIDTH)}

    def denoiser(self, source: parts.Source, device: str = "cpu", weights: bool = True):
        return _rope_tables(super().denoiser(source, device, weights))

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return _image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoder = self.part(source, "text_encoder", device, weights)
        return _QwenText(_tokenizer(source), encoder, device)

    def vae_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """Its VAE decodes videos: an image is one frame."""
        return latent.unsqueeze(2)

    def loss(self, source: parts.Source, objective):
        """Flow matching on the target's tokens; an edit pair's reference latents
        (``reference_latent``: Qwen-Image-Edit) go in after them, as its pipeline packs them,
        and the loss leaves their outputs out."""
        from diffusers import QwenImagePipeline

        objective = objectives.objective_of_kind(self, objective)
        pack, unpack = QwenImagePipeline._pack_latents, QwenImagePipeline._unpack_latents

        def qwen_image_loss(denoiser, batch) -> torch.Tensor:
            latents, text = batch["latent"], batch["prompt_embeds"]
            b, c, h, w = latents.shape
            refs = batch.get("reference_latent")  # [B, K, C, h, w]: the target's bucket
            count = 0 if refs is None else refs.shape[1]
            packed = [pack(refs[:, k], b, c, h, w) for k in range(count)]
            target = (h // PATCH) * (w // PATCH)
            # (frames, rows, columns) of the target's tokens, then of each reference's
            shapes = [[(1, h // PATCH, w // PATCH)] * (1 + count)] * b
            mask = text_mask(text)

            def predict(noisy, sigmas):
                out = denoiser(
                    hidden_states=torch.cat([pack(noisy, b, c, h, w), *packed], dim=1),
                    encoder_hidden_states=text,
                    encoder_hidden_states_mask=mask,
                    timestep=sigmas.to(latents.dtype),
                    img_shapes=shapes,
                    return_dict=False,
                )[0][:, :target]  # the loss: the target's tokens alone
                return unpack(out, h * VAE_FACTOR, w * VAE_FACTOR, VAE_FACTOR)[:, :, 0]

            return objectives.flow_loss(objective, batch, predict, batch.get("mask"))

        def tokens(shape: tuple[int, ...]) -> int:  # a token a 2x2 patch of latent pixels
            return (shape[2] // PATCH) * (shape[3] // PATCH)

        draw = objectives.flow_draw(objective, tokens, SHIFT_LINE)
        return objectives.Objective(draw, qwen_image_loss)

    def pipeline(self, source: parts.Source):
        return _pipeline(super().pipeline(source))

    def pipeline_options(self, pipe) -> dict:
        """Caption tokens as the cache kept them: the tokenizer's limit, at most 512."""
        return {"max_sequence_length": min(MAX_TOKENS, pipe.tokenizer.model_max_length)}

    def preset_pipeline(self, source: parts.Source):
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        line = SHIFT_LINE
        scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config
            use_dynamic_shifting=True,
            base_shift=line.base_shift,
            max_shift=line.max_shift,
            base_image_seq_len=line.base_tokens,
            max_image_seq_len=line.max_tokens,
            shift_terminal=0.02,
            time_shift_type="exponential",
        )
        return QwenImagePipeline(
            **self.preset_parts(source), tokenizer=_tokenizer(source), scheduler=scheduler
        )


def _image_encoder(vae, device: str) -> base.ImageEncoder:
    """Latent mean and std of the VAE's one frame of each image, normalized per channel as
    the pipeline undoes it: (mean - latents_mean) / latents_std."""
    vae = placement.move(vae, device).eval().requires_grad_(False)
    dtype = vae.dtype  # diffusers walks every module to answer: once, not each batch
    channels = (1, vae.config.z_dim, 1, 1)
    shift = torch.tensor(vae.config.latents_mean).view(channels)
    scale = 1.0 / torch.tensor(vae.config.latents_std).view(channels)

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = placement.inputs(pixels, device, dtype).unsqueeze(2)  # [B, 3, 1, H, W]
        dist = vae.encode(frames).latent_dist
        mean, std = dist.mean[:, :, 0], dist.std[:, :, 0]
        s = scale.to(mean.device, mean.dtype)
        return (mean - shift.to(mean.device, mean.dtype)) * s, std * s

    return encode
