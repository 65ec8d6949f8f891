"""The job check: the one place a job is refused before anything starts. ``check_job(job,
family)`` runs every rule; the API (``raytuner.api.check``) calls it once for every operation,
so `raytuner check` and every command refuse the same jobs. A job's own sections checked their
values and each other when it was loaded (``config/``); the rules here need the family, this
installation or this machine. docs/architecture.md's table of the job check lists each rule,
what it refuses and where it lives: ``model.py`` (the family's denoiser, pipeline and
objective), ``lora.py`` (the LoRA), ``machine.py`` (packages, outputs, image folders),
``experts.py`` (a run of every expert of a mixture).

What each operation asks for (its keywords): every rule for `raytuner check`, ``preprocess``
and ``run``, and for ``cache verify --repair``, ``bench train`` and ``bench preprocess
--images 0``, which encode the job's images. ``reads_images=False`` for the operations that
read the committed cache and not the images (``train``, ``sample``, ``cache verify`` and
``cache gc``, ``bench step`` and ``bench feed``): a folder deleted or unmounted after its
preprocess does not stop them, and the encoder pool, which they do not run, is not
sized. ``runs=False`` for ``plan`` alone, which builds the model on the
meta device, runs no optimizer and reads and writes none of the job's data: the optional
packages, the image folders and the output paths are not looked at (``jobs/flux-12gb.toml``
plans without bitsandbytes, the shipped jobs without their ``/data`` folders); the rest, about
the model, still is.
"""

from __future__ import annotations

import logging

from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.jobcheck import encoders, experts, lora, machine, model

__all__ = ["check_job"]
log = logging.getLogger(__name__)


def check_job(job: JobConfig, family, *, runs: bool = True, reads_images: bool = True) -> None:
    """Raise ConfigError naming the key, its value and what to change. ``runs=False`` (plan)
    leaves out the optional packages, the image folders and the outputs; ``reads_images=False``
    the image folders (see the module's docstring for which operation passes what). What a
    run can do but likely does not mean is logged as a warning (stderr), not refused."""
    model.bucket_sizes(job.preprocess, family)
    model.frame_counts(job.data, family)
    model.clip_rates(job.data, family)
    model.objective_kind(job.objective, family)
    experts.turns(job, family)  # before the rules its refusals would trip otherwise
    model.sharding(job)
    model.compiling(job, family)
    model.float8_matmul(job, family)
    model.first_frame(job, family)
    model.references(job.data, family)
    lora.kind(job)
    lora.init_from(job)
    lora.text_encoder(job.lora, family)
    if runs:
        machine.packages(job)
    model.model_file(job.model, family)
    model.validation_prompts(job.validation, family)
    # a released repo: its architecture from the package, no download
    model.blocks_to_swap(job.memory, family, parts.model_source(job.model, "cpu"))
    lora.adapter(job, family)  # builds the model on the meta device when needed
    lora.merge_adapters(job, family)  # builds the denoiser on the meta device when set
    if runs:  # plan decides on its own --gpu-memory
        model.worker_memory(job, family)  # traces the step on the meta device when named
    if runs:
        machine.outputs_outside_ray_working_dir(job)
    if runs and reads_images:  # the operations that run the encoder pool
        encoders.encoder_pool(job, family)  # builds the text encoder on meta when sized
        machine.image_folders(job.data)  # last: the slow one
    # once the job passed: a refused job's error stays its one line
    if warning := job.train.warmup_warning():  # known here unless train.epochs sets the steps
        log.warning(warning)
