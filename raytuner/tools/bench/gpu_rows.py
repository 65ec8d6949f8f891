"""What `raytuner bench gpu` measures: its rows, in named groups, each with an estimate of its
seconds on one H100 (80 GB, 16 CPU cores) so that a group fits a short GPU window.

A group is sized to finish in at most 8 minutes on an H100 (``GROUP_LIMIT_S``), so one command
of a 10-minute window returns it whole. The estimates come from the GPU figures (``BASE``):
a process start with torch and diffusers imported (``START_S``), the random full-size weights
drawn on the GPU, ``--warmup`` + ``--steps`` steps at the samples/s measured, and a compile of the
repeated blocks where asked. Rows at the micro-batches measured on 2026-11-23 (SD1.5 8, SDXL 4,
Sana 4, Flux 1 a forward) come first: what compile, channels-last, the attention kernel or
checkpointing change is read against them.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from raytuner.families import parts

FAMILIES = ("sd15", "sdxl", "flux", "sana", "z-image", "qwen-image", "flux2-klein", "flux2-dev",
            "flux-kontext", "qwen-image-edit")  # fmt: skip
# the edit families: `bench train` preprocesses edit pairs for them (``PAIRS``: the drawn
# images as targets, each one's mirror image its reference in ``control/``, as their jobs' layout)
PAIRED = ("flux-kontext", "qwen-image-edit")
PAIRS = "edits"  # their folder in the work folder (``IMAGES``: everyone else's)
IMAGES = "images"
GROUP_LIMIT_S = 480  # a group's estimate at most: 8 minutes
# the least a row's timed steps take: SD1.5's 8 steps at 8 a forward took 1.2 s on an H200 and
# two rounds of them gave 47.5 and 68.4 samples/s (2026-11-27)
MIN_TIMED_S = 8.0
START_S = 18.0  # a process: python, torch, diffusers, the job checked (measured 15-20 s)
# the micro-batch, samples/s eager, load s (a random model's draw) and compile s of its blocks:
# SD1.5, SDXL, Sana and Flux as measured on the H100 on 2026-11-23, the 2026 families as
# measured on an H200 on 2026-11-27 and -28 (the H100's tensor cores; the first figures of each)
BASE = {  # jobs/<name>.toml (a family's name, but for the video jobs): the four above
    "sd15": (8, 45.4, 4.0, 60.0),
    "sdxl": (4, 4.16, 6.0, 70.0),
    "sana": (4, 11.6, 6.0, 60.0),
    "flux": (1, 1.20, 15.0, 90.0),
    "z-image": (1, 1.487, 3.0, 60.0),  # one block class to compile, as Sana's
    "qwen-image": (1, 0.930, 5.0, 60.0),
    "flux2-klein": (1, 2.709, 4.0, 90.0),  # two block classes to compile, as Flux's
    "flux2-dev": (1, 0.45, 76.0, 90.0),  # its 64 GB of random weights drawn in 76 s
    "flux-kontext": (1, 0.559, 4.0, 90.0),
    "qwen-image-edit": (1, 0.501, 4.0, 60.0),
    # the video jobs at their frames (Wan 2.1 81, Wan 2.2 TI2V-5B 121); the 1.3B not measured
    # yet: Wan 14B's 356 hardware TFLOP/s on the H200 over plan's 1,205 TFLOP a sample, less
    # for a smaller model's kernels
    "wan-1.3b": (1, 0.25, 5.0, 60.0),
    "wan22-5b": (1, 0.168, 5.0, 60.0),
    "wan-14b": (1, 0.054, 4.0, 60.0),
    # never run on a GPU: plan's 615 TFLOP a sample at about Wan 14B's hardware rate (0.57 a
    # second) less a margin; its 37.8 GB of random weights drawn at FLUX.2 [dev]'s pace
    "ltx2": (1, 0.4, 45.0, 90.0),
}
# the video rows: a job each (not a family's name), its blocks all resident (`wan-14b.toml`
# streams 12 of 40 from host memory; 53 GiB a worker without, by plan), fewer steps (seconds each)
VIDEO = ("wan-1.3b", "wan22-5b", "wan-14b")
SHIPPED_MICRO = {"sd15": 32, "sdxl": 16, "sana": 16, "flux": 1, "z-image": 1,  # the jobs' own
                 "qwen-image": 1, "flux2-klein": 1, "flux2-dev": 2, "flux-kontext": 1,
                 "qwen-image-edit": 1}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measurement: a `raytuner` command line in a process of its own."""

    name: str
    group: str
    args: tuple[str, ...]  # after `raytuner`
    estimate_s: float

    @property
    def command(self) -> list[str]:
        return ["raytuner", *self.args, "--json"]

    @property
    def limit_s(self) -> float:
        """How long the row may run before it is ended and recorded as not finished."""
        return max(2.5 * self.estimate_s, self.estimate_s + 60.0)


def _sets(*pairs: str) -> tuple[str, ...]:
    return tuple(a for pair in pairs for a in ("--set", pair))


