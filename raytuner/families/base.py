"""The family Protocol, the records a family is made of, and the body every diffusers-backed
family shares (``DiffusersFamily``).

A family knows how to load its parts (VAE, text encoders, denoiser, pipeline), how to encode
images and captions for the cache, and its training objective (``families/objectives.py``).
Its facts are a few frozen records, each one concern that generic code reads (``Geometry``,
``Blocks``, ``Adapters``, ``Guidance``, ``Parts``); its behaviour is the methods of
``Family``. Generic code reads these and never asks which family it holds.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn

from raytuner import placement
from raytuner.families import mixture
from raytuner.families.objectives import Batch, Loss
from raytuner.families.parts import Source, class_of, load
from raytuner.families.records import (  # noqa: F401 (re-exported: base.Geometry ...)
    DIFFUSERS_ATTENTION,
    Adapters,
    Blocks,
    Expert,
    Geometry,
    Guidance,
    LoraFiles,
    Parts,
    References,
    latent_frames,
)
from raytuner.families.text import TextEncoder

# pixels [B,3,H,W] in [-1,1] -> (latent mean, latent std), both in the denoiser's latent scale;
# a video family's (``Geometry.frame_multiple`` > 0) also takes clips [B,3,F,H,W] (F = 1 + a
# multiple of frame_multiple) and returns [B,C,T,h,w] latents, T = (F - 1) // frame_multiple + 1,
# always with the frame axis (an image [B,3,H,W]: T = 1)
ImageEncoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
class Family(Protocol):
    """What generic code asks of a model family: its name, its objective's kind, six records
    and ten methods (every shipped family is a ``DiffusersFamily``)."""

    name: str  # the key of FAMILIES (model.family)
    objective_kind: str  # "ddpm" or "flow": the [objective.<kind>] settings its loss takes
    geometry: Geometry
    blocks: Blocks
    adapters: Adapters
    guidance: Guidance
    parts: Parts
    references: References
    # a mixture of experts by noise level: its models (``model.expert`` picks the one a run
    # trains); empty: one denoiser
    experts: tuple[Expert, ...]
    expert: Expert | None  # the one this family object trains (``with_expert``); None: all
    turns: tuple[Expert, ...]  # model.expert = "both": the experts trained in turn; else empty
    lora_part: str  # the part its diffusers LoRA file's keys name (an expert's: "transformer")

    # parts from a preset or a folder/hub repo, frozen weights in ``source.dtype`` on ``device``;
    # weights=False: the architecture alone, random weights (``raytuner plan``: on "meta")
    def image_encoder(self, source: Source, device: str, weights: bool = True) -> ImageEncoder: ...
    def text_encoder(self, source: Source, device: str, weights: bool = True) -> TextEncoder: ...
    def denoiser(self, source: Source, device: str = "cpu", weights: bool = True) -> nn.Module: ...
    # objective: its kind's settings, DdpmObjective or FlowObjective (ObjectiveConfig.for_family)
    def loss(self, source: Source, objective) -> Loss: ...
    # the diffusers layout; adapter_config: the peft LoraConfig as a dict (rank, alpha, targets);
    # text_encoders: a text encoder's part -> (its LoRA's state, its adapter config), if trained
    def save_lora(
        self, directory: str, lora_state: dict, adapter_config: dict, text_encoders=None
    ) -> None: ...
    def pipeline(self, source: Source): ...  # a diffusers DiffusionPipeline, on the CPU
    # pipeline-call arguments that match how the cache was encoded (caption token count)
    def pipeline_options(self, pipe) -> dict: ...
    # shapes of the tensors the cache stores per image of a bucket, for the released full-size
    # model ("latent" and each text tensor): what `raytuner bench feed` writes; a video family's
    # latent per sample of ``frames`` frames is [C, T, h, w] (T = latent_frames(geometry,
    # frames): an image, 1), an image family's [C, h, w] (it ignores ``frames``)
    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]: ...
    # a single file's tensors of ``part`` (the keys under its prefix) in the layout diffusers'
    # ``from_single_file`` converts (most families: as they are)
    def single_file_state(self, part: str, state: dict[str, torch.Tensor]) -> dict: ...
    # cached latents as its VAE's decode takes them (an image family whose VAE is a video VAE:
    # a frame axis added; a video family's [B, C, T, h, w] are as they are)
    def vae_latent(self, latent: torch.Tensor) -> torch.Tensor: ...
    # ``n`` samples of the cached tensors of ``shapes`` (``cache_shapes``, or what its encoders
    # make) at the bucket ``size`` (width, height), as the training feed hands them to ``loss``:
    # random latent and text tensors in ``dtype``, the per-image conditioning, and what else its
    # loss needs (``raytuner plan`` traces one on "meta", ``bench step`` trains on one)
    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> Batch: ...


class DiffusersFamily(ABC):
    """A ``Family`` whose parts are diffusers / transformers models and whose pipeline is a
    diffusers pipeline: the bodies every such family shares. A family file sets the records
    (class attributes) and defines what is its own: its encoders, its loss, its cache shapes and
    the pipeline of its presets; it overrides the rest only where it really differs."""

    name: str
    objective_kind: str
    geometry: Geometry
    blocks: Blocks
    adapters: Adapters = Adapters()
    guidance: Guidance
    references: References = References()
    parts: Parts
    experts: tuple[Expert, ...] = ()
    expert: Expert | None = None
    turns: tuple[Expert, ...] = ()

    def with_expert(self, name: str):
        """This family training the expert ``name`` (``model.expert``): its denoiser is that
        expert's part, its loss draws noise levels in its range; ``"both"``: every expert in
        one run, in turn (``turns``; its denoiser a ``mixture.ExpertMixture``). A ValueError
        names the experts when ``name`` is none of them, or is missing where the family has
        experts."""
        if not self.experts and not name:
            return self
        if not self.experts:
            raise ValueError(
                f"model.expert = {name!r}: {self.name} has one denoiser; leave model.expert out"
            )
        names = {e.name: e for e in self.experts}
        variant = copy.copy(self)
        if name == mixture.BOTH:
            variant.expert, variant.turns = None, self.experts
            variant.parts = replace(self.parts, denoiser=self.experts[0].part)
            return variant
        if name not in names:
            listed = "; ".join(f"{e.name!r}: {e.about}" for e in self.experts)
            raise ValueError(
                f"model.expert = {name!r}: {self.name} is a mixture of experts by noise level; "
                f"set model.expert to {listed}; or {mixture.BOTH!r}: all of them in one run, "
                "in turn (model.expert_switch_every steps each)"
            )
        variant.expert, variant.turns = names[name], ()
        variant.parts = replace(self.parts, denoiser=names[name].part)
        return variant

    @property
    def noise_levels(self) -> tuple[float, float]:
        """The noise levels ``[low, high)`` its training draws: its expert's, or all."""
        return (self.expert.low, self.expert.high) if self.expert else (0.0, 1.0)

    @property
    def level_turns(self) -> tuple[tuple[float, float], ...]:
        """The noise levels each expert of ``turns`` draws at its steps, in turn; empty for a
        family that trains one denoiser."""
        return tuple((e.low, e.high) for e in self.turns)

    @property
    def lora_part(self) -> str:
        """The part name its diffusers LoRA file's keys carry (``<part>.blocks...``): its
        denoiser's, unless its pipeline saves the LoRA of every expert under another."""
        return self.parts.denoiser

    @property
    def lora_load(self) -> dict:
        """``load_lora_weights``' keywords that put its LoRA on its denoiser."""
        return dict(self.expert.lora_load) if self.expert else {}

    @abstractmethod
    def image_encoder(self, source: Source, device: str, weights: bool = True) -> ImageEncoder: ...

    @abstractmethod
    def text_encoder(self, source: Source, device: str, weights: bool = True) -> TextEncoder: ...

    @abstractmethod
    def loss(self, source: Source, objective) -> Loss: ...

    @abstractmethod
    def cache_shapes(
        self, width: int, height: int, frames: int = 1
    ) -> dict[str, tuple[int, ...]]: ...

    @abstractmethod
    def preset_pipeline(self, source: Source):
        """The pipeline of a preset: its ``preset_parts``, with tokenizers and scheduler."""

    def part(self, source: Source, name: str, device="cpu", weights: bool = True) -> nn.Module:
        """One of its parts (``parts.load``), its class from ``parts.classes``."""
        return load(self, source, name, self.parts.classes[name], device=device, weights=weights)

    def preset_parts(self, source: Source) -> dict[str, nn.Module]:
        """Every part of a preset, by its pipeline component's name."""
        return {name: self.part(source, name) for name in self.parts.classes}

    def denoiser(self, source: Source, device: str = "cpu", weights: bool = True) -> nn.Module:
        """Its denoiser's part; every expert of ``turns`` in one ``ExpertMixture``."""
        if self.turns:
            built = {e.part: self.part(source, e.part, device, weights) for e in self.turns}
            return mixture.ExpertMixture(built)
        return self.part(source, self.parts.denoiser, device, weights)

    def save_lora(
        self, directory: str, lora_state: dict, adapter_config: dict, text_encoders=None
    ) -> None:
        pipeline, part = class_of(self.parts.pipeline), self.parts.denoiser
        save_lora(pipeline, part, directory, lora_state, adapter_config, text_encoders)

    def pipeline(self, source: Source):
        """A preset's pipeline (``preset_pipeline``) in eval mode, as ``from_pretrained`` leaves
        one; a folder's or hub repo's, with a single file's parts loaded from it."""
        if source.preset:
            return preset_pipeline(self.preset_pipeline(source))
        return class_of(self.parts.pipeline).from_pretrained(
            source.repo,
            **dict.fromkeys(self.parts.unused),
            **hub_kwargs(source),
            **file_parts(self.part, source, self.parts.single_file),
        )

    def pipeline_options(self, pipe) -> dict:
        """None: the pipeline tokenizes captions as the cache did."""
        return {}

    def single_file_state(self, part: str, state: dict) -> dict:
        """Its single file's tensors are in the layout diffusers' converters read."""
        return state

    def vae_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """Cached latents [B, C, H, W] as its VAE decodes them: as they are."""
        return latent

    def example_batch(
        self, shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype
    ) -> Batch:
        """Random cached tensors and the per-image conditioning (``example_batch``)."""
        return example_batch(shapes, n, size, device, dtype)


