"""Images from trained weights: the family's diffusers pipeline with a run's LoRA or fine-tuned
denoiser, a PNG per prompt and seed, and a grid of them (prompts as rows, seeds as columns). A
render of more than one frame (a video family's clip) is an mp4 and its poster, a strip of its
frames, which stands in the grid for it (``render/clips.py``).

Used by `raytuner sample` and by the validation renders during training.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch
from PIL import Image

from raytuner import placement, quiet, storage
from raytuner.checkpoint import full_model, layout
from raytuner.families import mixture
from raytuner.lora import apply as lora_apply
from raytuner.lora import merge
from raytuner.lora.find import ExportedWeights, find_weights
from raytuner.render import clips
from raytuner.render.prompts import Defaults, PromptLine, Render, is_distilled, resolve

LATEST = "latest"  # --checkpoint: the run's newest complete checkpoint
BASE = "base"  # --checkpoint: the pretrained model alone, for comparison


def latest_checkpoint(output: str, name: str) -> tuple[pafs.FileSystem, str]:
    """The newest complete checkpoint of the job's runs (a run started beside it with
    ``checkpoint.resume = false`` included)."""
    if (found := layout.latest_checkpoint(output, name)) is None:
        where = layout.run_dir(output, name)
        raise FileNotFoundError(f"no complete checkpoint under {where}: train the job first")
    return found


def load_pipeline(
    family, source, weights: ExportedWeights | None, device: str, blocks_to_swap=0, merged=()
):
    """The family's pipeline on ``device``, its weights in ``source.dtype`` (``model.dtype``:
    bfloat16 on CUDA, float32 on a CPU by default), the adapters of ``merged``
    (``model.merge_adapters``) merged into its denoiser as training merged them, with
    ``weights`` applied, the denoiser's last ``blocks_to_swap`` blocks streamed as in training
    (``memory.blocks_to_swap``)."""
    pipe = family.pipeline(source)
    pipe.set_progress_bar_config(disable=True)
    if merged:
        denoiser = _denoiser_of(pipe, family)
        merge.into(denoiser, merge.read(merged, family, denoiser))
    apply_weights(pipe, family, weights, device, source.dtype, blocks_to_swap)
    return pipe


def _denoiser_of(pipe, family):
    """The pipeline's denoiser as training holds it: a run of every expert's in one
    ``ExpertMixture`` of the pipeline's own modules (each entry merges into its expert's)."""
    if family.turns:
        return mixture.ExpertMixture({e.part: getattr(pipe, e.part) for e in family.turns})
    return getattr(pipe, family.parts.denoiser)


def apply_weights(
    pipe, family, weights: ExportedWeights | None, device: str, dtype=None, blocks_to_swap=0
) -> None:
    """Put ``weights`` into ``pipe`` in place of any applied before (a LoRA is unloaded first;
    a fine-tuned denoiser replaces the current one, loaded in ``dtype``), then place it."""
    placement.unplace_pipeline(pipe)  # streamed blocks back whole before weights change
    if weights is not None and weights.kind == "lora":
        pipe.unload_lora_weights()
        for on, path in lora_files(family, weights):
            _load_lora(pipe, on, path)
    elif weights is not None:
        part = family.parts.denoiser
        cls = type(getattr(pipe, part))
        dtype = dtype or getattr(pipe, part).dtype
        if weights.kind == "checkpoint":  # read a block at a time from the checkpoint
            trained, current = full_model.Trained(weights.path), getattr(pipe, part)
            denoiser = full_model.load_denoiser(cls, trained, dtype, "cpu", like=current)
        else:
            denoiser = cls.from_pretrained(os.path.join(weights.path, part), torch_dtype=dtype)
        pipe.register_modules(**{part: denoiser})
    placement.place_pipeline(pipe, family, device, blocks_to_swap)


def lora_files(family, weights: ExportedWeights) -> list[tuple[object, Path]]:
    """(the family training its expert, the file) of each LoRA file of ``weights``: every
    expert's of a run of them all (``lora/<expert>/``); a file of one expert of a mixture
    (its ``raytuner.expert`` metadata) onto that expert; any other onto the denoiser."""
    if weights.experts:
        return [(family.with_expert(name), Path(path)) for name, path in weights.experts]
    path = Path(weights.path)
    if family.experts:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            named = (f.metadata() or {}).get("raytuner.expert", "")
        if named in {e.name for e in family.experts}:
            return [(family.with_expert(named), path)]
    return [(family, path)]


def _load_lora(pipe, family, path: Path) -> None:
    """One LoRA file into ``pipe``'s denoiser (``family``'s: an expert's where it trains one)."""
    if lora_apply.kind_of(str(path)) in lora_apply.PEFT_KINDS:  # LoKr, LoHa: through peft
        part = family.parts.denoiser
        lora_apply.apply_file(getattr(pipe, part), str(path), family.lora_part)
        return
    with quiet.no_loading_bars():  # a bar per text encoder the LoRA trained
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, **family.lora_load)


