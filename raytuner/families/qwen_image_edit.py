"""Qwen-Image-Edit-2509 (``QwenImageEditPlusPipeline``: 1 to 3 reference images): Qwen-Image's
transformer, VAE and Qwen2.5-VL trained to edit. A reference image conditions it twice, as the
pipeline does:

- its latent (the VAE's, normalized as the target's) is packed and concatenated after the
  target's image tokens, ``img_shapes`` listing the target then each reference; the loss (Qwen-
  Image's, which takes a batch's ``reference_latent``) is the target's tokens alone;
- Qwen2.5-VL sees it: the prompt ``Picture 1: <|vision_start|><|image_pad|><|vision_end|>…`` then
  the instruction in the edit template, the image resized to about 384 x 384 pixels at its aspect
  ratio (``CONDITION_IMAGE_SIZE``, multiples of 32) and then by the processor (multiples of 28),
  the template's system prefix dropped. The text row is thus of the caption *and* its references
  (``References.text``): the cache keys it by both (``keys.pair_caption_key``) and encodes it once
  the pairs are known (``preprocess/pair_text.py``).

raytuner's rule for the reference's latent: the target's bucket (as Flux.1 Kontext's), where the
pipeline renders from a reference resized to about 1024 x 1024 at its own aspect ratio; at a
1024 px resolution the two agree to a bucket's rounding. Everything else (the loss's flow
matching, the text mask, the LoRA layout, the guidance) is Qwen-Image's (``qwen_image``)."""

from __future__ import annotations

import os

import torch

from raytuner.families import base, parts
from raytuner.families.qwen_image import (
    MAX_TOKENS,
    TEXT_WIDTH,
    VAE_FACTOR,
    QwenImage,
    _QwenText,
    _tokenizer,
)
from raytuner.families.text import hidden_states_only

# Qwen2.5-VL's rows of one reference at the pipeline's condition size (384 x 384: 14 x 14
# merged 28 px patches) and its "Picture n: <|vision_start|>…<|vision_end|>" wrapping
REFERENCE_TOKENS = 196 + 8
MOST = 3  # Qwen-Image-Edit-2509's references (its model card: 1 to 3 images)


def _processor_class():
    from transformers import Qwen2VLProcessor

    class ImagesProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor of images and text without its video processor: the released
        one needs torchvision, which raytuner does not install, for videos the pipeline never
        passes. It saves its image processor and tokenizer (a folder loads it back through
        ``processor``)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory, **kwargs):
            os.makedirs(save_directory, exist_ok=True)
            self.image_processor.save_pretrained(save_directory)
            self.tokenizer.save_pretrained(save_directory)

    return ImagesProcessor


def processor(source: parts.Source, tokenizer):
    """The pipeline's ``processor``: Qwen2-VL's image processor (the PIL one: the same pixels
    with or without torchvision) of a folder's or repo's ``processor`` subfolder, a preset's
    default one (patches of 14, merged 2 x 2), with the text encoder's tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if source.preset:
        images = Qwen2VLImageProcessorPil()
    else:
        images = Qwen2VLImageProcessorPil.from_pretrained(source.repo, **source.hub("processor"))
    return _processor_class()(image_processor=images, tokenizer=tokenizer)


def _edit_pipeline(pipe):
    """The pipeline with the drop of its edit template's system prefix counted by its own
    processor's tokenizer (the pipeline's 64 is the released tokenizer's count)."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(pipe.processor.tokenizer(prefix).input_ids)
    return pipe


