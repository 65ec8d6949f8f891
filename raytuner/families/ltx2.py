"""LTX-2 (Lightricks' audio-video model), its video trained: clips of 8n + 1 frames and images
(one-frame clips). Its VAE makes [128, n + 1, H/32, W/32] latents (normalized per channel by
the VAE's ``latents_mean`` / ``latents_std`` buffers), one token a latent voxel; its transformer
takes time as sigma x 1000 and predicts noise - x0, and places frames in time by seconds (a
latent frame's pixel frames / fps: each sample's frame rate is the batch's ``fps``).

Its caption is Gemma 3's 49 hidden states of the prompt (left-padded to 1024 tokens), normed
per layer over the prompt's tokens and projected 188,160 -> 3,840 by the connectors'
``text_proj_in``: the cache stores those features of the caption's own tokens (``ragged``:
7,680 bytes a token in bfloat16), not the stacked states (367.5 KiB a token) nor the
connectors' padded outputs (7.5 MiB a caption a modality). The loss puts them back as the
pipeline holds them (the caption's rows, then zero rows up to 1,024: the connectors' registers
and RoPE depend on that length) and runs the video connector, frozen, without gradients.

Video alone is trained exactly as the audio-video model renders it without its audio: the
transformer runs with ``isolate_modalities`` (no audio-video cross-attention) and one zero
audio token, so the video prediction does not depend on the audio stream (which is then not
computed for more than that token). The LoRA targets the video attentions (``attn1``,
``attn2``), as Lightricks' trainer does for text-to-video."""

from __future__ import annotations

import torch

from raytuner import placement
from raytuner.families import base, objectives, parts
from raytuner.families.text import hidden_states_only

MAX_TOKENS = 1024  # LTX2Pipeline's max_sequence_length: every caption padded to it (left)
TEXT_WIDTH = 3840  # the connectors' caption_channels: text_proj_in's output
VAE_FACTOR = 32
FRAMES = 8  # the VAE's temporal factor: 8n + 1 frames -> n + 1 latent frames
# a frame's pixels above which the VAE encodes in tiles (diffusers' enable_tiling)
TILE_ABOVE = 768 * 512
# LTX2Pipeline's scheduler: log(shift) on the line through (1024 tokens, 0.95), (4096, 2.05)
SHIFT = objectives.ShiftLine(base_tokens=1024, base_shift=0.95, max_tokens=4096, max_shift=2.05)
COMFY = "diffusion_model."  # ComfyUI's (and Lightricks' trainer's) name of the denoiser
VIDEO_ATTENTION = tuple(f"{a}.{p}" for a in ("attn1", "attn2") for p in base.DIFFUSERS_ATTENTION)


def kohya_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """A block module's LoRA name in LTX-2's own layout: ComfyUI's ``diffusion_model.`` and the
    module's path (LTX-2's block names are diffusers'), with ``lora_down`` / ``lora_up`` /
    ``alpha``: what ComfyUI loads and diffusers' LTX-2 loader converts."""
    if not module.startswith("transformer_blocks."):
        return []
    return [(COMFY + module, (module,))]


def _kohya_names(config) -> list:
    return kohya_names