def render(pipe, options: dict, renders: list[Render]) -> list[list[Image.Image | np.ndarray]]:
    """One image per render (a prompt with its settled options, ``render/prompts.py``) and seed
    (rows: renders), or, for a render of more than one frame, its clip: uint8 [F, H, W, 3]; the
    same seed gives the same noise for every prompt of a size, so rows compare. ``options``:
    the family's ``pipeline_options`` (a render's own settings win: a line's steps over a
    distilled model's few-step default, its frames over the one frame an image takes)."""
    device = pipe.device

    def image(r: Render, seed: int) -> Image.Image | np.ndarray:
        generator = torch.Generator(device).manual_seed(seed)
        # the prompt by name: FLUX.2's pipelines take an image first; the render's settings
        # win over the family's options
        call = options | _with_references(r.call(), r)
        if r.frames > 1:  # a video pipeline's frames: [B, F, H, W, 3] in [0, 1]
            out = pipe(prompt=r.prompt, generator=generator, output_type="np", **call)
            return clips.to_uint8(np.asarray(out.frames[0]))
        out = pipe(prompt=r.prompt, generator=generator, output_type="pil", **call)
        # an image pipeline's first image; a video pipeline's (a one-frame clip) first frame
        return out.images[0] if hasattr(out, "images") else out.frames[0][0]

    return [[image(r, seed) for seed in r.seeds] for r in renders]


def _with_references(call: dict, r: Render) -> dict:
    """The call with its reference images opened, each at the render's size (as training saw
    them: an edit pair's images share the target's bucket); one image alone where the family
    takes one."""
    if not r.references:
        return call
    images = []
    for path in r.references:
        fs, where = storage.resolve(path)
        with Image.open(io.BytesIO(storage.read_bytes(fs, where))) as image:
            rgb = image.convert("RGB")
        images.append(rgb.resize((r.width, r.height), Image.Resampling.LANCZOS))
    return call | {r.reference_argument: images[0] if len(images) == 1 else images}


