"""The job check's rules about the model (``raytuner.jobcheck``): what the family's denoiser,
pipeline and objective cannot run. Each raises ConfigError naming the key, its value and what to
change; docs/architecture.md's table lists every rule of the check and where it lives. The
family says what it is (its ``geometry``, ``objective_kind``, ``guidance``, ``blocks``,
``parts.single_file``); nothing here asks which family it holds."""

from __future__ import annotations

import dataclasses
import os

from raytuner import placement
from raytuner.config import (
    ConfigError,
    DataConfig,
    JobConfig,
    ModelConfig,
    ObjectiveConfig,
    PreprocessConfig,
    ValidationConfig,
)
from raytuner.config.objective import KINDS
from raytuner.families import parts
from raytuner.placement.strategy import Strategy


def bucket_sizes(pre: PreprocessConfig, family) -> None:
    """Bucket sides are multiples of the bucket step, which the model's pixel grid must divide;
    the square bucket (resolution²) is one of them."""
    grid = family.geometry.pixel_grid
    if pre.bucket_step % grid:
        raise ConfigError(
            f"preprocess.bucket_step = {pre.bucket_step}: {family.name} runs only on image sides "
            f"that are multiples of {grid} pixels; use a multiple of {grid} "
            f"(0: the family's {family.geometry.pixel_multiple})"
        )
    bucket_step = pre.bucket_step or family.geometry.pixel_multiple
    if pre.resolution % bucket_step:
        near = max(bucket_step, round(pre.resolution / bucket_step) * bucket_step)
        raise ConfigError(
            f"preprocess.resolution = {pre.resolution} is not a multiple of the bucket step "
            f"{bucket_step} (preprocess.bucket_step, or {family.name}'s pixel multiple when 0): "
            f"use a multiple of {bucket_step}, e.g. {near}"
        )
    side = family.geometry.default_resolution
    if not pre.resolution and side % bucket_step:
        raise ConfigError(
            f"preprocess.bucket_step = {bucket_step} does not divide {family.name}'s default "
            f"resolution {side}: set preprocess.resolution to a multiple "
            f"of {bucket_step}, or a bucket step that divides {side}"
        )


def frame_counts(data: DataConfig, family) -> None:
    """A video family's frame buckets take the frame counts its VAE encodes (Wan: 4n + 1); an
    image family's are never used (its clips are reported, not trained)."""
    step = family.geometry.frame_multiple
    if not step:
        return
    for where, frames in [("data.frames", data.frames)] + [
        (f"data.sources[{i}].frames", s.frames) for i, s in enumerate(data.sources)
    ]:
        for n in frames:
            if (n - 1) % step:
                near = 1 + step * max(0, round((n - 1) / step))
                raise ConfigError(
                    f"{where} holds {n}: {family.name} encodes clips of {step}n + 1 frames "
                    f"(1, {1 + step}, {1 + 2 * step}, ...); use e.g. {near}"
                )


def clip_rates(data: DataConfig, family) -> None:
    """A family whose denoiser places frames in time by seconds (``geometry.seconds_positions``:
    frame / fps) needs every sample's frame rate: each source samples its clips at a rate of
    its own (``data.fps`` or the source's ``fps`` > 0), not at each clip's own (0), which the
    batch cannot tell (its ``"fps"`` is the source's)."""
    if not family.geometry.seconds_positions:
        return
    unknown = [("data.fps", "")] if data.images and not data.fps else []  # (key, whose)
    for i, s in enumerate(data.sources):
        if not s.fps:
            unknown.append((f"data.sources[{i}].fps", ""))
        elif s.fps < 0 and not data.fps:
            unknown.append(("data.fps", f" (data.sources[{i}] takes it: its fps is -1)"))
    if unknown:
        key, whose = unknown[0]
        raise ConfigError(
            f"{key} = 0{whose}: {family.name}'s denoiser places frames in time by seconds (frame / "
            "fps), so every clip needs a known frame rate, and 0 samples each clip at its own "
            f"rate, which training does not know; set {key} to the rate to train at (e.g. 24)"
        )