def _tokenizer(source: parts.Source):
    """Gemma 3's tokenizer of a folder or repo; a preset's: byte-level, built in code, adding a
    BOS as Gemma's does."""
    if not source.preset:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab |= {c: len(specials) + i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    length = parts.tokenizer_length("ltx2", source, "tokenizer", MAX_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", model_max_length=length,
    )  # fmt: skip


class _GemmaFeatures:
    """The connectors' input features of each caption's tokens: Gemma 3's hidden states through
    the pipeline's own prompt encoder (stripped, left-padded to its ``max_sequence_length``, all
    49 states stacked; Gemma makes the last token's logits alone: ``text.hidden_states_only``),
    then the connectors' per-layer norm and ``text_proj_in`` (what ``LTX2TextConnectors`` does
    before its 1-D transformers); each caption's rows first, zero rows after them (``ragged``:
    the cache stores its rows alone)."""

    ragged = ("text_features",)

    def __init__(self, tokenizer, encoder, project, width: int, device: str):
        from diffusers import LTX2Pipeline

        encoder = hidden_states_only(placement.move(encoder, device).eval())
        encoder.requires_grad_(False)
        self.pipe = LTX2Pipeline(
            scheduler=None, vae=None, audio_vae=None, text_encoder=encoder, tokenizer=tokenizer,
            connectors=None, transformer=None, vocoder=None,
        )  # fmt: skip
        self.project = placement.move(project, device).eval().requires_grad_(False)
        # encoders: what an encoder actor places over its GPUs or offloads (text.place)
        self.tokenizer, self.device, self.encoders = tokenizer, device, [encoder, self.project]
        self.width = width  # Gemma's hidden size: the stacked states are [B, L, width x layers]
        self.max_tokens = min(MAX_TOKENS, tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.ltx2.connectors import per_layer_masked_mean_norm

        if self.device == "meta":  # raytuner plan: the encoder's pass over every token
            ids = torch.zeros(len(captions), self.max_tokens, dtype=torch.int64, device="meta")
            states = self.pipe.text_encoder(input_ids=ids, output_hidden_states=True)
            hidden = torch.stack(states.hidden_states, dim=-1).flatten(2, 3)
            return {"text_features": self.project(hidden.to(self.project.weight))}
        embeds, mask = self.pipe._get_gemma_prompt_embeds(
            list(captions), max_sequence_length=self.max_tokens, device=torch.device(self.device)
        )
        hidden, kept = embeds.unflatten(2, (self.width, -1)), mask.sum(-1)
        normed = per_layer_masked_mean_norm(hidden, kept, embeds.device, padding_side="left")
        features = self.project(placement.inputs(normed, str(self.project.weight.device)))
        return {"text_features": _rows_first(features, kept.tolist())}

    def truncated(self, captions: list[str]) -> list[bool]:
        """Whether the pipeline cuts the (stripped) caption at its ``max_tokens``."""
        stripped = [c.strip() for c in captions]
        ids = self.tokenizer(stripped, truncation=False, verbose=False).input_ids
        return [len(i) > self.max_tokens for i in ids]


def _rows_first(features: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """Left-padded rows [B, L, D] (each caption's ``kept`` rows last) as each caption's rows
    first and zero rows after, cut to the longest caption."""
    longest = max(kept, default=0)
    out = features.new_zeros(features.shape[0], longest, features.shape[2])
    for i, n in enumerate(kept):
        if n:
            out[i, :n] = features[i, features.shape[1] - n :]
    return out


def video_context(connector, features: torch.Tensor, rows: int) -> torch.Tensor:
    """The video connector's output (``LTX2TextConnectors.video_connector``) [B, rows, D] of a
    batch's cached caption features [B, n, D] (each caption's rows, then zero rows): padded
    with zero rows to ``rows`` (the pipeline's length), its rows masked after each caption's
    own, as ``LTX2TextConnectors.forward`` makes it from the features (its registers then fill
    every row: the mask it returns is all ones). On the meta device (``raytuner plan``) every
    row counts."""
    padded = torch.nn.functional.pad(features, (0, 0, 0, rows - features.shape[1]))
    b, dtype = padded.shape[0], padded.dtype
    if padded.device.type == "meta":
        keep = torch.ones(b, rows, device="meta")
    else:  # the rows before each caption's trailing zero rows, on the device (no host sync)
        order = torch.arange(1, features.shape[1] + 1, device=padded.device)
        kept = (order * (features != 0).any(dim=-1)).amax(dim=1, keepdim=True)
        keep = (torch.arange(rows, device=padded.device) < kept).to(dtype)
    additive = ((keep - 1) * torch.finfo(dtype).max).to(dtype).view(b, 1, 1, rows)
    video, mask = connector(padded, additive)
    return video * (mask < 1e-6).to(video.dtype).view(b, rows, 1)


def video_coords(
    shape: tuple[int, int, int], fps: torch.Tensor, scale: tuple[int, int, int], offset: int
) -> torch.Tensor:
    """Each token's [start, end) in pixel frames (then seconds: / the sample's ``fps``), rows
    and columns, [B, 3, T*h*w, 2] for latents of ``shape`` (T, h, w), one token a voxel: the
    transformer's ``rope.prepare_video_coords`` with a frame rate per sample (its ``fps`` is
    one for the batch). ``scale``: the VAE's factors (time, rows, columns), ``offset``: the
    causal first frame's (a latent frame's pixel frames start ``scale[0] - offset`` early,
    clamped at 0)."""
    grid = torch.meshgrid(*(torch.arange(n, dtype=torch.float32, device=fps.device) for n in shape),
                          indexing="ij")  # fmt: skip
    start = torch.stack(grid).flatten(1)  # [3, N]
    factors = torch.tensor(scale, dtype=torch.float32, device=fps.device).view(3, 1, 1)
    coords = torch.stack([start, start + 1], dim=-1) * factors  # [3, N, 2]
    coords[0] = (coords[0] + offset - scale[0]).clamp(min=0)
    coords = coords.unsqueeze(0).repeat(fps.shape[0], 1, 1, 1)
    coords[:, 0] = coords[:, 0] / fps.float().view(-1, 1, 1)
    return coords


class LTX2(base.DiffusersFamily):
    name = "ltx2"
    objective_kind = "flow"
    # the VAE's 32 x the transformer's 1x1 patches (LTX2Pipeline's check_inputs: multiples of
    # 32, so 1280x720 is refused: 1280x704 or 1280x736); frames 8n + 1
    geometry = base.Geometry(
        default_resolution=768,
        pixel_multiple=32,
        pixel_grid=32,
        frame_multiple=FRAMES,
        seconds_positions=True,  # RoPE time: a latent frame's pixel frames / fps
        fps_argument="frame_rate",
        first_frame_clean=True,  # a timestep a token; frame 0 is one pixel frame
    )
    blocks = base.Blocks(
        swap=("transformer_blocks",),
        shard=("transformer_blocks",),
        compile=("LTX2VideoTransformerBlock",),
        float8_matmul=True,
    )
    # the video attentions (self, text), as Lightricks' text-to-video LoRA configs; the second
    # file in ComfyUI's layout (``diffusion_model.`` + the module: what its loader and Lightricks'
    # trainer read), LyCORIS files under the same names
    adapters = base.Adapters(
        targets=VIDEO_ATTENTION,
        files=base.LoraFiles("ltx2", "ltx2", "networks.lora", lycoris=COMFY + "{module}"),
        kohya_names=_kohya_names,
    )
    # LTX2Pipeline's default classifier-free guidance and steps
    guidance = base.Guidance(default_scale=3.0, default_steps=30)
    parts = base.Parts(
        classes={
            "transformer": "diffusers.LTX2VideoTransformer3DModel",
            "vae": "diffusers.AutoencoderKLLTX2Video",
            "text_encoder": "transformers.Gemma3ForConditionalGeneration",
            "connectors": "diffusers.pipelines.ltx2.LTX2TextConnectors",
            "audio_vae": "diffusers.AutoencoderKLLTX2Audio",
            "vocoder": "diffusers.pipelines.ltx2.vocoder.LTX2Vocoder",
        },
        denoiser="transformer",
        pipeline="diffusers.LTX2Pipeline",
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """Per sample of a bucket: 128-channel latents at 1/32 and 1/8 of the frames (8n + 1 ->
        n + 1; an image, one) and the connectors' 3,840-wide features of a caption of at most
        1,024 tokens (stored: its own tokens, 7,680 bytes each). 121 frames at 768x512:
        128x16x16x24 (6,144 tokens)."""
        t = base.latent_frames(self.geometry, frames)
        latent = (128, t, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "text_features": (MAX_TOKENS, TEXT_WIDTH)}

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return _image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoder = self.part(source, "text_encoder", device, weights)
        # the connectors' first layer alone (723 M of its 1.43 B parameters at full size)
        connectors = self.part(source, "connectors", "meta" if device == "meta" else "cpu",
                               weights)  # fmt: skip
        width = connectors.config.caption_channels
        return _GemmaFeatures(_tokenizer(source), encoder, connectors.text_proj_in, width, device)

    def loss(self, source: parts.Source, objective):
        objective = objectives.objective_of_kind(self, objective)
        rows = min(MAX_TOKENS, _tokenizer(source).model_max_length)
        config = parts.config(self.name, source, "transformer", self.parts.classes["transformer"])
        scale = tuple(config.get("vae_scale_factors", (FRAMES, VAE_FACTOR, VAE_FACTOR)))
        offset, audio_width = config.get("causal_offset", 1), config.get("audio_in_channels", 128)
        connector = _Frozen(lambda device: self._video_connector(source, device))

        def ltx2_loss(denoiser, batch) -> torch.Tensor:
            latents, features = batch["latent"], batch["text_features"]
            with torch.no_grad():
                context = video_context(connector.on(features.device), features, rows)
            b, _, t, h, w = latents.shape
            coords = video_coords((t, h, w), batch["fps"], scale, offset)
            ones = torch.ones(b, rows, dtype=torch.int64, device=latents.device)
            silent = torch.zeros(b, 1, audio_width, dtype=latents.dtype, device=latents.device)
            noised = objectives.noised_frames(batch.get("first_frame"), latents.shape)

            def predict(noisy, sigmas):  # [B, 128, T, h, w] packed a token a voxel
                tokens = noisy.flatten(2).transpose(1, 2)
                level = time = sigmas.to(latents.dtype) * 1000
                if noised is not None:  # a level a token: 0 on a first frame kept clean
                    time = objectives.token_levels(level, noised, h * w)
                out = denoiser(
                    hidden_states=tokens, audio_hidden_states=silent,
                    encoder_hidden_states=context, audio_encoder_hidden_states=context[:, :1],
                    timestep=time, audio_timestep=level, sigma=level,
                    encoder_attention_mask=ones, audio_encoder_attention_mask=ones[:, :1],
                    num_frames=t, height=h, width=w, video_coords=coords, audio_num_frames=1,
                    isolate_modalities=True, return_dict=False,
                )[0]  # fmt: skip
                return out.transpose(1, 2).reshape(noisy.shape)

            if noised is None:
                return objectives.flow_loss(objective, batch, predict, batch.get("mask"))
            return objectives.first_frame_loss(objective, batch, predict, noised)

        def tokens(shape: tuple[int, ...]) -> int:  # a token a latent voxel
            return shape[2] * shape[3] * shape[4]

        return objectives.Objective(objectives.flow_draw(objective, tokens, SHIFT), ltx2_loss)

    def _video_connector(self, source: parts.Source, device: str) -> torch.nn.Module:
        """The connectors' video 1-D transformer alone (354 M of their 1.43 B parameters at
        full size), frozen on ``device``: the connectors are loaded on the host (on the meta
        device for ``raytuner plan``), the rest dropped there."""
        meta = device == "meta"
        connectors = self.part(source, "connectors", "meta" if meta else "cpu", not meta)
        return placement.move(connectors.video_connector, device).requires_grad_(False)

    def pipeline_options(self, pipe) -> dict:
        return base.video_options(pipe, MAX_TOKENS)

    def preset_pipeline(self, source: parts.Source):
        from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

        # the scheduler of Lightricks/LTX-2's diffusers layout (diffusers' conversion script)
        scheduler = FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=SHIFT.base_shift, max_shift=SHIFT.max_shift,
            base_image_seq_len=SHIFT.base_tokens, max_image_seq_len=SHIFT.max_tokens,
            shift_terminal=0.1,
        )  # fmt: skip
        return LTX2Pipeline(**self.preset_parts(source), tokenizer=_tokenizer(source),
                            scheduler=scheduler)  # fmt: skip


class _Frozen:
    """A frozen part built on the device that first asks for it (the training worker's GPU, or
    the meta device where ``raytuner plan`` traces), kept there."""

    def __init__(self, build):
        self.build, self.built = build, {}

    def on(self, device: torch.device):
        key = str(device)
        if key not in self.built:
            self.built[key] = self.build(key)
        return self.built[key]


def _image_encoder(vae, device: str) -> base.ImageEncoder:
    """Latent mean and std of LTX-2's video VAE of images [B, 3, H, W] (one frame each) or clips
    [B, 3, F, H, W] (F = 8n + 1), [B, 128, T, h, w] (T = n + 1) in the transformer's scale:
    (mean - latents_mean) x scaling_factor / latents_std per channel (the VAE's buffers), as
    LTX2Pipeline normalizes latents (``base.clip_encoder``: frames over ``TILE_ABOVE`` in
    tiles)."""
    factor = vae.config.scaling_factor

    def scale(dist) -> tuple[torch.Tensor, torch.Tensor]:
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(dist.mean.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(dist.mean.dtype)
        return (dist.mean - mean) * factor / std, dist.std * factor / std

    return base.clip_encoder(vae, device, TILE_ABOVE, scale)
