"""`raytuner demo`: a job on a drawn image set, end to end on a local Ray, in a few minutes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from raytuner import api
from raytuner.config import load_job
from raytuner.preprocess.worklist import report_lines
from raytuner.tools.demo_images import make_demo_images

DEMO_JOB = """\
# Written by `raytuner demo`: a tiny random-weight SDXL-shaped model on drawn shapes.
[model]
family = "sdxl"
pretrained = "tiny"

[data]
images = "{workdir}/images"
cache = "{workdir}/cache"

[preprocess]
resolution = 64
bucket_step = 16

[train]
output = "{workdir}/runs"
max_steps = 30
global_batch_size = 4
learning_rate = 1e-2
log_every = 10

[scaling]
workers = 2

[checkpoint]
every_steps = 10
"""


def run_demo(workdir: str) -> dict:
    start = time.monotonic()
    root = Path(workdir).resolve()
    make_demo_images(root / "images")
    job_file = root / "demo.toml"
    job_file.write_text(DEMO_JOB.format(workdir=root.as_posix()))
    job = load_job(job_file)

    def reported(report: dict) -> None:
        print("\n".join(report_lines(report)))
        (root / "preprocess-report.json").write_text(json.dumps(report, indent=2))

    summary = api.run(job, on_report=reported)
    report = summary.pop("report")
    print("\n== raytuner demo ==")
    print(f"images encoded : {report['encoded']} of {report['total']}")
    print(f"buckets        : {', '.join(f'{b} ({n})' for b, n in report['buckets'].items())}")
    print(f"steps          : {summary['step']} on {job.scaling.workers} workers")
    print(f"loss           : {summary['first_loss']:.4f} -> {summary['loss']:.4f}")
    print(f"LoRA           : {summary['lora']}")
    print(f"job file       : {job_file}")
    print(f"took           : {time.monotonic() - start:.0f} s")
    return {"report": report, **summary}