def objective_kind(objective: ObjectiveConfig, family) -> None:
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
    if objective.flow.guidance != 1.0 and not family.guidance.embedding:
        raise ConfigError(
            f"objective.flow.guidance = {objective.flow.guidance}: {family.name}'s denoiser has no "
            "guidance embedding, so the value would be ignored; remove the key (or set it to 1.0)"
        )


def sharding(job: JobConfig) -> None:
    """What the job's strategy cannot take (``Strategy.refusal``); ``"auto"`` shards only a
    job whose settings sharding takes."""
    strategy = Strategy.pinned(job.scaling.strategy)
    if strategy is None:
        return
    refusal = strategy.refusal(
        blocks_to_swap=job.memory.blocks_to_swap,
        float8=job.model.dtype == parts.FLOAT8,
        optimizer=job.train.optimizer,
    )
    if refusal:
        raise ConfigError(refusal)


def worker_memory(job: JobConfig, family) -> None:
    """A job that names the memory a worker has (``scaling.worker_memory``) fits it with its
    strategy and workers: ``"auto"`` with ddp or fsdp over the workers it may take, a named
    strategy as it is (``tools/plan/auto.py``, on plan's traces; the decision is kept for the
    run that follows in this process)."""
    if job.scaling.memory_bytes is None:
        return
    from raytuner.tools.plan import adopt

    memory = adopt.Memory(job.scaling.memory_bytes, "scaling.worker_memory")
    if refusal := adopt.decided(job, family, memory).refusal:
        raise ConfigError(refusal)


def compiling(job: JobConfig, family) -> None:
    """``train.compile = true`` compiles each repeated block once; a streamed block's weights
    are swapped in by hooks inside the compiled call, which dynamo cannot trace; and a family
    whose compiled step failed on a GPU is refused it on GPU workers (``"auto"`` leaves it
    eager there)."""
    if job.train.compile is True and job.memory.blocks_to_swap:
        raise ConfigError(
            f"train.compile = true with memory.blocks_to_swap = {job.memory.blocks_to_swap}: "
            "a streamed block's weights arrive through hooks the compiled block cannot hold; "
            'set train.compile = false (or "auto") or memory.blocks_to_swap = 0'
        )
    failed = family.blocks.compiled_on_gpu
    if job.train.compile is True and job.scaling.use_gpu and isinstance(failed, str):
        raise ConfigError(
            f"train.compile = true: the {family.name} denoiser's compiled blocks failed on a GPU "
            f"({failed}); set train.compile = false or \"auto\" (which leaves them eager)"
        )


def float8_matmul(job: JobConfig, family) -> None:
    """Float8 matrix products are for the transformer families' blocks."""
    if job.train.float8_matmul and not family.blocks.float8_matmul:
        from raytuner.families import FAMILIES

        able = ", ".join(n for n, f in FAMILIES.items() if f.blocks.float8_matmul)
        raise ConfigError(
            f"train.float8_matmul = true: the {family.name} denoiser's linears are not made "
            f"for float8 here (allowed for {able}); set train.float8_matmul = false"
        )


def first_frame(job: JobConfig, family) -> None:
    """A clean first frame (``objective.flow.first_frame_p``) needs a denoiser that takes a noise
    level per token (``geometry.first_frame_clean``)."""
    p = job.objective.flow.first_frame_p
    if p and not family.geometry.first_frame_clean:
        from raytuner.families import FAMILIES

        able = ", ".join(n for n, f in FAMILIES.items() if f.geometry.first_frame_clean)
        raise ConfigError(
            f"objective.flow.first_frame_p = {p:g}: the {family.name} denoiser takes one noise "
            f"level a sample, so no frame can be kept clean (allowed for {able}); set "
            "objective.flow.first_frame_p = 0"
        )


def model_file(model: ModelConfig, family) -> None:
    """A single-file ``model.pretrained`` exists locally and its family can load one; a file of
    another kind (a pickled ``.ckpt``) is refused, as is a config for no single file; a preset
    name is one the family ships."""
    name = parts.Source(model.pretrained).preset
    if name and name not in parts.preset_names(family.name):
        raise ConfigError(
            f"model.pretrained = {name!r}: {family.name} has no such preset; its presets: "
            f"{', '.join(parts.preset_names(family.name))} (or a diffusers folder or hub id)"
        )
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
    if not family.parts.single_file:
        from raytuner.families import FAMILIES

        able = ", ".join(name for name, f in FAMILIES.items() if f.parts.single_file)
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