def condition_images(pipe, images) -> list:
    """The reference images as the pipeline hands them to Qwen2.5-VL: each resized to about
    384 x 384 at its aspect ratio, sides multiples of 32 (``calculate_dimensions``)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        CONDITION_IMAGE_SIZE,
        calculate_dimensions,
    )

    out = []
    for image in images:
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        out.append(pipe.image_processor.resize(image, height, width))
    return out


class _EditText(_QwenText):
    """Qwen2.5-VL's last hidden states of each caption with its reference images, through the
    edit pipeline's ``encode_prompt`` (its template, the images' vision tokens, the prefix
    dropped): the rows of a caption alone where it has none. ``references``: each caption's
    images (PIL, RGB), or None."""

    def __init__(self, tokenizer, encoder, device: str, source: parts.Source):
        from diffusers import QwenImageEditPlusPipeline

        from raytuner import placement

        encoder = hidden_states_only(placement.move(encoder, device).eval())
        encoder.requires_grad_(False)
        pipe = QwenImageEditPlusPipeline(
            scheduler=None, vae=None, text_encoder=encoder, tokenizer=tokenizer,
            processor=processor(source, tokenizer), transformer=None,
        )  # fmt: skip
        self.pipe, self.tokenizer, self.device = _edit_pipeline(pipe), tokenizer, device
        self.encoders = [encoder]
        # what `raytuner plan` traces (``_every_token``): a caption of 512 tokens and one
        # reference's vision tokens (the vision tower's own pass not counted)
        self.max_tokens = min(MAX_TOKENS + REFERENCE_TOKENS, tokenizer.model_max_length)

    @torch.no_grad()
    def __call__(self, captions: list[str], references=None) -> dict[str, torch.Tensor]:
        if self.device == "meta":  # raytuner plan: the encoder's pass over its text tokens
            return {"prompt_embeds": self._every_token(captions)}
        device = torch.device(self.device)
        references = references or [[] for _ in captions]
        rows = []
        for caption, images in zip(captions, references, strict=True):
            images = condition_images(self.pipe, images) if images else None
            embeds, _ = self.pipe.encode_prompt([caption], image=images, device=device)
            rows.append(embeds[0])
        longest = max(r.shape[0] for r in rows)
        return {"prompt_embeds": torch.stack([_padded(r, longest) for r in rows])}

    def truncated(self, captions: list[str]) -> list[bool]:
        """None: the edit pipeline keeps every token of a caption (no max_sequence_length)."""
        return [False] * len(captions)


def _padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(length - rows.shape[0], rows.shape[1])])


class QwenImageEdit(QwenImage):
    name = "qwen-image-edit"
    # up to 3 references (QwenImageEditPlusPipeline's image=, a list), also seen by the text
    # encoder; its pipeline renders only from one
    references = base.References(argument="image", most=MOST, text=True, required=True)
    parts = base.Parts(
        classes=dict(QwenImage.parts.classes),
        denoiser="transformer",
        pipeline="diffusers.QwenImageEditPlusPipeline",
        # loaded by raytuner (``processor``): the released one needs torchvision
        unused=("processor",),
    )

    def cache_shapes(self, width: int, height: int, frames: int = 1) -> dict[str, tuple[int, ...]]:
        """Qwen-Image's, a caption's rows with one reference's vision tokens more."""
        latent = (16, height // VAE_FACTOR, width // VAE_FACTOR)
        return {"latent": latent, "prompt_embeds": (MAX_TOKENS + REFERENCE_TOKENS, TEXT_WIDTH)}

    def text_encoder(self, source: parts.Source, device: str, weights: bool = True):
        encoder = self.part(source, "text_encoder", device, weights)
        return _EditText(_tokenizer(source), encoder, device, source)

    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> base.Batch:
        """Qwen-Image's, with one reference latent of the target's shape per sample."""
        batch = super().example_batch(shapes, n, size, device, dtype)
        return base.with_one_reference(batch, device, dtype)

    def pipeline(self, source: parts.Source):
        pipe = base.DiffusersFamily.pipeline(self, source)
        if not source.preset:  # loaded without it (parts.unused): raytuner's
            pipe.register_modules(processor=processor(source, pipe.tokenizer))
        return _edit_pipeline(pipe)

    def pipeline_options(self, pipe) -> dict:
        """None: the edit pipeline keeps every caption token (its max_sequence_length is
        only checked), as the cache does."""
        return {}

    def preset_pipeline(self, source: parts.Source):
        from diffusers import QwenImageEditPlusPipeline

        qwen = super().preset_pipeline(source)
        return QwenImageEditPlusPipeline(
            **qwen.components, processor=processor(source, qwen.tokenizer)
        )
