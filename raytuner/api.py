"""raytuner's Python API: the operations a user scripts. `raytuner …` (``cli.py``) and the demo
are thin callers of these; ``import raytuner`` gives them (``raytuner.train(job)``…).

    import raytuner

    job = raytuner.load_job("jobs/tiny.toml", ["train.max_steps=20"])
    raytuner.check(job)                       # what every call refuses, as ConfigError
    report = raytuner.preprocess(job)         # the cache's report (dict)
    summary = raytuner.train(job)             # step, loss, where the LoRA / model went
    files = raytuner.sample(job, ["a red circle"], seeds=[0, 1])
    fit = raytuner.plan(job, "24GiB")         # memory per worker, what fits

Each call connects to Ray where it needs it (``RAY_ADDRESS``, else a local Ray). Torch, Ray and
diffusers are imported inside the calls: importing the API is cheap.
"""

from __future__ import annotations

import logging
import sys

from raytuner.config import ConfigError, JobConfig, load_job

log = logging.getLogger("raytuner")

__all__ = ["ConfigError", "JobConfig", "check", "load_job", "plan", "preprocess", "run"]
__all__ += ["sample", "train"]


def check(job: JobConfig, *, runs: bool = True, reads_images: bool = True):
    """Refuse (``ConfigError``) what the job's family and this installation cannot run, before
    anything starts; returns the job's family. Every operation below calls it once; the
    config's own sections checked each other when it was loaded. ``raytuner.check(job)`` (and
    `raytuner check`) refuses all a run would trip over. ``runs=False``: the operation only sizes
    the job (``plan``): no optional package, image folder or output path is looked at;
    ``reads_images=False``: it reads the committed cache, not the image folders (``train``,
    ``sample``). See ``raytuner.jobcheck``."""
    from raytuner.families import get_family
    from raytuner.jobcheck import check_job

    family = get_family(job.model.family, job.model.expert)
    check_job(job, family, runs=runs, reads_images=reads_images)
    return family


def _preprocess(job: JobConfig, family) -> dict:
    from raytuner import runtime
    from raytuner.preprocess.job import update_cache

    runtime.connect()
    return update_cache(job.model, job.data, job.preprocess, job.train.name, family=family)


def _train(job: JobConfig, family) -> dict:
    from raytuner import runtime

    if "raytuner.train.trainer" not in sys.modules:  # seconds of imports, more on a busy host
        log.info("train: loading Ray Train, torch and the model's libraries")
    from raytuner.tools.plan import adopt
    from raytuner.train import trainer

    runtime.connect()
    return trainer.train(adopt.before_workers(job, family), family)


def preprocess(job: JobConfig) -> dict:
    """Bring the job's cache up to date with its images; returns the preprocess report."""
    return _preprocess(job, check(job))


def train(job: JobConfig) -> dict:
    """Train (or resume) the job's run on its committed cache; returns the summary."""
    return _train(job, check(job, reads_images=False))


def run(job: JobConfig, on_report=None) -> dict:
    """Preprocess, then train: ``{"report": …, **summary}``; ``on_report(report)`` is called
    between the two (the CLI prints it)."""
    family = check(job)
    report = _preprocess(job, family)
    if on_report is not None:
        on_report(report)
    return {"report": report, **_train(job, family)}


