"""The job's input sections: the model to load, the image folders, and how they are encoded.

Part of the job configuration (``raytuner.config`` re-exports every class here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from raytuner.config.loader import ConfigError, one_of
from raytuner.config.ranges import RESOURCE_STEP, SEED_MAX, ranged

RESOURCE_HINT = f"Ray counts resources in steps of {RESOURCE_STEP}"
BOTH_EXPERTS = "both"  # model.expert: every expert of a mixture in one run, in turn


@dataclass(frozen=True, kw_only=True)
class MergeAdapterConfig:
    """A LoRA / LoKr / LoHa / DoRA file merged into the frozen denoiser before training
    (``[[model.merge_adapters]]``): in the trained model and its renders, not in the export."""

    path: str  # a safetensors file, local or a URI (s3://), read as lora.init_from reads one
    weight: float = ranged(1.0, -16, 16, hint="the file's update times this; 1: as saved")
    # the expert ("high", "low") whose denoiser it is merged into: required by a run of every
    # expert of a mixture (model.expert = "both"); "": the run's denoiser
    expert: str = ""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("model.merge_adapters.path is empty: name a LoRA safetensors file")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to fine-tune."""

    family: str  # a key of raytuner.families.FAMILIES (checked where the family is looked up)
    pretrained: str = "tiny"  # "tiny", "random" (full size, random weights), a folder, a hub id
    revision: str = ""
    # frozen weights (the denoiser in LoRA mode, VAE, text encoders, validation and sample
    # pipelines); "auto": bfloat16 on GPUs, float32 on CPUs; "float8": the frozen denoiser's
    # linear weights stored in float8 (e4m3) and computed in bfloat16, the rest in bfloat16
    dtype: str = "auto"
    trainable_dtype: str = "float32"  # LoRA weights, or the denoiser in full mode
    # a single-file checkpoint (pretrained ending in .safetensors): the diffusers folder or hub
    # id whose part configs describe it; "": the family's default repo
    single_file_config: str = ""
    # adapters merged into the frozen denoiser with a weight each, in order, before training
    merge_adapters: list[MergeAdapterConfig] = field(default_factory=list)
    # the expert a run trains, of a family that is a mixture of experts by noise level (Wan 2.2
    # A14B: "high" or "low"; "both": every expert in one run, in turn); "": a family of one
    # denoiser (checked where the family is looked up)
    expert: str = ""
    # model.expert = "both": steps each expert trains before the next takes its turn
    expert_switch_every: int = ranged(
        1, 1, 1_000_000, hint='1: the experts alternate every step (model.expert = "both")'
    )

    def __post_init__(self) -> None:
        if not self.pretrained:
            raise ConfigError(
                'model.pretrained is empty: use "tiny", "random", a local folder or a hub id'
            )
        allowed = ("auto", "bfloat16", "float16", "float32", "float8")
        one_of("model.dtype", self.dtype, allowed)
        one_of("model.trainable_dtype", self.trainable_dtype, ("float32", "bfloat16"))
        if self.expert_switch_every != 1 and self.expert != BOTH_EXPERTS:
            raise ConfigError(
                f"model.expert_switch_every = {self.expert_switch_every} is for a run that "
                f'trains every expert in turn: set model.expert = "{BOTH_EXPERTS}" or remove '
                "the key"
            )


