"""Validation images while training layout.

Every ``validation.every_steps`` the workers write a checkpoint; once Ray Train has persisted it,
a callback on Ray Train's controller hands its path to a validation actor and returns (the
actor only queues it). The actor renders the job's prompts x seeds with that checkpoint on a
thread of its own and writes ``<run>/validation/step_<N>.png`` (a grid, a row per prompt),
``step_<N>.json`` and a TensorBoard image; a video family's clips go to
``step_<N>/<i>-<prompt>-seed<s>.mp4`` and the grid shows their posters. Training ranks never
wait for it, and a failed render is logged and recorded, never raised into training.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import ray

from raytuner import storage
from raytuner.checkpoint import layout
from raytuner.checkpoint.layout import VALIDATION
from raytuner.config import ConfigError, MergeAdapterConfig, TrackingConfig
from raytuner.lora.find import find_weights
from raytuner.observe import metrics
from raytuner.observe.observer import ValidationReport
from raytuner.render import clips, prompts, sample
from raytuner.render.callback import QUEUE_TIMEOUT_S, ValidationCallback

log = logging.getLogger("raytuner.validation")
DRAIN_TIMEOUT_S = 900.0  # after training: how long the driver waits for the last renders
CLOSE_TIMEOUT_S = 120.0  # how long the driver waits for the actor's TensorBoard/W&B files


@dataclass(frozen=True, kw_only=True)
class RenderSpec:
    """What the validation actor renders, and where it writes."""

    family: str
    pretrained: str
    revision: str
    dtype: str  # model.dtype
    prompts: list[str]
    seeds: list[int]
    steps: int
    size: tuple[int, int]
    run_dir: str
    tensorboard: bool
    blocks_to_swap: int = 0  # memory.blocks_to_swap: the denoiser streams as in training
    # validation.prompts_file's lines (``prompts.PromptLine`` as dicts), rendered after
    # ``prompts`` with their own options
    prompt_lines: list[dict] = field(default_factory=list)
    negative_prompt: str = ""  # validation.negative_prompt
    guidance_scale: float = 0.0  # validation.guidance_scale; 0: the family's default
    distilled: str = "auto"  # validation.distilled
    single_file_config: str = ""  # model.single_file_config (a single-file pretrained)
    expert: str = ""  # model.expert (a mixture of experts: the one the run trains)
    tracking: dict | None = None  # the job's [tracking] when tracking.wandb: grids to W&B too
    frames: int = 1  # a clip's frames where a line sets none (prompts.clip_frames); 1: images
    fps: float = 16.0  # validation.fps
    merge_adapters: list[dict] = field(default_factory=list)  # model.merge_adapters, merged


def _prompt_lines(spec: RenderSpec) -> list[prompts.PromptLine]:
    """``validation.prompts``, then the prompts file's lines."""
    lines = [prompts.PromptLine(prompt=p) for p in spec.prompts]
    return lines + [prompts.PromptLine(**d) for d in spec.prompt_lines]


def _defaults(spec: RenderSpec, family, distilled: bool) -> prompts.Defaults:
    """What a prompt takes where its line sets nothing: the job's [validation] keys, else the
    family's steps (a distilled model's: its few steps)."""
    return prompts.Defaults(
        size=tuple(spec.size),
        seeds=tuple(spec.seeds),
        steps=spec.steps or (None if distilled else family.guidance.default_steps),
        guidance_scale=spec.guidance_scale,
        negative_prompt=spec.negative_prompt,
        frames=spec.frames,
        fps=spec.fps,
    )