def _random(jobs: str, name: str) -> tuple[str, ...]:
    """The ``--set`` that gives jobs/<name>.toml's own architecture random weights: the preset
    holding its released repo (``random-1.3b`` for Wan 2.1 1.3B), else the family's ``random``
    (a plain ``random`` built the 14B for the 1.3B job on 2026-11-28)."""
    model = tomllib.loads(Path(jobs, f"{name}.toml").read_text())["model"]
    preset = parts.released(model["family"], model.get("pretrained", "")) or "random"
    return "--set", f'model.pretrained="{preset}"'


def _step(family: str, jobs: str, name: str, group: str, *sets: str, micro: int = 0,
          steps: int = 8, warmup: int = 3, plan: bool = False, extra_s: float = 0.0,
          rate: float = 0.0) -> Row:  # fmt: skip
    base_micro, base_rate, load_s, _ = BASE[family]
    micro = micro or base_micro
    rate = rate or base_rate
    steps = max(steps, round(MIN_TIMED_S * rate / micro))  # a fast step timed for long enough
    args = ("bench", "step", f"{jobs}/{family}.toml", *_random(jobs, family),
            *_sets(f"train.micro_batch_size={micro}", *sets),
            "--steps", str(steps), "--warmup", str(warmup))  # fmt: skip
    if not plan:
        args += ("--no-plan",)
    seconds = START_S + load_s + (steps + warmup) * micro / rate + extra_s
    seconds += 40.0 if plan else 0.0  # plan's trace of the same step, on the CPU
    return Row(name=name, group=group, args=args, estimate_s=round(seconds))


def rows(families: list[str], jobs: str, workdir: str) -> list[Row]:
    """Every row, group by group, in the order they run."""
    out: list[Row] = []
    for f in families:  # MFU of each family at the micro-batch of 2026-11-23, eager
        out.append(_step(f, jobs, f"step {f}", "mfu", "train.compile=false"))
    for job in VIDEO:  # the video jobs at their frames, eager
        out.append(_step(job, jobs, f"step {job}", "video", "train.compile=false",
                         "memory.blocks_to_swap=0", steps=3, warmup=2))  # fmt: skip
    group, spent, n = "compile", 0.0, 1  # the compiled rows, a next group past the limit
    for f in families:
        row = _step(f, jobs, f"step {f} compiled", group, "train.compile=true",
                    extra_s=BASE[f][3])  # fmt: skip
        if spent and spent + row.estimate_s > GROUP_LIMIT_S:
            n += 1
            group, spent = f"compile-{n}", 0.0
            row = dataclasses.replace(row, group=group)
        out.append(row)
        spent += row.estimate_s
    for job in VIDEO:  # the video jobs compiled (Wan's blocks compile on CUDA: never measured)
        out.append(_step(job, jobs, f"step {job} compiled", "video-compile", "train.compile=true",
                         "memory.blocks_to_swap=0", steps=3, warmup=3,
                         extra_s=BASE[job][3]))  # fmt: skip
    # LTX-2 at 121 frames (its job's), eager and compiled: never run on a GPU
    out.append(_step("ltx2", jobs, "step ltx2", "ltx2", "train.compile=false", steps=3, warmup=2))
    out.append(_step("ltx2", jobs, "step ltx2 compiled", "ltx2", "train.compile=true", steps=3,
                     warmup=3, extra_s=BASE["ltx2"][3]))  # fmt: skip
    out += _kernels(families, jobs)
    out += _memory(families, jobs)
    out += _swap(families, jobs)
    out += _train(families, jobs, workdir)
    return out


def _kernels(families: list[str], jobs: str) -> list[Row]:
    """channels-last off for the UNets, the attention kernels, checkpointing off, and the
    shipped jobs' own micro-batches."""
    out, eager = [], "train.compile=false"  # against the eager rows of the mfu group
    for f in (f for f in ("sdxl", "sd15") if f in families):
        out.append(_step(f, jobs, f"step {f} channels-last off", "kernels",
                         "train.channels_last=false", eager))  # fmt: skip
    if "flux" in families:
        for kernel in ("cudnn", "efficient"):
            out.append(_step("flux", jobs, f"step flux attention {kernel}", "kernels",
                             f'train.attention="{kernel}"', eager))  # fmt: skip
        out.append(_step("flux", jobs, "step flux float8 matmul", "kernels",
                         "train.float8_matmul=true", eager))  # fmt: skip
        out.append(_step("flux", jobs, "step flux checkpointing off", "kernels",
                         "train.gradient_checkpointing=false", eager, rate=1.7))  # fmt: skip
    if "sdxl" in families:
        out.append(_step("sdxl", jobs, "step sdxl checkpointing off", "kernels",
                         "train.gradient_checkpointing=false", eager, rate=8.45))  # fmt: skip
    for f in (f for f in ("sdxl", "sana", "sd15") if f in families):
        micro = SHIPPED_MICRO[f]
        out.append(_step(f, jobs, f"step {f} at {micro}", "shipped", eager, micro=micro,
                         steps=5, warmup=2))  # fmt: skip
    return out


