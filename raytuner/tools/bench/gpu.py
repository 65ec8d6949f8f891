"""`raytuner bench gpu`: the project's GPU figures, measured on a machine with a CUDA GPU, each
model at full size with random weights (``model.pretrained = "random"``), made to return its
figures from a short GPU window.

A smoke check runs first (CUDA, a Triton kernel compiled, bitsandbytes' CUDA build; the versions
of torch, CUDA, cuDNN, the driver, diffusers, peft, transformers): a broken image fails in
seconds with the reason. Then the rows of ``gpu_rows.py``, group by group (``--only`` picks
groups or rows), each a `raytuner bench …` command in a process of its own (a clean GPU, its
own peak memory), each under a limit of its own and all under ``--budget-s``. The plan (every row
and its estimate) is printed before anything runs. After every row the JSON and the Markdown
rows of docs/figures.md are written again, so a window that ends mid-run keeps every row done.
A row that fails, prints no figures or runs past its limit is recorded with the reason and the
last 20 lines it wrote to stderr, and the next row runs. Without a GPU it refuses, saying so;
``--dry-run`` prints the plan and runs nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raytuner.tools.bench.gpu_rows import (
    FAMILIES,
    GROUP_LIMIT_S,
    IMAGES,
    PAIRS,
    Row,
    groups,
    rows,
    select,
)

STDERR_LINES = 20


def last_json(stdout: str) -> dict | None:
    """The last line of ``stdout`` that is a JSON object (a bench's figures), or None: lines Ray
    forwards late, progress and blank lines are passed over."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def run_row(argv: list[str], limit_s: float) -> dict:
    """One command in a process group of its own: its figures, or what went wrong (the exit
    code or the limit, and the last lines of its stderr). Never raises for the child's sake."""
    started = time.monotonic()
    # RAYTUNER_DEBUG: a failing raytuner command raises instead of printing one line, so the
    # tail holds the exception's whole message (a CheckpointError's tensors) and where it rose
    env = os.environ | {"RAYTUNER_DEBUG": "1"}
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, env=env)  # fmt: skip
    try:
        out, err = child.communicate(timeout=limit_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the row and whatever it started (Ray, compilers)
        out, err = child.communicate()
        timed_out = True
    seconds = round(time.monotonic() - started, 1)
    tail = err.strip().splitlines()[-STDERR_LINES:]
    figures = last_json(out)
    if timed_out:
        return {"error": f"did not finish in {limit_s:.0f} s", "seconds": seconds,
                "stderr": tail}  # fmt: skip
    if child.returncode != 0:
        why = f"exit {child.returncode}"
        if child.returncode < 0:
            why += f" (killed by {signal.Signals(-child.returncode).name})"
        return {"error": why, "seconds": seconds, "stderr": tail}
    if figures is None:
        return {"error": "printed no figures (no JSON line on stdout)", "seconds": seconds,
                "stderr": tail}  # fmt: skip
    return figures | {"seconds": seconds}


def row_line(item: dict, date: str) -> str:
    """A Markdown row of docs/figures.md: what, the command, the date, the figure."""
    r = item.get("result") or {}
    if "error" in r or "skipped" in r:
        why = r.get("error") or r.get("skipped")
        last = (r.get("stderr") or [""])[-1]
        figure = f"not measured: {why}" + (f" ({last[:200]})" if last else "")
    else:
        keys = ("samples_per_s", "mfu", "hfu", "model_tflops_per_sample", "tflops_per_s",
                "planned_over_measured", "measured_peak_bytes", "compiled_graphs",
                "recompiles_timed", "ratio", "images_per_s", "seconds")  # fmt: skip
        figure = ", ".join(f"{k} {r[k]}" for k in keys if r.get(k) is not None)
    command = " ".join(item["command"])
    return f"| {item['name']} | `{command}` | {date} | {figure} |"


def _write(report: dict, stem: Path) -> None:
    """The JSON and the Markdown rows, each written whole (a temporary file, then renamed)."""
    lines = [row_line(item, report["date"]) for item in report["items"]]
    for path, text in ((stem.with_suffix(".json"), json.dumps(report, indent=2)),
                       (stem.with_suffix(".md"), "\n".join(lines) + "\n")):  # fmt: skip
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def print_plan(items: list[Row], budget_s: float) -> None:
    total = sum(i.estimate_s for i in items)
    print(f"bench gpu: {len(items)} rows, about {total / 60:.1f} min on an H100 "
          f"(budget {budget_s / 60:.1f} min)", flush=True)  # fmt: skip
    for group, seconds in groups(items).items():
        print(f"  group {group}: about {seconds:.0f} s", flush=True)
        for i in (i for i in items if i.group == group):
            print(f"    {i.name}: about {i.estimate_s:.0f} s (limit {i.limit_s:.0f} s)",
                  flush=True)  # fmt: skip


def smoke() -> dict:
    """What the measurements need of the machine, checked in seconds: CUDA and a matrix product,
    a Triton kernel compiled by inductor, bitsandbytes' CUDA build, and the versions."""
    import torch

    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return out | {"error": "torch sees no CUDA GPU"}
    out["device"] = torch.cuda.get_device_name()
    out["cudnn"] = torch.backends.cudnn.version()
    out["driver"] = _driver()
    for package in ("diffusers", "peft", "transformers", "ray", "bitsandbytes", "triton"):
        out[package] = _version(package)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    out["matmul_ok"] = bool(torch.isfinite(a @ a).all())
    started = time.perf_counter()
    out["triton_check"] = _checked(lambda: _compiled_sin(a.float()))  # the compile rows need it
    out["compile_s"] = round(time.perf_counter() - started, 1)
    out["bitsandbytes_check"] = _checked(_adamw8bit)  # the 8-bit AdamW rows need it
    if not out["matmul_ok"]:
        out["error"] = "a bfloat16 matrix product on the GPU gave non-finite values"
    return out


def _checked(check) -> str:
    """ "ok", or the exception a check raised (the rows that need it will fail the same way)."""
    try:
        check()
    except Exception as e:  # recorded in the smoke row; the rows that need it are still run
        return f"failed: {type(e).__name__}: {e}"
    return "ok"


def _compiled_sin(x) -> None:
    import torch

    f = torch.compile(lambda t: torch.sin(t) * 2 + 1)
    if not torch.allclose(f(x), torch.sin(x) * 2 + 1):
        raise RuntimeError("the compiled function gave other values than eager")


def _adamw8bit() -> None:
    import bitsandbytes as bnb
    import torch

    p = torch.nn.Parameter(torch.randn(4096, device="cuda"))
    p.grad = torch.randn_like(p)
    bnb.optim.AdamW8bit([p]).step()
    if not torch.isfinite(p).all():
        raise RuntimeError("8-bit AdamW made non-finite weights")


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def bench_gpu(families: list[str], jobs: str, out: str, budget_s: float, dry_run: bool,
              only: list[str] | None = None, workdir: str = "") -> int:  # fmt: skip
    """Run (or, ``dry_run``, plan) the measurements; returns the exit code."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"raytuner bench gpu: unknown families {unknown}; known: {', '.join(FAMILIES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    workdir = os.path.abspath(workdir or os.path.join(tempfile.gettempdir(), "raytuner-bench-gpu"))
    try:
        items = select(rows(families, jobs, workdir), only or [])
    except ValueError as e:
        print(f"raytuner bench gpu: {e}", file=sys.stderr)
        return 2
    date = datetime.date.today().isoformat()
    report = {"date": date, "workdir": workdir, "group_limit_s": GROUP_LIMIT_S,
              "items": [{"name": i.name, "group": i.group, "command": i.command,
                         "estimate_s": i.estimate_s} for i in items]}  # fmt: skip
    if dry_run:
        print_plan(items, budget_s)
        print(json.dumps(report, indent=2))
        return 0
    import torch

    if not torch.cuda.is_available():  # NVML only: no CUDA context in this process
        print("raytuner bench gpu needs a CUDA GPU: torch sees none on this machine "
              f"(torch {torch.__version__}); `--dry-run` lists what it would run",
              file=sys.stderr)  # fmt: skip
        return 2
    print_plan(items, budget_s)
    os.makedirs(out, exist_ok=True)
    stem = Path(out, f"bench-gpu-{date}")
    deadline = time.monotonic() + budget_s
    python = [sys.executable, "-c", "import json; from raytuner.tools.bench.gpu import smoke; "
              "print(json.dumps(smoke()))"]  # fmt: skip
    report["smoke"] = run_row(python, 300)
    _write(report, stem)
    print(f"smoke: {json.dumps(report['smoke'])}", flush=True)
    if "error" in report["smoke"]:
        print(f"raytuner bench gpu: the smoke check failed: {report['smoke']['error']}",
              file=sys.stderr)  # fmt: skip
        return 1
    if any(i.group.startswith("train") for i in items):
        _synthetic_images(workdir)
    for item, row in zip(report["items"], items, strict=True):
        left = deadline - time.monotonic()
        if left < row.estimate_s:  # it would not finish: a later, shorter row still may
            item["result"] = {"skipped": f"{left:.0f} s of the budget left, about "
                              f"{row.estimate_s:.0f} s needed"}  # fmt: skip
        else:
            argv = [sys.executable, "-m", "raytuner", *row.command[1:]]
            item["result"] = run_row(argv, min(row.limit_s, left))
        _write(report, stem)
        print(row_line(item, date), flush=True)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def _synthetic_images(workdir: str) -> None:
    """The images `bench train` preprocesses: the demo's drawn images, about 1024 px, and the
    edit families' pairs (``gpu_rows.PAIRS``): those images as targets, with their captions,
    each one's mirror image its reference of the same name in ``control/``."""
    from raytuner.tools.demo_images import make_demo_images

    folder = Path(workdir, IMAGES)
    if not folder.exists():
        make_demo_images(folder, per_aspect=16, scale=11)
    pairs = Path(workdir, PAIRS)
    if pairs.exists():
        return
    from PIL import Image, ImageOps

    building = Path(tempfile.mkdtemp(prefix=f"{PAIRS}-", dir=workdir))
    for image in sorted(folder.rglob("*.png")):
        rel = image.relative_to(folder)
        for where in (building / rel, building / "control" / rel):
            where.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(image, building / rel)
        caption = image.with_suffix(".txt")
        shutil.copyfile(caption, (building / rel).with_suffix(".txt"))
        with Image.open(image) as target:
            ImageOps.mirror(target).save(building / "control" / rel)
    building.rename(pairs)  # whole or not at all: a run ended midway leaves a temporary folder