def grid(rows: list[list[Image.Image]]) -> Image.Image:
    """The images as a grid, a row per prompt. Every cell is as large as the largest image;
    a smaller one (a prompt line of another size) is centred in its cell on white."""
    w = max(image.width for row in rows for image in row)
    h = max(image.height for row in rows for image in row)
    columns = max(len(r) for r in rows)
    sheet = Image.new("RGB", (w * columns, h * len(rows)), "white")
    for y, row in enumerate(rows):
        for x, image in enumerate(row):
            sheet.paste(image, (x * w + (w - image.width) // 2, y * h + (h - image.height) // 2))
    return sheet


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _slug(text: str) -> str:
    kept = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
    return "-".join(part for part in kept.split("-") if part)[:40] or "prompt"


def file_stem(index: int, r: Render, seed: int) -> str:
    """A render's files' name without its suffix: ``<i>-<prompt>-seed<s>``."""
    return f"{index:02d}-{_slug(r.prompt)}-seed{seed}"


def write_clips(rows, renders: list[Render], fs, folder: str, fps: float):
    """Each clip of ``rows`` (``render``'s) as ``<folder>/<i>-<prompt>-seed<s>.mp4`` at ``fps``,
    atomically; returns the rows with each clip's poster in its place (images as they are) and
    the names of the mp4s written."""
    cells, names = [], []
    for i, (r, row) in enumerate(zip(renders, rows, strict=True)):
        cells.append([])
        for seed, cell in zip(r.seeds, row, strict=True):
            if r.frames > 1:
                names.append(file_stem(i, r, seed) + layout.CLIP_SUFFIX)
                storage.write_atomic(fs, f"{folder}/{names[-1]}", clips.mp4_bytes(cell, fps))
                cell = clips.poster(cell)
            cells[-1].append(cell)
    return cells, names


def write_samples(rows, renders: list[Render], out: Path, record: dict, fps: float = 16.0):
    """``<i>-<prompt>-seed<s>.png`` per image (a clip: its ``.mp4`` and its poster as the
    ``.png``), ``grid.png`` when there are several, and ``samples.json`` (what was rendered
    with which weights, and each prompt's options under ``lines``); returns the paths of the
    mp4s and PNGs."""
    local, out = pafs.LocalFileSystem(), out.resolve()
    cells, written = write_clips(rows, renders, local, str(out), fps)
    paths = [out / name for name in written]
    for i, (r, row) in enumerate(zip(renders, cells, strict=True)):
        for seed, image in zip(r.seeds, row, strict=True):
            paths.append(out / f"{file_stem(i, r, seed)}.png")
            storage.write_atomic(local, str(paths[-1]), png_bytes(image))
    if sum(len(row) for row in cells) > 1:
        paths.append(out / "grid.png")
        storage.write_atomic(local, str(paths[-1]), png_bytes(grid(cells)))
    if written:
        record |= {"fps": fps, "codec": clips.codec()}
    record |= {"prompts": [r.prompt for r in renders], "lines": [r.record() for r in renders]}
    record["files"] = [p.name for p in paths]
    storage.write_json_atomic(local, str(out / "samples.json"), record)
    return paths


def render_samples(
    job, family, checkpoint: str, lines: list[PromptLine], defaults: Defaults, out: str,
    fps: float = 0.0,
    merged: bool = True,
):  # fmt: skip
    """`raytuner sample`: render each prompt line with its options (else ``defaults``: every
    seed, the size, the steps, the frames) with the job's trained weights, on the base with
    ``model.merge_adapters`` merged as training had it (``merged=False``: the base alone, as
    the exported LoRA is used elsewhere); returns the files written (clips at ``fps``, 0:
    validation.fps)."""
    from raytuner.families import parts

    renders = resolve(lines, family, defaults)  # refuses what the family cannot render
    if checkpoint == LATEST:
        fs, source = latest_checkpoint(job.train.output, job.train.name)
    elif checkpoint != BASE:
        fs, source = storage.resolve(checkpoint)
    device = default_device()
    with tempfile.TemporaryDirectory() as scratch:
        weights = None if checkpoint == BASE else find_weights(_local(fs, source, scratch))
        m = job.model
        model = parts.model_source(m, device)
        adapters = job.model.merge_adapters if merged else ()
        pipe = load_pipeline(family, model, weights, device, job.memory.blocks_to_swap, adapters)
        options = family.pipeline_options(pipe)
        distilled = is_distilled(family, pipe, m.pretrained, job.validation.distilled)
        renders = resolve(lines, family, defaults, distilled)
        rows = render(pipe, options, renders)
    record = {"checkpoint": BASE if checkpoint == BASE else source, "steps": defaults.steps}
    record["distilled"] = distilled
    record["merged_adapters"] = [asdict(a) for a in job.model.merge_adapters] if merged else []
    record |= {"size": list(defaults.size), "seeds": list(defaults.seeds)}
    return write_samples(rows, renders, Path(out), record, fps or job.validation.fps)


def _local(fs: pafs.FileSystem, path: str, scratch: str) -> str:
    """``path`` on local disk: of a checkpoint, what renders read (never its optimizer state);
    anything else, as it is."""
    try:
        names = layout.trained_files(fs, path)
    except FileNotFoundError:  # not a checkpoint: a LoRA file, a run's lora/ or model/ folder
        return storage.local_copy(fs, path, scratch)
    return storage.local_files(fs, path, names, scratch)


def default_size(job, family) -> tuple[int, int]:
    side = job.preprocess.resolution or family.geometry.default_resolution
    return side, side


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