def _memory(families: list[str], jobs: str) -> list[Row]:
    """plan against the measured peak where it has not been measured: a full fine-tune
    replicated and sharded (a process group of one), the text encoders' LoRA."""
    if "sdxl" not in families:
        return []
    full = ('train.mode="full"', "train.compile=false")
    return [
        _step(
            "sdxl",
            jobs,
            "step sdxl full ddp",
            "memory",
            *full,
            micro=2,
            steps=5,
            plan=True,
            rate=3.0,
        ),  # fmt: skip
        _step(
            "sdxl",
            jobs,
            "step sdxl full fsdp",
            "memory",
            *full,
            'scaling.strategy="fsdp"',
            micro=2,
            steps=5,
            plan=True,
            rate=2.5,
        ),  # fmt: skip
        _step(
            "sdxl",
            jobs,
            "step sdxl text-encoder lora",
            "memory",
            "lora.text_encoder=true",
            plan=True,
            rate=3.8,
        ),  # fmt: skip
    ]


def _swap(families: list[str], jobs: str) -> list[Row]:
    """The Flux block-swap table (0 blocks is ``step flux``): plan against the peak, and the
    step time beside the unswapped one. The weights are drawn on the GPU, then moved."""
    if "flux" not in families:
        return []
    out = []
    for blocks, dtype, optimizer in ((16, "bfloat16", ""), (16, "float8", ""),
                                     (28, "float8", "adamw8bit"), (8, "bfloat16", ""),
                                     (28, "bfloat16", ""), (28, "float8", "")):  # fmt: skip
        sets = [f"memory.blocks_to_swap={blocks}", f'model.dtype="{dtype}"']
        if optimizer:
            sets.append(f'train.optimizer="{optimizer}"')
        name = f"swap flux {blocks} {dtype}" + (f" {optimizer}" if optimizer else "")
        group = "swap" if len(out) < 3 else "swap-more"
        out.append(_step("flux", jobs, name, group, *sets, steps=4, warmup=2, plan=True,
                         extra_s=20.0, rate=0.9))  # fmt: skip
    return out


def _train(families: list[str], jobs: str, workdir: str) -> list[Row]:
    """raytuner's Ray Train worker (cache, feed) against the bare loop, one round, on drawn
    1024 px images; a failure is not retried (``checkpoint.max_failures = 0``)."""
    out = []
    for f in families:
        images = PAIRS if f in PAIRED else IMAGES
        folders = (f"data.images={workdir}/{images}", f"data.cache={workdir}/cache-{f}",
                   f"train.output={workdir}/runs-{f}", "scaling.workers=1",
                   "checkpoint.max_failures=0")  # fmt: skip
        micro, rate, load_s, _ = BASE[f]
        seconds = 40.0 + 90.0 + 2 * (START_S + load_s + 20 * micro / rate)
        groups = {"sd15": "train", "sdxl": "train", "flux": "train-2", "sana": "train-2"}
        # Qwen-Image's 20 B in a group of its own (8 minutes a group); [dev] replicated on one
        # 80 GB card (67.2 GiB by plan), after its 24 B encoder's pool; the edit families each
        # in one of their own: their pairs' reference tokens double a step's
        groups |= {"qwen-image": "train-4", "flux2-dev": "train-5", "flux-kontext": "train-6",
                   "qwen-image-edit": "train-7"}  # fmt: skip
        group = groups.get(f, "train-3")
        out.append(Row(name=f"train {f}", group=group,
                       args=("bench", "train", f"{jobs}/{f}.toml", *_random(jobs, f),
                             *_sets(*folders, f"train.micro_batch_size={micro}",
                                    f"train.global_batch_size={micro}"),
                             "--steps", "20", "--rounds", "1"),
                       estimate_s=round(seconds)))  # fmt: skip
    if "sdxl" in families:
        out.append(Row(name="preprocess sdxl", group="preprocess",
                       args=("bench", "preprocess", f"{jobs}/sdxl.toml", *_random(jobs, "sdxl"),
                             "--images", "256", "--rounds", "1"), estimate_s=150))  # fmt: skip
    return out


def groups(items: list[Row]) -> dict[str, float]:
    """Each group's estimated seconds, in the order the groups run."""
    out: dict[str, float] = {}
    for item in items:
        out[item.group] = out.get(item.group, 0.0) + item.estimate_s
    return out


def select(items: list[Row], only: list[str]) -> list[Row]:
    """The rows ``only`` names, by group or by row name (all of them when empty); a name that is
    neither raises ValueError listing the groups."""
    if not only:
        return items
    known = {i.group for i in items} | {i.name for i in items}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ValueError(
            f"--only {','.join(unknown)}: not a group or a row; groups: " + ", ".join(groups(items))
        )
    return [i for i in items if i.group in only or i.name in only]