def sample(
    job: JobConfig,
    prompts: list[str] = (),
    *,
    prompts_file: str = "",
    checkpoint: str = "latest",
    seeds: list[int] = (0,),
    steps: int = 20,
    width: int = 0,
    height: int = 0,
    out: str = "samples",
    frames: int = 0,
    fps: float = 0.0,
    merged: bool = True,
    references: list[str] = (),
) -> list:
    """Render ``prompts`` (and the lines of a kohya-style ``prompts_file``) with the job's
    trained weights: ``checkpoint`` is "latest" (the newest checkpoint of the job's runs),
    "base" (no trained weights) or a path; ``width``/``height`` 0: the job's resolution;
    ``references``: the reference images of every prompt whose line names none (``--ci``), for a
    family that takes them. A video family renders clips of ``frames`` (0:
    ``validation.frames``, else the largest ``data.frames`` bucket) at ``fps`` (0:
    ``validation.fps``): an mp4 and its poster each. ``merged=False``: without
    ``model.merge_adapters`` (on the base alone). Returns the files written under ``out``."""
    from raytuner.render import prompts as prompt_lines
    from raytuner.render.sample import default_size, render_samples

    family = check(job, reads_images=False)
    lines = [prompt_lines.PromptLine(prompt=p) for p in prompts]
    try:
        lines += prompt_lines.read_prompts_file(prompts_file) if prompts_file else []
        for line in lines:
            prompt_lines.check_line(line, family)
    except prompt_lines.PromptsError as e:
        raise ConfigError(f"prompts file {prompts_file}: {e}") from None
    if not lines:
        raise ConfigError("sample: give at least one prompt or a prompts file")
    try:
        prompt_lines.check_references("--reference", tuple(references), family)
        for line in lines:
            where = f"line {line.line}" if line.line else f"--prompt {line.prompt!r}"
            prompt_lines.check_required(where, line.references or references, family)
    except prompt_lines.PromptsError as e:
        raise ConfigError(f"sample {e}") from None
    _sample_options(family, seeds, steps, width, height)
    _clip_options(family, frames, fps)
    v = job.validation  # its negative prompt and guidance scale apply here too
    side_w, side_h = default_size(job, family)
    defaults = prompt_lines.Defaults(
        size=(width or side_w, height or side_h),
        seeds=tuple(seeds),
        steps=steps,
        guidance_scale=v.guidance_scale,
        negative_prompt=v.negative_prompt,
        frames=prompt_lines.clip_frames(frames or v.frames, job.data.frames, family),
        references=tuple(references),
        fps=fps or v.fps,
    )
    return render_samples(job, family, checkpoint, lines, defaults, out, fps, merged)


def _sample_options(family, seeds, steps, width, height) -> None:
    """`raytuner sample`'s ``--seed``, ``--steps``, ``--width``, ``--height`` in the ranges of
    the prompt-line options they stand for (``--d``, ``--s``, ``--w``, ``--h``), sizes on the
    family's pixel grid."""
    from raytuner.render import prompts as prompt_lines

    sides = [("--width", "w", width), ("--height", "h", height)]
    options = [("--seed", "d", seed) for seed in seeds]
    options += [("--steps", "s", steps)] if steps is not None else []  # None: the pipeline's
    options += [side for side in sides if side[2]]  # 0: the job's resolution
    try:
        for flag, letter, value in options:
            prompt_lines.in_range(flag, letter, value)
        for flag, _, value in sides:
            prompt_lines.on_grid(flag, value, family)
    except prompt_lines.PromptsError as e:
        raise ConfigError(f"sample: {e}") from None


def _clip_options(family, frames: int, fps: float) -> None:
    """`raytuner sample`'s ``--frames`` (0: the job's) in the range of a line's ``--f`` and a
    count the family renders, ``--fps`` (0: the job's) in ``validation.fps``' range."""
    from raytuner.config.sections import MAX_FPS
    from raytuner.render import prompts as prompt_lines

    try:
        if frames:
            prompt_lines.in_range("--frames", "f", frames)
        prompt_lines.frame_count("--frames", frames, family)
    except prompt_lines.PromptsError as e:
        raise ConfigError(f"sample: {e}") from None
    if fps and not 0 < fps <= MAX_FPS:
        raise ConfigError(f"sample: --fps {fps}: must be > 0 and <= {MAX_FPS:g} (frames a second)")


def plan(job: JobConfig, gpu_memory: str = "") -> dict:
    """What one training worker holds at its peak (weights, optimizer, activations) and the
    settings that fit ``gpu_memory``: a number and its unit, ``"24GiB"``/``"512MiB"`` (binary) or
    ``"24GB"`` (decimal, 22.4 GiB); a bare number is refused (``ConfigError``); "": the job's
    ``scaling.worker_memory``, else ``"80GiB"``. Planning runs
    nothing: the job's optional packages (8-bit AdamW's bitsandbytes, wandb), image folders and
    outputs need not be there."""
    from raytuner.tools.plan.progress import Progress
    from raytuner.tools.plan.report import parse_size

    gpu_memory = gpu_memory or job.scaling.worker_memory or "80GiB"
    memory = parse_size(gpu_memory)
    with Progress() as progress:  # a line at least every 10 s (logger raytuner.plan)
        progress.now("loading torch, diffusers and the model code")
        from raytuner.tools.plan.measure import measure

        family = check(job, runs=False)
        return {"gpu_memory": gpu_memory.strip()} | measure(job, family, memory, True, progress)
