"""The `raytuner` command's arguments: the parser of every command and its options
(``cli.py`` runs them)."""

from __future__ import annotations

import argparse

DESCRIPTION = "The `raytuner` command. Exit codes: 0 ok, 2 bad config or usage, 1 runtime failure."

def _job_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("job", help="job TOML file")
    cmd.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a key (section.key or section.sub.key); the value is read as TOML "
        "(bare words are strings)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _sample_args(cmd: argparse.ArgumentParser) -> None:
    _job_args(cmd)
    cmd.add_argument(
        "--checkpoint",
        default="latest",
        help="latest (the run's newest checkpoint), base (no trained weights), or a path: a "
        "checkpoint folder, a run's lora/ or model/ folder, a LoRA .safetensors file",
    )
    cmd.add_argument("--prompt", action="append", default=[], help="repeat for several")
    cmd.add_argument(
        "--prompts-file",
        help="a text file of prompts, one a line, with kohya's per-line options "
        "(--w --h --s --d --l --g --n, --ci a reference image); rendered after the --prompt ones",
    )
    cmd.add_argument(
        "--reference",
        action="append",
        default=[],
        help="a reference image of every prompt whose line names none (--ci), for an edit "
        "model (flux-kontext); repeat for several",
    )
    cmd.add_argument("--seed", type=int, action="append", help="repeat for several (default 0)")
    cmd.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's)")
    cmd.add_argument("--width", type=int, help="pixels (default: the job's resolution)")
    cmd.add_argument("--height", type=int, help="pixels (default: the job's resolution)")
    cmd.add_argument(
        "--frames", type=int, help="a video family's clip length (default: validation.frames, "
        "else the largest data.frames bucket; Wan: 4n + 1)",
    )  # fmt: skip
    cmd.add_argument("--fps", type=float, help="a clip's frame rate (default: validation.fps)")
    cmd.add_argument(
        "--out", required=True, help="folder for the PNGs (a clip: its mp4 and poster), "
        "grid.png, samples.json",
    )  # fmt: skip
    cmd.add_argument(
        "--no-merge",
        action="store_true",
        help="render without model.merge_adapters (default: merged into the base, as trained)",
    )


def _feed_args(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--rows", type=int, default=2000, help="synthetic rows (distinct captions)")
    cmd.add_argument("--workers", type=int, default=2, help="Ray Train workers")
    cmd.add_argument("--steps", type=int, default=200, help="measured steps")
    cmd.add_argument(
        "--workdir",
        help="keep the synthetic caches here and reuse them next time (default: a temporary "
        "folder, removed)",
    )


VERSIONED = ("raytuner", "torch", "ray", "diffusers", "transformers", "peft")


def versions() -> str:
    """``raytuner --version``: the installed versions of raytuner and of what it runs on (read
    from the packages' metadata: nothing is imported)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    first, *rest = VERSIONED
    return f"{first} {version(first)} (" + ", ".join(f"{n} {version(n)}" for n in rest) + ")"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        text = "print the versions of raytuner, torch, ray, diffusers, transformers, peft"
        super().__init__(option_strings, dest, nargs=0, help=text)

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions())
        parser.exit()


def _cache_parsers(sub) -> None:
    group = sub.add_parser("cache", help="cache commands").add_subparsers(
        dest="action", required=True
    )
    verify = group.add_parser("verify", help="check every cache file against the manifest")
    _job_args(verify)
    verify.add_argument("--repair", action="store_true", help="re-encode bad rows")
    gc = group.add_parser("gc", help="delete other cache versions and unreferenced part files")
    _job_args(gc)
    gc.add_argument(
        "--min-age-s",
        type=float,
        default=3600.0,
        help="leave versions and part folders younger than this alone",
    )
    gc.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted, delete nothing"
    )


def _bench_parsers(sub) -> None:
    group = sub.add_parser("bench", help="bench commands").add_subparsers(
        dest="action", required=True
    )
    helps = {
        "preprocess": "images/s of the pipeline against a bare loop",
        "train": "samples/s of one training worker against a bare loop",
        "feed": "rows/s, read amplification and memory of the training feed at full size, on "
        "a synthetic cache",
        "step": "samples/s and peak memory of the bare training step on this machine's GPU "
        "(or CPU), against raytuner plan",
    }
    cmd = {action: group.add_parser(action, help=text) for action, text in helps.items()}
    for parser in cmd.values():
        _job_args(parser)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
    _gpu_args(group.add_parser("gpu", help="every GPU figure in one go (needs a CUDA GPU)"))
    cmd["preprocess"].add_argument("--images", type=int, default=192, help="synthetic image count")
    cmd["preprocess"].add_argument(
        "--clips", type=int, default=0, help="video mode: synthetic clip count (a video family)"
    )
    cmd["preprocess"].add_argument(
        "--frames", type=int, default=17, help="video mode: frames of each clip's sample"
    )
    cmd["train"].add_argument("--steps", type=int, default=100, help="measured steps")
    cmd["step"].add_argument("--steps", type=int, default=10, help="measured steps")
    cmd["step"].add_argument(
        "--warmup", type=_positive_int, default=3, help="steps run before timing (default 3)"
    )
    cmd["step"].add_argument(
        "--no-plan", action="store_true", help="skip plan's trace of the same step (speed only)"
    )
    _feed_args(cmd["feed"])
    for action in ("preprocess", "train"):
        cmd[action].add_argument(
            "--rounds",
            type=_positive_int,
            default=3,
            help="rounds, each side once a round, alternated (default 3): the figures are the "
            "medians",
        )


def _gpu_args(gpu: argparse.ArgumentParser) -> None:
    families = "sd15,sdxl,flux,sana,z-image,qwen-image,flux2-klein,flux2-dev,flux-kontext,"
    families += "qwen-image-edit"
    gpu.add_argument("--families", default=families, help="comma-separated")
    gpu.add_argument(
        "--only",
        default="",
        help="comma-separated groups (mfu, compile, compile-2, kernels, shipped, memory, swap, "
        "swap-more, train, train-2 ... train-7, preprocess; `--dry-run` lists them) or row "
        "names; default: every row",
    )
    gpu.add_argument("--jobs", default="jobs", help="the folder of the shipped job files")
    gpu.add_argument("--out", default=".", help="where the JSON and the Markdown rows go")
    gpu.add_argument(
        "--workdir", default="", help="images, caches and runs (default: under the temp dir)"
    )
    gpu.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="seconds for all rows (default 480: one group inside a 10-minute command)",
    )
    gpu.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raytuner", description=DESCRIPTION)
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="make a small image set, preprocess and train on it")
    demo.add_argument("--workdir", default="raytuner-demo", help="where the demo writes")
    for name, text in [
        ("check", "validate a job file and print the resolved config"),
        ("preprocess", "encode the images into the cache"),
        ("train", "train on the committed cache"),
        ("run", "preprocess, then train"),
    ]:
        cmd = sub.add_parser(name, help=text)
        _job_args(cmd)
        if name in ("preprocess", "run"):
            cmd.add_argument("--report", help="also write the preprocess report (JSON) here")
    _sample_args(sub.add_parser("sample", help="render prompts with the trained weights"))
    plan = sub.add_parser(
        "plan", help="the GPU memory of a training worker, encoder and validation actor"
    )
    _job_args(plan)
    plan.add_argument(
        "--gpu-memory",
        default="",
        help="the GPU to fit (default: the job's scaling.worker_memory, else 80GiB)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    _cache_parsers(sub)
    _bench_parsers(sub)
    return p