FLIPS = ("none", "random")  # data.flip
MASKS = ("none", "alpha", "file")  # data.mask
# a caption file that is not UTF-8: its bad bytes replaced by U+FFFD, its image skipped, or
# the preprocess refused naming the files
CAPTION_ERRORS = ("replace", "skip", "strict")
# how a clip's frames are chosen (raytuner/preprocess/video.py): the first ones, spread over the
# clip, or consecutive runs (each a sample of its own)
FRAME_SELECTIONS = ("head", "uniform", "chunks")


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """One image folder of the dataset (``[[data.sources]]``)."""

    path: str
    repeats: int = ranged(1, 1, 10_000)
    caption_extension: str = ".txt"
    caption_fallback: str = "stem"
    caption_errors: str = "replace"
    metadata: str = ""  # "" = auto: metadata.jsonl, .csv or .parquet in the folder, if any
    repeats_from_folder: bool = False  # kohya folders: "10_ohwx person/" -> 10 repeats
    # prior preservation: its images pair with the others by kohya's rule and their loss is
    # weighted by train.prior_loss_weight
    regularization: bool = False
    flip: str = ""  # none | random (a mirror image's latent is cached too); "": data.flip
    mask: str = ""  # none | alpha | file (<stem>-masklabel.png); "": data.mask
    # a clip's frame counts, selection and rate for this source; []/""/-1: data's
    frames: list[int] = ranged([], 1, 1025)
    frame_selection: str = ""
    fps: float = ranged(-1.0, -1, 240, hint="-1: data.fps; 0: the clip's own rate")
    # edit training: a folder of reference (control) images, <stem>.<ext> and/or <stem>_0.<ext>,
    # <stem>_1.<ext> ... for each image <stem>.<ext> (relative to the source folder unless
    # absolute or a URI); "": none, or those its metadata table names (control_path)
    references: str = ""

    def __post_init__(self) -> None:
        one_of("data.sources.frame_selection", self.frame_selection, ("", *FRAME_SELECTIONS))
        one_of("data.sources.caption_fallback", self.caption_fallback, ("stem", "empty", "skip"))
        one_of("data.sources.caption_errors", self.caption_errors, CAPTION_ERRORS)
        one_of("data.sources.flip", self.flip, ("", *FLIPS))
        one_of("data.sources.mask", self.mask, ("", *MASKS))
        if not self.caption_extension.startswith("."):
            raise ConfigError(
                f"caption_extension = {self.caption_extension!r}: must start with '.'"
            )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the images are and where their encoded cache lives."""

    images: str = ""  # shorthand for one source with the caption options below
    cache: str
    caption_extension: str = ".txt"
    caption_fallback: str = "stem"
    caption_errors: str = "replace"
    # kohya folders under data.images: "10_ohwx cat/" -> 10 repeats, captioned "ohwx cat"
    # without a caption file (as repeats_from_folder of [[data.sources]])
    repeats_from_folder: bool = True
    flip: str = "none"  # every source's flip unless it sets its own
    mask: str = "none"  # every source's mask unless it sets its own
    # video clips: the frame counts a sample may take (the frame buckets; a clip takes the
    # largest its length gives), how they are chosen and at what rate (0: the clip's own);
    # an image is a one-frame sample. The family's frame rule (Wan: 4n + 1) is jobcheck's
    frames: list[int] = ranged([81], 1, 1025)
    frame_selection: str = "head"
    fps: float = ranged(0.0, 0, 240, low_open=True, zero="the clip's own rate")
    references: str = ""  # data.images' references folder (edit pairs: as a source's)
    sources: list[SourceConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._shorthand()  # validates the shorthand's caption options
        one_of("data.flip", self.flip, FLIPS)
        one_of("data.mask", self.mask, MASKS)
        one_of("data.frame_selection", self.frame_selection, FRAME_SELECTIONS)
        if not self.frames:
            raise ConfigError("data.frames is empty: name at least one frame count, e.g. [81]")
        if not self.images and not self.sources:
            raise ConfigError("set data.images or at least one [[data.sources]]")
        if not self.images and all(s.regularization for s in self.sources):
            raise ConfigError(
                "every [[data.sources]] has regularization = true: regularization images "
                "are paired with training images (add a source, or data.images, without it)"
            )

    def all_sources(self) -> list[SourceConfig]:
        """``data.images`` (if set) as the first source, then ``[[data.sources]]``; each with
        its flip and mask settled (``data.flip`` / ``data.mask`` unless it sets its own)."""
        shorthand = [self._shorthand()] if self.images else []
        return [
            dataclasses.replace(
                s,
                flip=s.flip or self.flip,
                mask=s.mask or self.mask,
                frames=s.frames or self.frames,
                frame_selection=s.frame_selection or self.frame_selection,
                fps=self.fps if s.fps < 0 else s.fps,
            )
            for s in shorthand + list(self.sources)
        ]

    def _shorthand(self) -> SourceConfig:
        """``data.images`` as a source, with the ``[data]`` caption and folder options."""
        return SourceConfig(
            path=self.images,
            caption_extension=self.caption_extension,
            caption_fallback=self.caption_fallback,
            caption_errors=self.caption_errors,
            repeats_from_folder=self.repeats_from_folder,
            frames=self.frames,
            frame_selection=self.frame_selection,
            fps=self.fps,
            references=self.references,
        )


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """The Ray Data encode job: bucketing, cropping and the encoder actor pools."""

    # 0: the family's default; a multiple of the bucket step (jobcheck)
    resolution: int = ranged(0, 64, 8192, zero="the family's default")
    # 0: the family's pixel multiple; a multiple of its pixel grid (jobcheck)
    bucket_step: int = ranged(0, 8, 1024, zero="the family's pixel multiple")
    min_aspect: float = ranged(0.5, 0, 1, low_open=True)
    max_aspect: float = ranged(2.0, 1)
    crop: str = "center"
    dtype: str = "bfloat16"
    # the text tensors' storage ("": preprocess.dtype, as the latents); "float8": float8 e4m3
    # with a float32 scale per token row, about half of bfloat16's bytes (data/tensors.py)
    text_dtype: str = ""
    batch_size: int = ranged(8, 1, 1024)
    min_actors: int = ranged(1, 1)
    max_actors: int = ranged(1, 1)  # >= min_actors
    gpus_per_actor: float = ranged(
        0.0,
        RESOURCE_STEP,
        16,
        zero="none",
        hint="a fraction shares one GPU; more than 1: whole GPUs the text encoder is split over",
    )
    # the memory of each GPU an encoder actor gets, in GiB: `raytuner check` refuses a pool
    # whose text encoder cannot fit it (0: not known, not checked; the actor sizes its GPUs)
    gpu_memory_gib: float = ranged(0.0, 0, zero="not checked")
    # the text encoder's repeated layers in host memory, streamed to the GPU as they run
    text_encoder_offload: bool = False
    # reserved: with 1 each, 2 actors on 2 CPUs starved the decode
    cpus_per_actor: float = ranged(0.5, RESOURCE_STEP, hint=RESOURCE_HINT)
    seed: int = ranged(0, 0, SEED_MAX)
    aspect_policy: str = "clamp"  # images outside [min_aspect, max_aspect]: clamp or skip
    min_size: int = ranged(64, 0)  # skip images whose short side is smaller (pixels)
    max_pixels: int = ranged(178_956_970, 1)  # decompression-bomb limit (width * height)
    background: list[int] = ranged([255, 255, 255], 0, 255)  # [r, g, b] under alpha
    store_std: bool = False  # also store the VAE posterior std, so training can resample
    # an encoder actor that dies is restarted this often, then it fails
    max_restarts: int = ranged(2, 0)
    # how long the first encoder actors may wait for resources
    resource_wait_s: float = ranged(600.0, 0)

    def __post_init__(self) -> None:
        one_of("preprocess.crop", self.crop, ("center", "random", "none"))
        one_of("preprocess.aspect_policy", self.aspect_policy, ("clamp", "skip"))
        if len(self.background) != 3:
            raise ConfigError(f"preprocess.background = {self.background}: use [r, g, b] 0..255")
        one_of("preprocess.dtype", self.dtype, ("bfloat16", "float16", "float32"))
        if self.text_dtype:  # "": preprocess.dtype
            allowed = ("bfloat16", "float16", "float32", "float8")
            one_of("preprocess.text_dtype", self.text_dtype, allowed)
        if self.gpus_per_actor > 1 and self.gpus_per_actor != int(self.gpus_per_actor):
            raise ConfigError(
                f"preprocess.gpus_per_actor = {self.gpus_per_actor}: above 1 an encoder actor "
                "takes whole GPUs (2, 3, ...); a fraction (<= 1) shares one"
            )
        if self.max_actors < self.min_actors:
            raise ConfigError("preprocess.max_actors must be >= preprocess.min_actors")

    @property
    def text_storage(self) -> str:
        """The dtype the cache stores text tensors in."""
        return self.text_dtype or self.dtype
