"""Z-Image (Base and Turbo): a single-stream flow-matching transformer on Flux.1's 16-channel
latents, conditioned on a variable-length caption: the second-to-last hidden states of Qwen3-4B
over the chat-templated prompt, only the prompt's tokens (no padding, no mask). Its transformer
takes time as 1 - sigma (1 = clean) and predicts x0 - noise: the sign and time convention of
diffusers' ``ZImagePipeline`` and ``train_dreambooth_lora_z_image.py``."""

from __future__ import annotations

import torch

from raytuner import placement
from raytuner.families import base, objectives, parts
from raytuner.families.text import rows_kept

MAX_TOKENS = 512  # caption tokens the pipeline keeps, chat template included
TEXT_WIDTH = 2560  # Qwen3-4B's hidden size: the released model's caption features
VAE_FACTOR = 8
PATCH = 2  # the transformer's 2x2 patches (all_patch_size)


def _tokenizer(source: parts.Source):
    """Qwen3's tokenizer of a folder or repo; a preset's is byte-level, built in code, with the
    chat markers Qwen3's template writes and a template that writes them as Qwen3's does for a
    user turn and the assistant's turn (``enable_thinking`` as the pipeline passes it)."""
    if not source.preset:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.repo, **source.hub("tokenizer"))
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab |= {s: len(vocab) + i for i, s in enumerate(specials)}
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    length = parts.tokenizer_length("z-image", source, "tokenizer", MAX_TOKENS)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=length,
        chat_template=template,
        extra_special_tokens=specials[1:],
    )


class _QwenText:
    """Qwen3's second-to-last hidden states of each caption's tokens, through the pipeline's
    own ``encode_prompt`` (one [tokens, width] tensor a caption), as a batch: each caption's
    rows, then zero rows up to the longest (``ragged``: the cache stores only its rows)."""

    ragged = ("prompt_embeds",)

    def __init__(self, tokenizer, encoder, device: str):
        from diffusers import ZImagePipeline

        encoder = placement.move(encoder, device).eval().requires_grad_(False)
        self.pipe = ZImagePipeline(
            tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None, scheduler=None
        )
        self.tokenizer, self.device, self.encoders = tokenizer, device, [encoder]
        self.max_tokens = min(MAX_TOKENS, tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if self.device == "meta":  # raytuner plan: the pipeline's pass over all its tokens
            return {"prompt_embeds": self._every_token(captions)}
        embeds, _ = self.pipe.encode_prompt(
            list(captions),  # the pipeline writes the templated prompts into the list it gets
            device=torch.device(self.device),
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_tokens,
        )
        return {"prompt_embeds": torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)}

    def _every_token(self, captions: list[str]) -> torch.Tensor:
        """The encoder's pass as the pipeline makes it, over all ``max_tokens`` tokens, every
        row kept, without the padding mask (the selection of the caption's rows and the causal
        mask's shortcut read the mask's values, which the meta device has none of)."""
        tokens = self.tokenizer(
            self._templated(captions),
            padding="max_length",
            max_length=self.max_tokens,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        return self.pipe.text_encoder(
            input_ids=tokens.input_ids, output_hidden_states=True
        ).hidden_states[-2]

    def _templated(self, captions: list[str]) -> list[str]:
        """The captions in Qwen3's chat template, as the pipeline writes them."""
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": c}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for c in captions
        ]

    def truncated(self, captions: list[str]) -> list[bool]:
        """Whether the templated caption has more tokens than the pipeline keeps."""
        ids = self.tokenizer(self._templated(captions), truncation=False, verbose=False).input_ids
        return [len(i) > self.max_tokens for i in ids]


def captions_of(text: torch.Tensor) -> list[torch.Tensor]:
    """A batch's caption features [B, L, D] (each caption's rows, then zero rows up to the
    longest, as the text encoder and the feed make them) as the transformer takes them: a list
    of each caption's own rows. A hidden state's row is never all zeros; on the meta device
    (``raytuner plan``) every row counts."""
    if text.device.type == "meta":
        return list(text.unbind(0))
    kept = rows_kept(text)
    return [rows[:n] for rows, n in zip(text.unbind(0), kept, strict=True)]