def validation_prompts(v: ValidationConfig, family) -> None:
    """The prompts file reads and every line is one the family can render (its sizes, its clip
    lengths); a negative prompt needs a family with classifier-free guidance."""
    from raytuner.render import prompts

    if v.negative_prompt and not family.guidance.negative_prompt:
        raise ConfigError(
            f"validation.negative_prompt = {v.negative_prompt!r}: {family.name}'s pipeline takes "
            "no negative prompt (no classifier-free guidance); remove the key"
        )
    if v.distilled == "yes" and not family.guidance.distilled_steps:
        raise ConfigError(
            f'validation.distilled = "yes": {family.name} has no step-distilled release; '
            'use "auto" or "no"'
        )
    try:
        for key in ("width", "height"):
            prompts.on_grid(f"validation.{key} =", getattr(v, key), family)
    except prompts.PromptsError as e:
        raise ConfigError(f"{e}; 0 renders at the job's resolution") from None
    try:
        prompts.frame_count("validation.frames =", v.frames, family)
    except prompts.PromptsError as e:
        raise ConfigError(f"{e}; 0 renders the largest data.frames bucket") from None
    if v.prompts and family.references.required:
        raise ConfigError(
            f"validation.prompts: {family.name}'s pipeline renders only from a reference image, "
            "which a prompt of validation.prompts cannot name: put them in "
            "validation.prompts_file, each line with --ci <image>"
        )
    if not v.prompts_file:
        return
    try:
        for line in prompts.read_prompts_file(v.prompts_file):
            prompts.check_line(line, family)
            prompts.check_required(f"line {line.line}", line.references, family)
    except prompts.PromptsError as e:
        raise ConfigError(f"validation.prompts_file = {v.prompts_file!r}: {e}") from None


def blocks_to_swap(memory, family, source) -> None:
    """Refuse, before anything runs, a ``[memory]`` section the family's denoiser cannot run:
    block swap on a family without swappable blocks, or more blocks than it has (built on the
    meta device: nothing is allocated). Raises ConfigError (``raytuner check`` exits 2)."""
    n = memory.blocks_to_swap
    if not n:
        return
    if not family.blocks.swap:
        raise ConfigError(
            f"memory.blocks_to_swap = {n}: the {family.name} family's denoiser does not stream "
            "blocks (block swap is for the transformer families); set it to 0"
        )
    groups = placement.block_groups(family.denoiser(source, "meta", weights=False), family)
    count = min(len(group) for group in groups)  # of each expert of a mixture trained in turn
    if n >= count:
        each = " (each expert)" if len(groups) > 1 else ""
        raise ConfigError(
            f"memory.blocks_to_swap = {n}: the {family.name} denoiser has {count} blocks{each} "
            f"({' + '.join(family.blocks.swap)}); allowed: 0 to {count - 1}"
        )


def references(data, family) -> None:
    """A source's ``references`` folder (edit pairs) for a family whose denoiser takes no
    reference images, or with flips (a mirrored target beside its unmirrored reference)."""
    keys = ["data.references"] if data.images else []
    keys += [f"data.sources[{i}].references" for i in range(len(data.sources))]
    for key, source in zip(keys, data.all_sources(), strict=True):
        if source.references and source.flip == "random":
            raise ConfigError(
                f"{key} = {source.references!r} with flip = \"random\": a flipped target would "
                'train beside its unflipped reference; set flip = "none" for this source'
            )
        if source.references and not family.references.most:
            from raytuner.families import FAMILIES

            edit = ", ".join(n for n, f in FAMILIES.items() if f.references.most)
            raise ConfigError(
                f"{key} = {source.references!r}: {family.name} takes no "
                f"reference images; edit training needs a family that does ({edit}), or remove "
                "the key"
            )
