"""`raytuner bench gpu`: every GPU figure the project records, measured in one go on a machine with
a CUDA GPU, each model at full size with random weights (``model.pretrained = "random"``).

Each measurement is one `raytuner bench …` command run as a process of its own (a clean GPU, its
own peak memory; a failure, an out-of-memory included, is recorded and the next one runs), in
this order, until ``--budget-s`` is spent (what is left is recorded as skipped):

1. per family: ``bench step`` of the shipped job (plan against the measured peak; samples/s,
   TFLOP a sample, TFLOP/s, MFU), then the same with ``train.compile = true``; for SDXL also a
   full fine-tune replicated (``ddp``) and sharded (``fsdp``, a process group of one), and the
   shipped job with ``lora.text_encoder = true``;
2. the block-swap table: Flux with 0, 8, 16 and 28 blocks streamed, in bfloat16 and float8, and
   float8 with 8-bit AdamW;
3. per family: ``bench train`` (raytuner's Ray Train worker against the bare loop) on synthetic
   images, one round;
4. ``bench preprocess`` of the SDXL job (the VAE encoder pool against a bare loop, 512 images).

It writes one JSON (every command, its figures or its error) and the Markdown rows of
docs/figures.md beside it. Without a GPU it refuses, saying so; ``--dry-run`` lists the commands.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

FAMILIES = ("sd15", "sdxl", "flux", "sana")
RANDOM = ["--set", 'model.pretrained="random"']
SWAP = [(n, dtype) for dtype in ("bfloat16", "float8") for n in (0, 8, 16, 28)]


def measurements(families: list[str], jobs: str, workdir: str) -> list[dict]:
    """What ``bench gpu`` runs, in order: a name and the `raytuner` command line of each."""
    out = []

    def add(name: str, *args: str) -> None:
        out.append({"name": name, "command": ["raytuner", *args, "--json"]})

    for f in families:
        job = f"{jobs}/{f}.toml"
        add(f"step {f}", "bench", "step", job, *RANDOM, "--steps", "10")
        add(f"step {f} compiled", "bench", "step", job, *RANDOM, "--steps", "10", "--set",
            "train.compile=true")  # fmt: skip
    if "sdxl" in families:  # sharding against replication at world 1, the text encoders' LoRA
        full = [*RANDOM, "--steps", "5", "--set", 'train.mode="full"', "--set",
                "train.micro_batch_size=2"]  # fmt: skip
        add("step sdxl full ddp", "bench", "step", f"{jobs}/sdxl.toml", *full)
        add("step sdxl full fsdp", "bench", "step", f"{jobs}/sdxl.toml", *full, "--set",
            'scaling.strategy="fsdp"')  # fmt: skip
        add("step sdxl text-encoder lora", "bench", "step", f"{jobs}/sdxl.toml", *RANDOM,
            "--steps", "10", "--set", "lora.text_encoder=true")  # fmt: skip
    if "flux" in families:
        for n, dtype in SWAP + [(16, "float8 adamw8bit"), (28, "float8 adamw8bit")]:
            sets = [
                "--set",
                f"memory.blocks_to_swap={n}",
                "--set",
                "train.gradient_checkpointing=true",
            ]
            sets += ["--set", f'model.dtype="{dtype.split()[0]}"']
            if "adamw8bit" in dtype:
                sets += ["--set", 'train.optimizer="adamw8bit"']
            add(f"swap flux {n} {dtype}", "bench", "step", f"{jobs}/flux.toml", *RANDOM, *sets,
                "--steps", "5")  # fmt: skip
    for f in families:
        folders = [f"data.images={workdir}/images", f"data.cache={workdir}/cache-{f}",
                   f"train.output={workdir}/runs-{f}", "scaling.workers=1"]  # fmt: skip
        sets = [a for s in folders for a in ("--set", s)]
        add(f"train {f}", "bench", "train", f"{jobs}/{f}.toml", *RANDOM, *sets, "--steps", "20",
            "--rounds", "1")  # fmt: skip
    add("preprocess sdxl", "bench", "preprocess", f"{jobs}/sdxl.toml", *RANDOM, "--images", "512",
        "--rounds", "1")  # fmt: skip
    return out


def _run(command: list[str], timeout: float) -> dict:
    """One command in its own process: its last JSON line, or what went wrong."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "raytuner", *command[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    seconds = round(time.monotonic() - started, 1)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:], "seconds": seconds}
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"seconds": seconds}


def row(item: dict, date: str) -> str:
    """A Markdown row of docs/figures.md: what, the command, the date, the figure."""
    r = item.get("result") or {}
    if "error" in r or "skipped" in r:
        figure = f"not measured: {r.get('error') or r.get('skipped')}"
    else:
        keys = ("samples_per_s", "tflops_per_sample", "tflops_per_s", "mfu")
        keys += ("planned_over_measured", "measured_peak_bytes", "ratio", "images_per_s")
        figure = ", ".join(f"{k} {r[k]}" for k in keys if r.get(k) is not None)
    return f"| {item['name']} | `{' '.join(item['command'])}` | {date} | {figure} |"


def bench_gpu(families: list[str], jobs: str, out: str, budget_s: float, dry_run: bool) -> int:
    """Run (or, ``dry_run``, list) the measurements; returns the exit code."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"raytuner bench gpu: unknown families {unknown}; known: {', '.join(FAMILIES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    workdir = os.path.abspath(os.path.join(out, "bench-gpu-work"))
    items = measurements(families, jobs, workdir)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {"device": device, "date": datetime.date.today().isoformat(), "items": items}
    if dry_run:
        print(json.dumps(report, indent=2))
        return 0
    if device is None:
        print("raytuner bench gpu needs a CUDA GPU: torch sees none on this machine "
              f"(torch {torch.__version__}); `--dry-run` lists what it would run",
              file=sys.stderr)  # fmt: skip
        return 2
    _synthetic_images(workdir)
    deadline = time.monotonic() + budget_s
    for item in items:
        left = deadline - time.monotonic()
        item["result"] = _run(item["command"], left) if left > 30 else {"skipped": "budget"}
        print(row(item, report["date"]), flush=True)
    os.makedirs(out, exist_ok=True)
    stem = Path(out, f"bench-gpu-{report['date']}")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    rows = [row(item, report["date"]) for item in items]
    stem.with_suffix(".md").write_text("\n".join(rows) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def _synthetic_images(workdir: str) -> None:
    """The images `bench train` preprocesses: the demo's drawn images, about 1024 px."""
    from raytuner.tools.demo_images import make_demo_images

    folder = Path(workdir, "images")
    if not folder.exists():
        make_demo_images(folder, per_aspect=16, scale=11)