class ZImage(base.DiffusersFamily):
    name = "z-image"
    objective_kind = "flow"
    # the VAE's 8 x the transformer's 2x2 patches (the pipeline refuses other sides)
    geometry = base.Geometry(pixel_multiple=16, pixel_grid=16)
    blocks = base.Blocks(
        swap=("noise_refiner", "context_refiner", "layers"),
        shard=("noise_refiner", "context_refiner", "layers"),
        compile=("ZImageTransformerBlock",),
        float8_matmul=True,
    )
    # adapters: the defaults (diffusers' attention projections of every block: the 30 layers
    # and both refiners, as train_dreambooth_lora_z_image.py adapts them); the diffusers file,
    # which ComfyUI also loads (its z_image_to_diffusers key map); Qwen3: not trained

    # the diffusers file alone for a LoRA (ComfyUI reads it); a LyCORIS file's keys: the
    # diffusers names under ComfyUI's name of the denoiser (its Lumina2 branch maps them, as
    # diffusers' Z-Image LoKr loader reads them)
    adapters = base.Adapters(files=base.LoraFiles(lycoris="diffusion_model.{module}"))
    # ZImagePipeline's default guidance_scale; Z-Image-Turbo renders in 8 steps without CFG
    # (guidance_scale 0: the pipeline's CFG is on above 0), as Tongyi-MAI's inference code does
    guidance = base.Guidance(
        default_scale=5.0,
        distilled_steps=8,
        distilled_scale=0.0,
        distilled_repos=("Tongyi-MAI/Z-Image-Turbo",),
    )
    parts = base.Parts(
        classes={
            "transformer": "diffusers.ZImageTransformer2DModel",
            "vae": "diffusers.AutoencoderKL",
            "text_encoder": "transformers.Qwen3Model",
        },
        denoiser="transformer",
        pipeline="diffusers.ZImagePipeline",
    )

    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]:
        """What Z-Image's encoders store per image of a bucket at most: Flux.1's 16-channel
        latents at 1/8 of the pixels and Qwen3-4B's 2560-wide features of a caption of the
        pipeline's 512 tokens (a caption stores only its own tokens: 5,120 bytes each)."""
        latent = (16, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "prompt_embeds": (MAX_TOKENS, TEXT_WIDTH)}

    def image_encoder(self, source: parts.Source, device: str, weights: bool = True):
        return base.kl_image_encoder(self.part(source, "vae", device, weights), device)

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoder = self.part(source, "text_encoder", device, weights)
        return _QwenText(_tokenizer(source), encoder, device)

    def loss(self, source: parts.Source, objective):
        objective = objectives.objective_of_kind(self, objective)

        def z_image_loss(denoiser, batch) -> torch.Tensor:
            latents = batch["latent"]
            captions = captions_of(batch["prompt_embeds"])

            def predict(noisy, sigmas):
                # its time runs the other way (1 = clean), its output is x0 - noise
                out = denoiser(
                    list(noisy.unsqueeze(2).unbind(0)),
                    1 - sigmas.to(latents.dtype),
                    captions,
                    return_dict=False,
                )[0]
                return -torch.stack(out).squeeze(2)

            return objectives.flow_loss(objective, batch, predict, batch.get("mask"))

        def tokens(shape: tuple[int, ...]) -> int:  # a token a 2x2 patch of latent pixels
            return (shape[2] // PATCH) * (shape[3] // PATCH)

        return objectives.Objective(objectives.flow_draw(objective, tokens), z_image_loss)

    def pipeline_options(self, pipe) -> dict:
        """Caption tokens as the cache kept them: the tokenizer's limit, at most 512."""
        return {"max_sequence_length": min(MAX_TOKENS, pipe.tokenizer.model_max_length)}

    def preset_pipeline(self, source: parts.Source):
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

        return ZImagePipeline(
            **self.preset_parts(source),
            tokenizer=_tokenizer(source),
            # the scheduler of Tongyi-MAI's inference code (static shift 3, as ai-toolkit trains)
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        )
