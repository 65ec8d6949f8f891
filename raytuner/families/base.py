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
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn

from raytuner import placement
from raytuner.families.objectives import Batch, Loss
from raytuner.families.parts import Source, class_of, load
from raytuner.families.text import TextEncoder, TextEncoderLora

# pixels [B,3,H,W] in [-1,1] -> (latent mean, latent std), both in the denoiser's latent scale;
# a video family's (``Geometry.frame_multiple`` > 0) also takes clips [B,3,F,H,W] (F = 1 + a
# multiple of frame_multiple) and returns [B,C,T,h,w] latents, T = (F - 1) // frame_multiple + 1,
# always with the frame axis (an image [B,3,H,W]: T = 1)
ImageEncoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# what peft adapts in a diffusers attention (every family's denoiser has them): lora.target_modules
DIFFUSERS_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """The image sizes a family trains and renders."""

    default_resolution: int = 1024  # side of the square bucket, in pixels
    pixel_multiple: int  # bucket sides are multiples of this (VAE factor x denoiser factor)
    # image sides must be multiples of this for its parts to run (pixel_multiple is one)
    pixel_grid: int
    # video: a sample's frames are 1 + this x n (the VAE's temporal factor: Wan's 4, so 4n + 1
    # frames make n + 1 latent frames); 0: the family trains images only
    frame_multiple: int = 0


def latent_frames(geometry: Geometry, frames: int) -> int:
    """The latent frames of a sample of ``frames`` frames (4n + 1 -> n + 1 for Wan's VAE); an
    image family's latents have no frame axis (0)."""
    if not geometry.frame_multiple:
        return 0
    return (frames - 1) // geometry.frame_multiple + 1


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """How generic code treats the denoiser's blocks: which it streams, shards and compiles."""

    # the denoiser's repeated blocks, each a unit that ``scaling.strategy = "fsdp"`` shards and
    # gathers on its own (a block list: each block; a single block: itself), in the order they run
    shard: tuple[str, ...]
    # class names of the repeated blocks ``train.compile`` compiles, each on its own (regional
    # compilation: diffusers' ``_repeated_blocks`` where the model has them)
    compile: tuple[str, ...]
    # the denoiser's block lists in the order they run (``memory.blocks_to_swap`` streams the
    # last of them); empty: the family does not stream blocks
    swap: tuple[str, ...] = ()
    # class names of the layers inside the shard blocks that are units of their own, nested in
    # their block (which then keeps only what they do not hold): the UNets' resnets and
    # transformer blocks, so that no unit is a whole down or up block; empty: the blocks are
    shard_inner: tuple[str, ...] = ()
    # what compiling the blocks did on a GPU (``raytuner bench gpu``): samples/s compiled over
    # eager, or the error the compiled step failed with there; ``train.compile = "auto"``
    # compiles on GPUs where this is a speed-up of more than 5 % (1.0: not measured, eager)
    compiled_on_gpu: float | str = 1.0
    # the blocks' frozen base linears may multiply in float8 (train.float8_matmul): the
    # transformer families
    float8_matmul: bool = False
    # the denoiser's convolutions run in channels-last memory format on GPUs (the UNets)
    channels_last: bool = False


@dataclass(frozen=True)
class LoraFiles:
    """What a family's LoRA export holds besides the diffusers file, and how its files describe
    themselves to the UIs: the values kohya's sd-scripts writes for the same base model."""

    kohya: str = ""  # the layout of lora_kohya.safetensors (``Adapters.kohya_names``); "": none
    base_model_version: str = ""  # ss_base_model_version: A1111 / Forge classify a LoRA by it
    network_module: str = "networks.lora"  # ss_network_module: sd-scripts' LoRA module
    architecture: str = ""  # modelspec.architecture of the base model; "": no modelspec keys
    implementation: str = ""  # modelspec.implementation
    # the key of a module in a LyCORIS file (lora.kind lokr / loha, lora.dora) where its kohya
    # layout cannot name it alone: a template of the diffusers module name (``{module}``, or
    # ``{flat}``: dots as underscores) under a prefix ComfyUI's LoRA loader maps for the family;
    # "": no LyCORIS file then (docs/lora-files.md)
    lycoris: str = ""