EXAMPLE_FPS = 24.0  # an example batch's frame rate ("fps"): a common clip rate


def example_batch(shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype) -> Batch:
    """What every family's example batch holds (``Family.example_batch``): random tensors of
    ``shapes`` in ``dtype`` (the feed reads the cache in float32), and the conditioning the
    feed adds to every row, here an uncropped image of the bucket's size sampled at 24 fps
    (``"fps"``: each row's source's rate, which a family with ``seconds_positions`` reads)."""
    batch = {k: torch.randn(n, *s, device=device, dtype=dtype) for k, s in shapes.items()}
    width, height = size

    def rows(pair: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([pair] * n, dtype=torch.int64).to(device)

    return batch | {
        "original_size": rows((height, width)),
        "crop_top_left": rows((0, 0)),
        "target_size": rows((height, width)),
        "fps": torch.full((n,), EXAMPLE_FPS, dtype=torch.float32, device=device),
    }


def with_one_reference(batch: Batch, device, dtype: torch.dtype) -> Batch:
    """An example batch of an edit family: each sample with one reference latent of its
    target's shape (``reference_latent`` [B, 1, ...], ``reference_count``), as the reader
    hands a pair."""
    n, shape = batch["latent"].shape[0], batch["latent"].shape[1:]
    reference = torch.randn(n, 1, *shape, device=device, dtype=dtype)
    count = torch.ones(n, dtype=torch.int64, device=device)
    return batch | {"reference_latent": reference, "reference_count": count}


def preset_pipeline(pipe):
    """A pipeline built from a preset's parts, every model in eval mode as ``from_pretrained``
    leaves them."""
    for part in pipe.components.values():
        if isinstance(part, nn.Module):
            part.eval()
    return pipe


def file_parts(load_part, source: Source, parts: tuple[tuple[str, str], ...]) -> dict:
    """The pipeline components a single-file checkpoint holds, loaded from it (``{}`` for a
    folder or hub repo): passed to ``from_pretrained`` of the config repo, which then loads
    only the rest (tokenizers, scheduler, the parts the file lacks)."""
    return {name: load_part(source, name) for name, _ in parts} if source.single_file else {}


def save_lora(
    pipeline_cls, part: str, directory: str, lora_state: dict, adapter_config: dict,
    text_encoders=None,
):  # fmt: skip
    """The diffusers layout of a LoRA on the pipeline's ``part`` (``unet`` / ``transformer``)
    and on its ``text_encoders`` (a text encoder's part -> (state, adapter config):
    ``text_encoder``, ``text_encoder_2``), through the pipeline class's own
    ``save_lora_weights``, each with its peft adapter config so a loader applies its alpha."""
    layers = {part: (lora_state, adapter_config)} | (text_encoders or {})
    kwargs = {}
    for name, (state, config) in layers.items():
        kwargs |= {f"{name}_lora_layers": state, f"{name}_lora_adapter_metadata": config}
    pipeline_cls.save_lora_weights(directory, **kwargs)


def hub_kwargs(source: Source) -> dict:
    """``from_pretrained`` keyword arguments for a whole pipeline folder or hub repo
    (``source.repo``)."""
    return source.hub() | {"torch_dtype": source.dtype}


def kl_image_encoder(vae, device: str) -> ImageEncoder:
    """Latent mean and std of an AutoencoderKL, in the denoiser's scale: (mean - shift_factor)
    x scaling_factor, as its pipelines decode latent / scaling_factor + shift_factor (Flux.1's
    VAE has a shift; Stable Diffusion's none)."""
    vae = placement.move(vae, device).eval().requires_grad_(False)
    scale, shift = vae.config.scaling_factor, vae.config.get("shift_factor") or 0.0
    dtype = vae.dtype  # diffusers walks every module to answer: once, not each batch

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = vae.encode(placement.inputs(pixels, device, dtype)).latent_dist
        return (dist.mean - shift) * scale, dist.std * scale

    return encode


def video_options(pipe, max_tokens: int) -> dict:
    """A video family's ``pipeline_options``: caption tokens as the cache kept them (its
    tokenizer's limit, at most the pipeline's ``max_tokens``), one frame: an image (a clip's
    render sets its own ``num_frames``)."""
    return {
        "max_sequence_length": min(max_tokens, pipe.tokenizer.model_max_length),
        "num_frames": 1,
    }


def clip_encoder(vae, device: str, tile_above: int, scale) -> ImageEncoder:
    """Latent mean and std of a video family's 3-D VAE of images [B, 3, H, W] (one frame each)
    or clips [B, 3, F, H, W], [B, C, T, h, w] with the frame axis always, in its transformer's
    scale (``scale``: the VAE's latent distribution -> (mean, std), the family's
    normalization). A batch is encoded a sample at a time (slicing: a batch of clips costs one
    clip's memory), frames of more than ``tile_above`` pixels in tiles."""
    vae = placement.move(vae, device).eval().requires_grad_(False)
    vae.enable_slicing()
    dtype = vae.dtype

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames = placement.inputs(pixels, device, dtype)
        if frames.ndim == 4:  # an image: a one-frame clip [B, 3, 1, H, W]
            frames = frames.unsqueeze(2)
        if frames.shape[-1] * frames.shape[-2] > tile_above:
            vae.enable_tiling()
        else:
            vae.disable_tiling()
        return scale(vae.encode(frames).latent_dist)

    return encode
