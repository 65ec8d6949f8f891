"""The one place a job is refused before anything starts: ``check(job, family)``, called once by
the API (``raytuner.api``) for every operation, so `raytuner check` and every command refuse the
same jobs. A job's own sections checked their values and each other when it was loaded
(``config/``); what is refused here needs the family, this installation or this machine:

- image sizes off the model's pixel grid;
- ``[objective.<kind>]`` settings of the kind of objective it does not train with, and
  ``objective.flow.guidance`` without a guidance embedding;
- an optimizer or tracker whose package is not installed;
- a ``[memory]`` section the family's denoiser cannot run (``placement.check``);
- ``scaling.strategy = "fsdp"`` with what cannot take sharded weights: block swap, float8
  storage, the 8-bit AdamW, Adafactor and Prodigy (their states are not a weight's rows);
- ``train.compile = true`` with block swap, or on GPU workers for a family whose compiled
  blocks failed on a GPU;
- a single-file ``model.pretrained`` that is missing or that its family cannot load;
- a validation prompts file that is missing, or a line the family cannot render (``--n``
  without negative prompts, ``--g`` without a guidance embedding, sizes off its grid);
- a ``lora.init_from`` file that is not there, or set for a run that trains no LoRA, or
  whose LoRA does not fit the job's adapter (rank, alpha, modules, shapes: read from its
  header), and LoRA target modules that reach no module, or that the family's kohya layout
  has no name for (``check_lora``: the model built on the meta device);
- ``validation.width`` / ``height`` off the model's pixel grid;
- ``lora.text_encoder`` for a family whose text encoders raytuner does not train;
- a relative ``data.cache`` or ``train.output`` when the command runs in Ray's temporary copy of
  a job's working dir (``ray job submit --working-dir``, a runtime_env ``working_dir``), where
  what it writes would stay on one node and be deleted (relative image folders are read from
  the copy, which holds them: they pass);
- a local image folder (``data.images``, every ``[[data.sources]]`` path; URIs other than
  ``file://`` are listed when the preprocess starts) that is missing, or in which the
  preprocess's own listing (``preprocess.sources.list_source``: names and sizes, no image read)
  finds no image it would encode. The count is logged (``raytuner check`` prints it on stderr,
  keeping stdout the job's JSON). It is the last check: the listing is the slow one (4 s of
  CPU for 100,000 files on the 2-core test machine).

What each operation asks for (its keywords): every check for `raytuner check`, ``preprocess``
and ``run``, and for ``cache verify --repair``, ``bench train`` and ``bench preprocess
--images 0``, which encode the job's images. ``reads_images=False`` for the operations that
read the committed cache and not the images (``train``, ``sample``, ``cache verify`` and
``cache gc``, ``bench step`` and ``bench feed``): a folder deleted or unmounted after its
preprocess does not stop them. ``runs=False`` for ``plan`` alone, which builds the model on the
meta device, runs no optimizer and reads and writes none of the job's data: the optional
packages, the image folders and the output paths are not looked at (``jobs/flux-12gb.toml``
plans without bitsandbytes, the shipped jobs without their ``/data`` folders); the rest, about
the model, still is.

What needs the cache, the run folder or the cluster is refused where they are read, before any
worker starts: a bucket too small for one global batch and a resume of a run trained on other
settings (``train/trainer.py``), a worker group larger than the cluster can hold within
``scaling.resource_wait_s`` (``runtime.wait_for_resources``). What a worker or actor still
refuses (docs/reliability.md lists it) reaches the user as the same exit 2 and one line.

The family says what it is (its ``geometry``, ``objective_kind``, ``guidance``,
``parts.single_file``, ``adapters.text_encoders``); nothing here asks which
family it holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import PurePath

import pyarrow.fs as pafs

from raytuner import placement, storage
from raytuner.config import (
    ConfigError,
    DataConfig,
    JobConfig,
    ModelConfig,
    ObjectiveConfig,
    PreprocessConfig,
    SourceConfig,
    TrackingConfig,
    ValidationConfig,
)
from raytuner.config.objective import KINDS
from raytuner.families import parts
from raytuner.observe import tracking
from raytuner.placement.strategy import Strategy
from raytuner.tools import check_lora
from raytuner.train import float8_matmul, text_lora
from raytuner.train.optim import missing_package

log = logging.getLogger("raytuner")

# Ray unpacks a job's working dir (and any runtime_env working_dir) into
# <temp dir>/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/ and starts the job's
# entrypoint there (Ray 2.60: ray/_private/runtime_env/working_dir.py); a job's driver also gets
# RAY_JOB_CONFIG_JSON_ENV_VAR (its runtime_env, from dashboard/modules/job/job_supervisor.py)
RAY_WORKING_DIRS = ("runtime_resources", "working_dir_files")
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def check(job: JobConfig, family, *, runs: bool = True, reads_images: bool = True) -> None:
    """Raise ConfigError naming the key, its value and what to change. ``runs=False`` (plan)
    leaves out the optional packages, the image folders and the outputs; ``reads_images=False``
    the image folders (see the module's docstring for which operation passes what)."""
    _bucket_sizes(job.preprocess, family)
    _objective_kind(job.objective, family)
    _sharding(job)
    _compile(job, family)
    _float8_matmul(job, family)
    check_lora.init_from(job)
    text_lora.check(job.lora, family)
    if runs:
        _packages(job)
    _model_file(job.model, family)
    _validation_prompts(job.validation, family)
    # a released repo: its architecture from the package, no download
    placement.check(job.memory, family, parts.model_source(job.model, "cpu"))
    check_lora.adapter(job, family)  # builds the model on the meta device when needed
    if runs:
        _outputs_outside_ray_working_dir(job)
    if runs and reads_images:
        _image_folders(job.data)  # last: the slow one


def _sharding(job: JobConfig) -> None:
    """What the job's strategy cannot take (``Strategy.refusal``)."""
    strategy = Strategy.of(job.scaling.strategy)
    refusal = strategy.refusal(
        blocks_to_swap=job.memory.blocks_to_swap,
        float8=job.model.dtype == parts.FLOAT8,
        optimizer=job.train.optimizer,
    )
    if refusal:
        raise ConfigError(refusal)


def _compile(job: JobConfig, family) -> None:
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


def ray_working_dir(cwd: str | None = None) -> str | None:
    """The copy of a working dir Ray unpacked that ``cwd`` (the working directory) lies in, or
    None: the folder ``…/runtime_resources/working_dir_files/<package>``."""
    parts = PurePath(cwd or os.getcwd()).parts
    for i in range(len(parts) - 2):
        if parts[i : i + 2] == RAY_WORKING_DIRS:
            return str(PurePath(*parts[: i + 3]))
    return None


def _outputs_outside_ray_working_dir(job: JobConfig) -> None:
    """Inside Ray's copy of a working dir, a relative ``data.cache`` or ``train.output`` would
    be written into that copy: on one node, deleted with it, and under another package folder
    once a file of the working dir changes (no resume, the cache encoded again)."""
    copy = ray_working_dir()
    if copy is None:
        return
    relative = [
        (key, path)
        for key, path in (("data.cache", job.data.cache), ("train.output", job.train.output))
        if "://" not in path and not os.path.isabs(os.path.expanduser(path))
    ]
    if not relative:
        return
    how = "a Ray job's working dir" if _ray_job() else "a Ray runtime_env working_dir"
    keys = " and ".join(f"{key} = {path!r}" for key, path in relative)
    key, path = relative[0]
    raise ConfigError(
        f"{keys} {'is' if len(relative) == 1 else 'are'} relative, and this runs in {how}: "
        f"{'it' if len(relative) == 1 else 'they'} would be written under {copy}, Ray's "
        "temporary copy of it on this node, which other nodes do not see and Ray deletes; set "
        "an absolute path every node reaches (a shared filesystem) or an s3:// or gs:// URI, "
        f"e.g. --set {key}=s3://bucket/{os.path.basename(os.path.normpath(path))}"
    )


def _ray_job() -> bool:
    """This process is a Ray job's driver (`ray job submit`): Ray hands it its job config."""
    try:
        return isinstance(json.loads(os.environ.get(RAY_JOB_ENV, "")), dict)
    except ValueError:
        return False


def _local_folders(data: DataConfig) -> list[tuple[str, int, SourceConfig]]:
    """(key, index among ``data.all_sources()``, source) of each image folder on this machine's
    filesystem: a path, or a ``file://`` URI."""
    keys = ["data.images"] if data.images else []
    keys += [f"data.sources[{i}].path" for i in range(len(data.sources))]
    return [
        (key, i, source)
        for i, (key, source) in enumerate(zip(keys, data.all_sources(), strict=True))
        if "://" not in source.path or source.path.startswith("file://")
    ]


def _image_folders(data: DataConfig) -> None:
    """Each local image folder exists and the preprocess's listing finds at least one image in
    it that it would encode; the counts are logged once every folder passed."""
    from raytuner.preprocess.sources import IMAGE_EXTENSIONS, list_source

    counts = []
    for key, i, source in _local_folders(data):
        fs, root = storage.resolve(source.path)
        shown = f"{key} = {source.path!r}"
        where = "" if root == source.path else f" ({root})"
        kind = fs.get_file_info(root).type
        if kind == pafs.FileType.NotFound:
            relative = "://" not in source.path and not os.path.isabs(
                os.path.expanduser(source.path)
            )
            raise ConfigError(
                f"{shown}: no such folder{where}; set it to the folder of your images"
                + (" (a relative path is from the working directory)" if relative else "")
            )
        if kind != pafs.FileType.Directory:
            raise ConfigError(f"{shown}: not a folder{where}; set it to the folder of your images")
        try:
            rows = list_source(i, source)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{shown}: {e}") from None
        usable = sum(not r["refused"] for r in rows)
        if not rows:
            extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
            raise ConfigError(
                f"{shown}: holds no image{where} (searched recursively for {extensions}; "
                "hidden files skipped)"
            )
        if not usable:
            first = rows[0]
            raise ConfigError(
                f"{shown}: none of its {len(rows)} images would be encoded ({first['path']}: "
                f"{first['refused']})"
            )
        counts.append((shown, usable, len(rows) - usable))
    for shown, usable, skipped in counts:
        log.info("%s: %d images%s", shown, usable, f" ({skipped} skipped)" if skipped else "")


def _packages(job: JobConfig) -> None:
    """The optimizer's, the float8 matmuls' and the trackers' packages are installed."""
    if package := missing_package(job.train.optimizer):
        raise ConfigError(
            f"train.optimizer = {job.train.optimizer!r} needs the {package} package: "
            "pip install 'raytuner[lowvram]', or use adamw or adafactor"
        )
    if job.train.float8_matmul and float8_matmul.missing_package():
        raise ConfigError(
            "train.float8_matmul = true needs the torchao package: pip install "
            "'raytuner[fp8]', or set train.float8_matmul = false"
        )
    _trackers(job.tracking)


def _float8_matmul(job: JobConfig, family) -> None:
    """Float8 matrix products are for the transformer families' blocks."""
    if job.train.float8_matmul and not family.blocks.float8_matmul:
        from raytuner.families import FAMILIES

        able = ", ".join(n for n, f in FAMILIES.items() if f.blocks.float8_matmul)
        raise ConfigError(
            f"train.float8_matmul = true: the {family.name} denoiser's linears are not made "
            f"for float8 here (allowed for {able}); set train.float8_matmul = false"
        )


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


def _trackers(t: TrackingConfig) -> None:
    if t.wandb and tracking.missing():
        raise ConfigError(
            "tracking.wandb = true needs the wandb package, which is not installed: "
            f"{tracking.INSTALL} (or pip install wandb), or set tracking.wandb = false"
        )


def _bucket_sizes(pre: PreprocessConfig, family) -> None:
    """Bucket sides are multiples of the bucket step, which the model's pixel grid must divide;
    the square bucket (resolution²) is one of them."""
    grid = family.geometry.pixel_grid
    if pre.bucket_step % grid:
        raise ConfigError(
            f"preprocess.bucket_step = {pre.bucket_step}: {family.name} runs only on image sides "
            f"that are multiples of {grid} pixels; use a multiple of {grid} "
            f"(0: the family's {family.geometry.pixel_multiple})"
        )
    step = pre.bucket_step or family.geometry.pixel_multiple
    if pre.resolution % step:
        near = max(step, round(pre.resolution / step) * step)
        raise ConfigError(
            f"preprocess.resolution = {pre.resolution} is not a multiple of the bucket step "
            f"{step} (preprocess.bucket_step, or {family.name}'s pixel multiple when 0): "
            f"use a multiple of {step}, e.g. {near}"
        )
    side = family.geometry.default_resolution
    if not pre.resolution and side % step:
        raise ConfigError(
            f"preprocess.bucket_step = {step} does not divide {family.name}'s default "
            f"resolution {side}: set preprocess.resolution to a multiple "
            f"of {step}, or a bucket step that divides {side}"
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
    if objective.flow.guidance != 1.0 and not family.guidance.embedding:
        raise ConfigError(
            f"objective.flow.guidance = {objective.flow.guidance}: {family.name}'s denoiser has no "
            "guidance embedding, so the value would be ignored; remove the key (or set it to 1.0)"
        )


def _validation_prompts(v: ValidationConfig, family) -> None:
    """The prompts file reads and every line is one the family can render; a negative prompt
    needs a family with classifier-free guidance (``negative_prompt``)."""
    from raytuner.render import prompts

    if v.negative_prompt and not family.guidance.negative_prompt:
        raise ConfigError(
            f"validation.negative_prompt = {v.negative_prompt!r}: {family.name}'s pipeline takes "
            "no negative prompt (no classifier-free guidance); remove the key"
        )
    try:
        for key in ("width", "height"):
            prompts.on_grid(f"validation.{key} =", getattr(v, key), family)
    except prompts.PromptsError as e:
        raise ConfigError(f"{e}; 0 renders at the job's resolution") from None
    if not v.prompts_file:
        return
    try:
        for line in prompts.read_prompts_file(v.prompts_file):
            prompts.check_line(line, family)
    except prompts.PromptsError as e:
        raise ConfigError(f"validation.prompts_file = {v.prompts_file!r}: {e}") from None