@dataclass(frozen=True, kw_only=True)
class Adapters:
    """The LoRA a family trains: where on the denoiser and its text encoders, and its files."""

    targets: tuple[str, ...] = DIFFUSERS_ATTENTION  # default peft target_modules on the denoiser
    files: LoraFiles = LoraFiles()  # which LoRA layouts it exports, how they describe themselves
    # how sd-scripts names the LoRA of each module of a denoiser of a config (the denoiser's
    # ``config`` -> ``Names`` of raytuner.lora.kohya); None: no kohya file (``files.kohya`` "")
    kohya_names: Callable | None = None
    # the text encoders ``lora.text_encoder`` trains a LoRA on (all of them, as kohya does), in
    # the order ``text_encoder`` returns them; empty: the family trains none (the cache's text)
    text_encoders: tuple[TextEncoderLora, ...] = ()
    # default peft target_modules on those text encoders (``lora.text_encoder_target_modules``)
    text_encoder_targets: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Guidance:
    """How the family's denoiser is guided, in training (objective.flow.guidance) and rendering."""

    # the pipeline's guidance_scale when the job and the prompt line set none: the classifier-free
    # guidance scale, or the guidance embedding's value for guidance-distilled families
    default_scale: float
    embedding: bool = False  # its denoiser takes objective.flow.guidance (guidance-distilled)
    # its pipeline takes a negative prompt (classifier-free guidance: kohya's --n and --l)
    negative_prompt: bool = True
    # the pipeline-call keyword the scale is passed as (Qwen-Image's true classifier-free
    # guidance: true_cfg_scale; its guidance_scale is for guidance-distilled checkpoints)
    scale_argument: str = "guidance_scale"
    # the negative prompt rendered with where none is set and the scale is above 1, for a
    # pipeline that guides only when it has one (Qwen-Image's model card: " "); "": none
    default_negative_prompt: str = ""
    # validation's steps when validation.steps and the prompt line set none
    default_steps: int = 20
    # a step-distilled release of the family (validation.distilled): its few steps (0: none is
    # released), the guidance_scale at which its pipeline makes no unconditional pass, and the
    # hub ids of such releases (a pipeline whose config says is_distilled is one too)
    distilled_steps: int = 0
    distilled_scale: float = 0.0
    distilled_repos: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class References:
    """How the family's denoiser takes reference (control) images: an edit pair's references
    (``data.sources.references``), and the reference images ``sample`` renders with."""

    # the pipeline-call keyword the reference image(s) are passed as ("": it takes none)
    argument: str = ""
    most: int = 0  # the references one sample may have (0: none)
    # the pipeline-call keyword the rendered area is passed as (Kontext's max_area: else it
    # renders about 1024 x 1024 whatever the size asked); "": none
    area_argument: str = ""


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A family's parts and its pipeline, by class."""

    # name (also the subfolder in a diffusers folder) -> "module.Class"
    classes: dict[str, str] = field(hash=False)
    denoiser: str  # "unet" / "transformer": its pipeline attribute, its name in LoRA keys
    pipeline: str  # "diffusers.<Name>Pipeline": loads, renders and saves the LoRA
    # the parts a single-file checkpoint (model.pretrained = "….safetensors") holds, each with
    # the key prefix of its tensors there ("" = every key); its other parts, tokenizers and
    # scheduler come from model.single_file_config. Empty: single files are refused
    single_file: tuple[tuple[str, str], ...] = ()
    # pipeline components a folder's pipeline is loaded without (SD1.5's safety checker)
    unused: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Expert:
    """One model of a denoiser that is a mixture of experts by noise level (Wan 2.2 A14B): the
    pipeline component it is and the noise levels ``[low, high)`` it denoises (its pipeline
    hands it the steps whose timestep, sigma x 1000, falls in them). ``model.expert`` names one:
    the run trains it alone, drawing every sample's noise level in its range."""

    name: str  # model.expert's value
    part: str  # its pipeline component (its subfolder): "transformer", "transformer_2"
    low: float  # the lowest noise level (sigma) it denoises
    high: float  # the level it stops below (1.0: it takes pure noise too)
    # load_lora_weights' keywords that put its LoRA on it (diffusers' load_into_transformer_2)
    lora_load: dict = field(default_factory=dict, hash=False)
    about: str = ""  # what a user reads where the expert is named or missing


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

    def with_expert(self, name: str):
        """This family training the expert ``name`` (``model.expert``): its denoiser is that
        expert's part, its loss draws noise levels in its range. A ValueError names the
        experts when ``name`` is none of them, or is missing where the family has experts."""
        if not self.experts and not name:
            return self
        if not self.experts:
            raise ValueError(
                f"model.expert = {name!r}: {self.name} has one denoiser; leave model.expert out"
            )
        names = {e.name: e for e in self.experts}
        if name not in names:
            listed = "; ".join(f"{e.name!r}: {e.about}" for e in self.experts)
            raise ValueError(
                f"model.expert = {name!r}: {self.name} is a mixture of experts by noise level "
                f"and a run trains one of them; set model.expert to {listed}"
            )
        variant = copy.copy(self)
        variant.expert = names[name]
        variant.parts = replace(self.parts, denoiser=names[name].part)
        return variant

    @property
    def noise_levels(self) -> tuple[float, float]:
        """The noise levels ``[low, high)`` its training draws: its expert's, or all."""
        return (self.expert.low, self.expert.high) if self.expert else (0.0, 1.0)

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


def example_batch(shapes: dict, n: int, size: tuple[int, int], device, dtype: torch.dtype) -> Batch:
    """What every family's example batch holds (``Family.example_batch``): random tensors of
    ``shapes`` in ``dtype`` (the feed reads the cache in float32), and the conditioning the
    feed adds to every row, here an uncropped image of the bucket's size."""
    batch = {k: torch.randn(n, *s, device=device, dtype=dtype) for k, s in shapes.items()}
    width, height = size

    def rows(pair: tuple[int, int]) -> torch.Tensor:
        return torch.tensor([pair] * n, dtype=torch.int64).to(device)

    return batch | {
        "original_size": rows((height, width)),
        "crop_top_left": rows((0, 0)),
        "target_size": rows((height, width)),
    }


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
