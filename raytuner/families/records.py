"""The records a family is made of: its frozen facts, each one concern that generic code reads
(``Geometry``, ``Blocks``, ``LoraFiles`` / ``Adapters``, ``Guidance``, ``References``, ``Parts``,
``Expert``). ``families/base.py`` re-exports them beside the ``Family`` protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from raytuner.families.text import TextEncoderLora

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
    # the pipeline-call keyword a clip's frame rate is rendered with (LTX2Pipeline's
    # frame_rate: its positions are in seconds, so a clip renders at the rate its file plays
    # at, validation.fps / sample --fps); "": its pipeline takes none
    fps_argument: str = ""
    # its denoiser takes a noise level per token and its first latent frame is one pixel frame
    # (a causal VAE): a clip's first frame can be kept clean and out of the loss, as its
    # image-to-video pipeline conditions on it (objective.flow.first_frame_p)
    first_frame_clean: bool = False
    # its denoiser places frames in time by seconds (frame / fps): every clip needs a known
    # frame rate, data.fps or the source's fps > 0 (``raytuner check`` refuses 0, the clip's
    # own rate); its loss reads each row's rate from the batch's "fps"
    seconds_positions: bool = False


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
    # its text encoder sees a caption's reference images too (Qwen-Image-Edit's Qwen2.5-VL): an
    # edit pair's text row is of its caption and its references (``keys.pair_caption_key``),
    # encoded once the pairs are known (``preprocess/pair_text.py``), and its ``text_encoder``
    # takes ``references=`` (each caption's images, bucket-sized RGB)
    text: bool = False
    # its pipeline renders only from a reference image (QwenImageEditPlusPipeline): a prompt
    # line without one is refused (``render/prompts.check_references``)
    required: bool = False


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
