"""What a job asks of its family that the family's model cannot do, refused by ``raytuner check``
(and every command) before anything starts: image sizes off the model's pixel grid, and
``[objective]`` keys its kind of objective never reads.

The family says what it is (``pixel_grid``, ``pixel_multiple``, ``objective_kind``,
``guidance_embedding``); nothing here asks which family it holds.
"""

from __future__ import annotations

import dataclasses

from raytuner.config import ConfigError, JobConfig, ObjectiveConfig, PreprocessConfig

# objective kind -> its description and the [objective] keys its loss reads
# (objective.guidance is read by families with a guidance embedding, whatever their kind)
KINDS = {
    "ddpm": ("DDPM", ("weighting", "min_snr_gamma", "noise_offset")),
    "flow": (
        "flow-matching",
        ("timestep_sampling", "logit_mean", "logit_std", "mode_scale", "resolution_shift")
        + ("shift", "weighting"),
    ),
}
WEIGHTINGS = {"ddpm": ("none", "min_snr"), "flow": ("none", "sigma_sqrt", "cosmap")}


def check_job(job: JobConfig, family) -> None:
    """Raise ConfigError naming the key, its value and what to change."""
    _bucket_sizes(job.preprocess, family)
    _objective_keys(job.objective, family)


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


def _objective_keys(objective: ObjectiveConfig, family) -> None:
    """A non-default ``[objective]`` key the family's loss never reads would silently train
    something else than the job says."""
    kind = family.objective_kind
    description, reads = KINDS[kind]
    if objective.weighting not in WEIGHTINGS[kind]:
        raise ConfigError(
            f"objective.weighting = {objective.weighting!r}: {family.name}'s {description} "
            f"objective weights with {', '.join(WEIGHTINGS[kind])}; use one of those"
        )
    if objective.guidance != 1.0 and not family.guidance_embedding:
        raise ConfigError(
            f"objective.guidance = {objective.guidance}: {family.name}'s denoiser has no guidance "
            "embedding, so the value would be ignored; remove the key (or set it to 1.0)"
        )
    for f in dataclasses.fields(objective):
        value = getattr(objective, f.name)
        if f.name in reads or f.name == "guidance" or value == f.default:
            continue
        raise ConfigError(
            f"objective.{f.name} = {value!r}: {family.name}'s {description} objective does not "
            f"read it (it reads {', '.join(reads)}); remove the key or set it back to {f.default!r}"
        )
