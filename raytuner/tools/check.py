"""The one place a job is refused before anything starts: ``check(job, family)``, called once by
the API (``raytuner.api``) for every operation, so `raytuner check` and every command refuse the
same jobs. A job's own sections checked their values and each other when it was loaded
(``config/``); what is refused here needs the family or this installation:

- image sizes off the model's pixel grid;
- ``[objective.<kind>]`` settings of the kind of objective it does not train with, and
  ``objective.flow.guidance`` without a guidance embedding;
- an optimizer or tracker whose package is not installed;
- a ``[memory]`` section the family's denoiser cannot run (``placement.check``);
- a single-file ``model.pretrained`` that is missing or that its family cannot load;
- a validation prompts file that is missing, or a line the family cannot render (``--n``
  without negative prompts, ``--g`` without a guidance embedding, sizes off its grid);
- a ``lora.init_from`` file that is not there, or set for a run that trains no LoRA.

What needs the cache, the run folder or the cluster is refused where they are read, before any
worker starts: a bucket too small for one global batch and a resume of a run trained on other
settings (``train/trainer.py``), a worker group larger than the cluster can hold within
``scaling.resource_wait_s`` (``runtime.wait_for_resources``). The LoRA targets the family's
kohya layout has no name for, and the content of a ``lora.init_from`` file, are refused when
the worker builds its adapter (the model must exist for both).

The family says what it is (``pixel_grid``, ``pixel_multiple``, ``objective_kind``,
``guidance_embedding``, ``single_file_parts``); nothing here asks which family it holds.
"""

from __future__ import annotations

import dataclasses
import os

from raytuner import placement
from raytuner.config import (
    ConfigError,
    JobConfig,
    ModelConfig,
    ObjectiveConfig,
    PreprocessConfig,
    TrackingConfig,
    ValidationConfig,
)
from raytuner.config.objective import KINDS
from raytuner.families import parts
from raytuner.observe import tracking
from raytuner.train.optim import missing_package


def check(job: JobConfig, family) -> None:
    """Raise ConfigError naming the key, its value and what to change."""
    _bucket_sizes(job.preprocess, family)
    _objective_kind(job.objective, family)
    _init_from(job)
    _packages(job)
    _model_file(job.model, family)
    _validation_prompts(job.validation, family)
    # a released repo: its architecture from the package, no download
    placement.check(job.memory, family, parts.model_source(job.model, "cpu"))


def _packages(job: JobConfig) -> None:
    """The optimizer's and the trackers' packages are installed."""
    if package := missing_package(job.train.optimizer):
        raise ConfigError(
            f"train.optimizer = {job.train.optimizer!r} needs the {package} package: "
            "pip install 'raytuner[lowvram]', or use adamw or adafactor"
        )
    _trackers(job.tracking)


def _model_file(model: ModelConfig, family) -> None:
    """A single-file ``model.pretrained`` exists locally and its family can load one; a file of
    another kind (a pickled ``.ckpt``) is refused, as is a config for no single file."""
    if not parts.is_single_file(model.pretrained):
        if os.path.isfile(model.pretrained):
            raise ConfigError(
                f"model.pretrained = {model.pretrained!r} is a file but not a .safetensors "
                "checkpoint (pickled .ckpt/.pt/.bin files can run code when loaded): convert "
                "it to .safetensors, or name a diffusers folder or hub id"
            )
        if model.single_file_config:
            raise ConfigError(
                f"model.single_file_config = {model.single_file_config!r} is read only for a "
                f"single-file model.pretrained (….safetensors), not {model.pretrained!r}: "
                "remove the key"
            )
        return
    if not family.single_file_parts:
        from raytuner.families import FAMILIES

        able = ", ".join(name for name, f in FAMILIES.items() if f.single_file_parts)
        raise ConfigError(
            f"model.pretrained = {model.pretrained!r}: {family.name} loads no single-file "
            'checkpoint; use a diffusers folder or hub id (or "tiny" / "random"); single '
            f"files load for {able}"
        )
    if not os.path.isfile(model.pretrained):
        raise ConfigError(
            f"model.pretrained = {model.pretrained!r}: no such file (a single-file checkpoint "
            "is read from a local path that every node reaches)"
        )