class Validator:
    """The validation actor: ``enqueue`` returns at once, ``drain`` waits for the queue."""

    def __init__(self, spec: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        self.spec = RenderSpec(**spec)
        self.run = storage.basename(self.spec.run_dir)
        self.pipe, self.writer, self.closed = None, None, False
        # close() runs on the actor's thread while a render may be on its way (a stopped run)
        self.writer_lock = threading.Lock()
        self.jobs: queue.Queue = queue.Queue()
        self.results: list[dict] = []
        self.scratch = tempfile.mkdtemp(prefix="raytuner-validation-")
        self.fetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytuner-fetch")
        threading.Thread(target=self._work, name="raytuner-validation", daemon=True).start()

    def enqueue(self, step: int, path: str, filesystem) -> int:
        """Queue a render of the checkpoint at ``path``. What it renders with (a LoRA's export,
        a full fine-tune's weights) is copied at once, on a thread: Ray Train deletes
        checkpoints beyond ``checkpoint.keep`` while renders wait."""
        copied = self.fetch.submit(self._copy, step, path, filesystem)
        self.jobs.put((step, path, copied))
        return self.jobs.qsize()

    def _copy(self, step: int, path: str, filesystem) -> str:
        target = os.path.join(self.scratch, f"step_{step:06d}")
        names = layout.trained_files(filesystem, path)  # never the optimizer state
        return storage.copy_named(filesystem, path, names, target)

    def drain(self) -> list[dict]:
        self.jobs.join()
        return self.results

    def close(self) -> None:
        """The TensorBoard and W&B writers closed (their files complete, remote copies made)."""
        with self.writer_lock:
            if self.writer is not None:
                self.writer.close()
            self.writer, self.closed = None, True

    def _work(self) -> None:
        while True:
            step, path, copied = self.jobs.get()
            try:
                self.results.append(self._render(step, path, copied.result()))
            except Exception as e:  # a failed render is reported, never fatal to training
                log.exception("validation at step %d failed (training goes on)", step)
                self.results.append({"step": step, "error": f"{type(e).__name__}: {e}"})
            finally:
                self.jobs.task_done()

    def _render(self, step: int, path: str, local: str) -> dict:
        from raytuner.families import get_family, parts

        started, started_at, s = time.perf_counter(), time.time(), self.spec
        family, device = get_family(s.family, s.expert), sample.default_device()
        if self.pipe is None:
            log.info("validation: loading the %s pipeline for the renders", s.family)
            source = parts.model_source(s, device)  # the spec carries [model]'s fields
            swap = s.blocks_to_swap
            merged = [MergeAdapterConfig(**a) for a in s.merge_adapters]
            self.pipe = sample.load_pipeline(family, source, None, device, swap, merged)
        with self.writer_lock:
            if self.writer is None and not self.closed:
                tracked = TrackingConfig(**s.tracking) if s.tracking else None
                self.writer = ValidationReport(s.run_dir, s.tensorboard, tracked)
        try:
            weights = find_weights(local)
            sample.apply_weights(self.pipe, family, weights, device, None, s.blocks_to_swap)
            options = family.pipeline_options(self.pipe)
            distilled = prompts.is_distilled(family, self.pipe, s.pretrained, s.distilled)
            defaults = _defaults(s, family, distilled)
            renders = prompts.resolve(_prompt_lines(s), family, defaults, distilled)
            rows = sample.render(self.pipe, options, renders)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        fs, folder = storage.resolve(storage.join(s.run_dir, VALIDATION))
        name = layout.validation_step(step)
        rows, written = sample.write_clips(rows, renders, fs, f"{folder}/{name}", s.fps)
        sheet = sample.grid(rows)  # a clip's poster in its place
        seconds = time.perf_counter() - started
        record = {"step": step, "checkpoint": path, "seconds": seconds}
        record |= {"started_at": started_at, "finished_at": time.time()}
        record |= {"prompts": [r.prompt for r in renders], "seeds": s.seeds}
        record |= {"steps": defaults.steps, "distilled": distilled}
        record["lines"] = [r.record() for r in renders]  # each prompt's options, as rendered
        if written:
            record |= {"clips": [f"{name}/{c}" for c in written], "fps": s.fps}
            record["codec"] = clips.codec()
        storage.write_atomic(fs, f"{folder}/{name}.png", sample.png_bytes(sheet))
        storage.write_json_atomic(fs, f"{folder}/{name}.json", record)
        with self.writer_lock:  # closed meanwhile: the PNG and its record are written already
            if self.writer is not None:
                self.writer.image(step, np.asarray(sheet), seconds)
        metrics.gauge("raytuner_validation_time_s", seconds, self.run)
        log.info("validation at step %d: %s/%s.png (%.1f s)", step, folder, name, seconds)
        return record | {"path": f"{folder}/{name}.png"}


def _file_lines(path: str) -> list[dict]:
    """validation.prompts_file's lines, read on the driver (the actor may run elsewhere)."""
    if not path:
        return []
    try:
        return [asdict(p) for p in prompts.read_prompts_file(path)]
    except prompts.PromptsError as e:  # raytuner check refuses it before a run starts
        raise ConfigError(f"validation.prompts_file = {path!r}: {e}") from None


def start(job, family, run_dir: str):
    """The validation actor and its Ray Train callback, or (None, []) when validation is off."""
    v = job.validation
    if not v.every_steps:
        return None, []
    width, height = sample.default_size(job, family)
    spec = RenderSpec(
        family=job.model.family,
        pretrained=job.model.pretrained,
        revision=job.model.revision,
        dtype=job.model.dtype,
        single_file_config=job.model.single_file_config,
        expert=job.model.expert,
        prompts=list(v.prompts),
        seeds=list(v.seeds),
        steps=v.steps,
        size=(v.width or width, v.height or height),
        run_dir=run_dir,
        tensorboard=job.train.tensorboard,
        tracking=asdict(job.tracking) if job.tracking.wandb else None,
        blocks_to_swap=job.memory.blocks_to_swap,
        prompt_lines=_file_lines(v.prompts_file),
        negative_prompt=v.negative_prompt,
        guidance_scale=v.guidance_scale,
        distilled=v.distilled,
        frames=prompts.clip_frames(v.frames, job.data.frames, family),
        fps=v.fps,
        merge_adapters=[asdict(a) for a in job.model.merge_adapters],
    )
    actor = ray.remote(Validator).options(num_cpus=v.cpus, num_gpus=v.gpus or None)
    validator = actor.remote(asdict(spec))
    return validator, [ValidationCallback(validator, v.every_steps, job.train.max_steps)]


def finish(validator, completed: bool) -> None:
    """After training: wait for the queued renders (a completed run), then end the actor."""
    if validator is None:
        return
    try:
        ready, _ = ray.wait([validator.__ray_ready__.remote()], timeout=QUEUE_TIMEOUT_S)
        if not ready:
            log.warning("the validation actor never started: no validation images")
        elif completed:
            log.info("training done: waiting for the last validation renders")
            for r in ray.get(validator.drain.remote(), timeout=DRAIN_TIMEOUT_S):
                if "error" in r:
                    log.warning("validation at step %d failed: %s", r["step"], r["error"])
        if ready:
            ray.get(validator.close.remote(), timeout=CLOSE_TIMEOUT_S)
    except ray.exceptions.RayError as e:
        log.warning("validation did not finish: %s", e)
    finally:
        ray.kill(validator)
