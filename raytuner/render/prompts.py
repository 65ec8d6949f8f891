"""Prompts as users write them: kohya sd-scripts' prompt files, one prompt per line with its own
options, and what every rendered row of a validation grid or `raytuner sample` settles on.

A line is ``<prompt> --w 512 --h 768 --s 20 --d 42 --l 7.5 --n <negative prompt>`` (a video
family's clip length: ``--f 33``, as musubi-tuner's prompt files write it), and for a family that
takes reference images (edit training: Flux.1 Kontext) ``--ci <image>``, repeated for several
(musubi-tuner's control image option; a path relative to the working directory); it is split
at each ``" --"`` as sd-scripts' ``line_to_prompt_dict`` does, option letters in any case, the
last of a repeated option wins. Blank lines and lines starting with ``#`` are skipped. Unlike
sd-scripts, which ignores what it cannot read, a value that is not a number, an unknown option
or one the model cannot use is refused with its line number. A sampler (``--ss``), which
sd-scripts' users' files carry, is accepted and noted in one log line: the pipeline's own
scheduler renders. Pure: no torch, no pipeline.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from raytuner import storage
from raytuner.config.ranges import SEED_MAX, Range
from raytuner.config.sections import MAX_FRAMES, MAX_GUIDANCE, MAX_RENDER_STEPS, MAX_SIDE

# kohya's option letter -> (PromptLine field, what it is)
OPTIONS = {
    "w": ("width", "width in pixels"),
    "h": ("height", "height in pixels"),
    "s": ("steps", "denoising steps"),
    "d": ("seed", "seed"),
    "l": ("scale", "classifier-free guidance scale"),
    "g": ("guidance", "guidance-embedding scale (guidance-distilled models: Flux dev)"),
    "n": ("negative_prompt", "negative prompt"),
    "f": ("frames", "frames of a clip"),
}
SAMPLER = "ss"  # sd-scripts' sampler option: kept on the line, not rendered with
REFERENCE = "ci"  # musubi-tuner's control image: a reference image, repeated for several
# options sd-scripts reads that raytuner does not render with
UNSUPPORTED = {
    "cn": "a ControlNet image",
    "ctr": "a CFG truncation ratio",
    "rcfg": "a CFG renormalisation",
    "fs": "a flow shift: the pipeline's scheduler sets it",
}
# what a number option allows (a size must also be a multiple of the family's pixel grid):
# the ranges of the job's keys each sets (validation.width/height/steps/seeds/guidance_scale)
RANGES = {
    "w": Range(8, MAX_SIDE),
    "h": Range(8, MAX_SIDE),
    "s": Range(1, MAX_RENDER_STEPS),  # sd-scripts clamps --s to 1..1000
    "d": Range(0, SEED_MAX),
    "l": Range(0, MAX_GUIDANCE),
    "g": Range(0, MAX_GUIDANCE),
    "f": Range(1, MAX_FRAMES),  # validation.frames' range
}
log = logging.getLogger("raytuner.prompts")


class PromptsError(ValueError):
    """A prompt line raytuner cannot render; the message names the line."""


@dataclass(frozen=True, kw_only=True)
class PromptLine:
    """One prompt and the options its line sets (None: the job's or the family's default)."""

    prompt: str
    line: int = 0  # its line in the prompts file; 0: not from a file
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    seed: int | None = None
    scale: float | None = None  # --l
    guidance: float | None = None  # --g
    negative_prompt: str | None = None  # --n
    frames: int | None = None  # --f: a clip's frames (video families)
    sampler: str | None = None  # --ss: sd-scripts' sampler; the pipeline's scheduler renders
    references: tuple[str, ...] = ()  # --ci: reference images (families that take them)


@dataclass(frozen=True, kw_only=True)
class Defaults:
    """What a line that does not say takes: the job's (or the command line's) settings."""

    size: tuple[int, int]  # (width, height)
    seeds: tuple[int, ...]
    steps: int | None  # None: the pipeline's default
    guidance_scale: float = 0.0  # 0: the family's default
    negative_prompt: str = ""
    frames: int = 1  # a clip's frames (validation.frames, `sample --frames`); 1: an image
    references: tuple[str, ...] = ()  # reference images of a line that names none (--reference)
    fps: float = 0.0  # a clip's frames a second (validation.fps, `sample --fps`); 0: none given


@dataclass(frozen=True, kw_only=True)
class Render:
    """One row of a grid: a prompt with every option settled, one image (or, ``frames`` > 1,
    one clip) per seed."""

    prompt: str
    line: int
    width: int
    height: int
    steps: int | None
    seeds: tuple[int, ...]
    guidance_scale: float
    negative_prompt: str  # "": none (always "" for families that take none)
    frames: int = 1  # > 1: a clip of that many frames
    # the pipeline's keyword for the scale (the family's guidance.scale_argument)
    scale_argument: str = field(default="guidance_scale", repr=False)
    references: tuple[str, ...] = ()  # reference image files (the family's references)
    # the family's references record: its pipeline keywords for them and for the area
    reference_argument: str = field(default="", repr=False)
    area_argument: str = field(default="", repr=False)
    fps: float = 0.0  # the clip's frames a second, passed as ``fps_argument`` where it has one
    fps_argument: str = field(default="", repr=False)  # the family's geometry.fps_argument

    def call(self) -> dict:
        """The pipeline-call arguments (besides the prompt and the generator); reference
        images as their paths (``sample.render`` opens them)."""
        out = {"width": self.width, "height": self.height, self.scale_argument: self.guidance_scale}
        if self.area_argument:  # the size asked is the size rendered
            out[self.area_argument] = self.width * self.height
        if self.references:
            out[self.reference_argument] = list(self.references)
        if self.steps:
            out["num_inference_steps"] = self.steps
        if self.negative_prompt:  # none at all keeps the pipeline's own empty-prompt handling
            out["negative_prompt"] = self.negative_prompt
        if self.frames > 1:  # diffusers' video pipelines' keyword; 1: the family's options'
            out["num_frames"] = self.frames
        if self.frames > 1 and self.fps_argument and self.fps:
            out[self.fps_argument] = self.fps
        return out

    def record(self) -> dict:
        record = asdict(self) | {"seeds": list(self.seeds)}
        for name in ("scale_argument", "reference_argument", "area_argument"):
            record.pop(name)
        record["references"] = list(self.references)
        return record


def _value(letter: str, text: str, where: str):
    field, what = OPTIONS[letter]
    if not text:
        raise PromptsError(f"{where}: --{letter} needs a value ({what})")
    if field == "negative_prompt":
        return text
    try:
        value = float(text) if letter in "lg" else int(text, 10)
    except ValueError:
        raise PromptsError(f"{where}: --{letter} {text!r} is not a number ({what})") from None
    in_range(f"{where}: --{letter}", letter, value)
    return value


def in_range(option: str, letter: str, value: float) -> None:
    """Refuse a number option's ``value`` outside its range (``RANGES``), naming ``option``
    (``line 3: --d``, or `raytuner sample`'s ``--seed``)."""
    rng = RANGES[letter]
    if not rng.allows(value):
        what = OPTIONS[letter][1]
        raise PromptsError(f"{option} {value}: must be {rng.text(letter in 'whsdf')} ({what})")


def parse_line(text: str, number: int = 0) -> PromptLine | None:
    """A line of a prompts file (None: blank or a comment)."""
    text = text.strip()
    if not text or text.startswith("#"):
        return None
    where = f"line {number}"
    prompt, *parts = text.split(" --")
    prompt = prompt.strip()
    if not prompt or prompt.startswith("--"):
        raise PromptsError(f"{where}: no prompt before its options")
    values = {}
    for part in parts:
        letter, _, value = part.strip().partition(" ")
        letter = letter.lower()
        if letter == SAMPLER:
            values["sampler"] = value.strip()
            continue
        if letter == REFERENCE:
            if not value.strip():
                raise PromptsError(f"{where}: --ci needs a value (a reference image file)")
            values["references"] = (*values.get("references", ()), value.strip())
            continue
        if letter in UNSUPPORTED:
            raise PromptsError(f"{where}: --{letter} ({UNSUPPORTED[letter]}) is not supported")
        if letter not in OPTIONS:
            known = ", ".join(f"--{k}" for k in OPTIONS)
            raise PromptsError(f"{where}: unknown option --{letter}; a line may set {known}")
        values[OPTIONS[letter][0]] = _value(letter, value.strip(), where)
    return PromptLine(prompt=prompt, line=number, **values)


def parse_prompts(text: str) -> list[PromptLine]:
    """Every prompt of a prompts file's text, with its line number."""
    lines = [parse_line(t, n) for n, t in enumerate(text.splitlines(), start=1)]
    found = [p for p in lines if p is not None]
    if not found:
        raise PromptsError("no prompts in it (every line is blank or a # comment)")
    if samplers := [p for p in found if p.sampler is not None]:
        where = ", ".join(str(p.line) for p in samplers[:5]) + (", …" if len(samplers) > 5 else "")
        note = (
            f"prompts: --ss {samplers[0].sampler} (line {where}) is not used: the pipeline's "
            "own scheduler renders"
        )
        if (text, note) not in _NOTED:  # a file is read by check, by validation, ...: once
            _NOTED.add((text, note))
            log.info(note)
    return found


_NOTED: set[tuple[str, str]] = set()  # the notes logged in this process, with their file's text


def read_prompts_file(path: str) -> list[PromptLine]:
    """The prompts of a text file (a local path or a URI); PromptsError says what is wrong."""
    if path.endswith((".toml", ".json")):
        raise PromptsError("only text prompt files are read (one prompt per line)")
    try:
        fs, where = storage.resolve(path)
        raw = storage.read_bytes(fs, where)
    except (OSError, ValueError) as e:
        raise PromptsError(f"cannot read it ({e})") from None
    try:
        return parse_prompts(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise PromptsError(f"not UTF-8 text ({e})") from None


def check_line(p: PromptLine, family) -> None:
    """Refuse options the family's pipeline cannot use, naming the line."""
    where = f"line {p.line}" if p.line else f"prompt {p.prompt!r}"
    if p.negative_prompt is not None and not family.guidance.negative_prompt:
        raise PromptsError(
            f"{where}: --n: {family.name}'s pipeline takes no negative prompt (no "
            "classifier-free guidance); remove --n"
        )
    if p.scale not in (None, 1.0) and not family.guidance.negative_prompt:
        raise PromptsError(
            f"{where}: --l {p.scale}: {family.name} has no classifier-free guidance scale"
            + ("; its guidance embedding is set with --g" if family.guidance.embedding else "")
        )
    if p.guidance is not None and not family.guidance.embedding:
        raise PromptsError(
            f"{where}: --g {p.guidance}: {family.name} has no guidance embedding; its "
            "classifier-free guidance scale is --l"
        )
    for letter, side in (("w", p.width), ("h", p.height)):
        on_grid(f"{where}: --{letter}", side, family)
    frame_count(f"{where}: --f", p.frames, family)
    check_references(where, p.references, family)


def check_references(where: str, references, family) -> None:
    """Refuse reference images a family cannot take, or more than it takes, or files that
    are not there."""
    most = family.references.most
    if references and not most:
        raise PromptsError(
            f"{where}: --ci: {family.name} takes no reference image (an edit model does: "
            "flux-kontext)"
        )
    if len(references) > most:
        raise PromptsError(f"{where}: {len(references)} reference images; {family.name} takes "
                           f"at most {most}")  # fmt: skip
    for path in references:
        fs, there = storage.resolve(path)
        if not storage.exists(fs, there):
            raise PromptsError(f"{where}: --ci {path}: no such file")


def check_required(where: str, references, family) -> None:
    """Refuse a render without a reference image for a family whose pipeline renders only
    from one (``References.required``: Qwen-Image-Edit's)."""
    if family.references.required and not references:
        raise PromptsError(
            f"{where}: {family.name}'s pipeline renders only from a reference image: give the "
            "line --ci <image> (or `raytuner sample --reference <image>` for every line)"
        )


def is_distilled(family, pipe, pretrained: str, setting: str) -> bool:
    """Whether to render as the family's step-distilled release (``validation.distilled``):
    ``auto``: the pipeline's config says ``is_distilled`` (Flux.2 [klein]'s) or ``pretrained``
    is a release the family names as one."""
    if setting != "auto":
        return setting == "yes"
    said = bool(getattr(pipe, "config", {}).get("is_distilled", False))
    return said or pretrained in family.guidance.distilled_repos


def on_grid(option: str, side: int | None, family) -> None:
    """Refuse an image side (``option``: ``line 3: --w``, ``--width``, ``validation.width =``)
    that is not a multiple of the family's pixel grid; None and 0 (the default) pass."""
    if side and side % family.geometry.pixel_grid:
        raise PromptsError(
            f"{option} {side}: {family.name} renders sides that are multiples of "
            f"{family.geometry.pixel_grid} pixels"
        )


def frame_count(option: str, frames: int | None, family) -> None:
    """Refuse a clip length (``option``: ``line 3: --f``, ``--frames``, ``validation.frames =``)
    the family cannot render: a video family's frames are 1 + n x its ``frame_multiple`` (Wan:
    4n + 1), an image family renders one; None and 0 (the default) pass."""
    step = family.geometry.frame_multiple
    if not frames or (step and (frames - 1) % step == 0) or frames == 1:
        return
    if not step:
        raise PromptsError(f"{option} {frames}: {family.name} renders images (one frame)")
    near = 1 + step * max(0, round((frames - 1) / step))
    raise PromptsError(
        f"{option} {frames}: {family.name} renders clips of {step}n + 1 frames "
        f"(1, {1 + step}, {1 + 2 * step}, ...); use e.g. {near}"
    )


def clip_frames(setting: int, buckets: list[int], family) -> int:
    """The frames a render takes where its line sets none: ``setting`` (validation.frames,
    `sample --frames`), else the largest frame bucket (``data.frames``); 1 for image families."""
    if not family.geometry.frame_multiple:
        return 1
    return setting or max(buckets)


def resolve(
    lines: list[PromptLine], family, defaults: Defaults, distilled: bool = False
) -> list[Render]:
    """Each line with its options, or else the defaults, or else the family's (``distilled``:
    those of its step-distilled release: few steps, no classifier-free guidance)."""
    g, renders = family.guidance, []
    for p in lines:
        check_line(p, family)
        scale = p.guidance if g.embedding else p.scale
        if scale is None:
            scale = defaults.guidance_scale or (
                g.distilled_scale if distilled else g.default_scale
            )
        check_required(f"line {p.line}" if p.line else repr(p.prompt),
                       p.references or defaults.references, family)  # fmt: skip
        negative = p.negative_prompt if p.negative_prompt is not None else defaults.negative_prompt
        if not negative and scale > 1:  # a pipeline that guides only with a negative prompt
            negative = g.default_negative_prompt
        renders.append(
            Render(
                prompt=p.prompt,
                line=p.line,
                width=p.width or defaults.size[0],
                height=p.height or defaults.size[1],
                steps=p.steps or defaults.steps or (g.distilled_steps if distilled else None),
                seeds=(p.seed,) if p.seed is not None else tuple(defaults.seeds),
                guidance_scale=float(scale),
                negative_prompt=negative if family.guidance.negative_prompt else "",
                frames=p.frames or defaults.frames,
                scale_argument=g.scale_argument,
                references=p.references or defaults.references,
                reference_argument=family.references.argument,
                area_argument=family.references.area_argument,
                fps=defaults.fps,
                fps_argument=family.geometry.fps_argument,
            )
        )
    return renders