def _trackers(t: TrackingConfig) -> None:
    if t.wandb and tracking.missing():
        raise ConfigError(
            "tracking.wandb = true needs the wandb package, which is not installed: "
            f"{tracking.INSTALL} (or pip install wandb), or set tracking.wandb = false"
        )


def _bucket_sizes(pre: PreprocessConfig, family) -> None:
    """Bucket sides are multiples of the bucket step, which the model's pixel grid must divide;
    the square bucket (resolution²) is one of them."""
    grid = family.pixel_grid
    if pre.bucket_step % grid:
        raise ConfigError(
            f"preprocess.bucket_step = {pre.bucket_step}: {family.name} runs only on image sides "
            f"that are multiples of {grid} pixels; use a multiple of {grid} "
            f"(0: the family's {family.pixel_multiple})"
        )
    step = pre.bucket_step or family.pixel_multiple
    if pre.resolution % step:
        near = max(step, round(pre.resolution / step) * step)
        raise ConfigError(
            f"preprocess.resolution = {pre.resolution} is not a multiple of the bucket step "
            f"{step} (preprocess.bucket_step, or {family.name}'s pixel multiple when 0): "
            f"use a multiple of {step}, e.g. {near}"
        )
    if not pre.resolution and family.default_resolution % step:
        raise ConfigError(
            f"preprocess.bucket_step = {step} does not divide {family.name}'s default "
            f"resolution {family.default_resolution}: set preprocess.resolution to a multiple "
            f"of {step}, or a bucket step that divides {family.default_resolution}"
        )


def _objective_kind(objective: ObjectiveConfig, family) -> None:
    """A setting of another objective kind than the family's, set away from its default, would
    silently train something else than the job says; so would a guidance value for a denoiser
    without a guidance embedding."""
    from raytuner.families import FAMILIES

    kind = family.objective_kind
    for other, (cls, description) in KINDS.items():
        if other == kind:
            continue
        settings = getattr(objective, other)
        for f in dataclasses.fields(cls):
            value = getattr(settings, f.name)
            if value == f.default:
                continue
            readers = ", ".join(n for n, fam in FAMILIES.items() if fam.objective_kind == other)
            raise ConfigError(
                f"objective.{other}.{f.name} = {value!r} is read only by {description} families "
                f"({readers}); {family.name} trains with {KINDS[kind][1]}: use "
                f"[objective.{kind}], and remove objective.{other}.{f.name} (or set it back to "
                f"{f.default!r})"
            )
    if objective.flow.guidance != 1.0 and not family.guidance_embedding:
        raise ConfigError(
            f"objective.flow.guidance = {objective.flow.guidance}: {family.name}'s denoiser has no "
            "guidance embedding, so the value would be ignored; remove the key (or set it to 1.0)"
        )


def _validation_prompts(v: ValidationConfig, family) -> None:
    """The prompts file reads and every line is one the family can render; a negative prompt
    needs a family with classifier-free guidance (``negative_prompt``)."""
    from raytuner.render import prompts

    if v.negative_prompt and not family.negative_prompt:
        raise ConfigError(
            f"validation.negative_prompt = {v.negative_prompt!r}: {family.name}'s pipeline takes "
            "no negative prompt (no classifier-free guidance); remove the key"
        )
    if not v.prompts_file:
        return
    try:
        for line in prompts.read_prompts_file(v.prompts_file):
            prompts.check_line(line, family)
    except prompts.PromptsError as e:
        raise ConfigError(f"validation.prompts_file = {v.prompts_file!r}: {e}") from None


def _init_from(job: JobConfig) -> None:
    """A LoRA to start from: for a LoRA run, and (a local path) there. A URI is read when the
    workers start."""
    path = job.lora.init_from
    if not path:
        return
    if job.train.mode != "lora":
        raise ConfigError(
            f"lora.init_from = {path!r}: train.mode = {job.train.mode!r} trains no LoRA; "
            'remove the key or set train.mode = "lora"'
        )
    if "://" not in path and not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(
            f"lora.init_from = {path!r}: no such file (a relative path is from the working "
            f"directory, {os.getcwd()})"
        )
