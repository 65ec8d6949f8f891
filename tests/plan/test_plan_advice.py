"""What `raytuner plan` says: a line for each trace on stderr (never silent for long; `--json`'s
stdout stays one JSON object), and suggestions only of what applies and is new, a margin of the
card kept free, the validation actor checked when the job validates, and a closing sentence.

The tiny SDXL-shaped job (a 1 GiB CUDA overhead and a step of about 1 GiB at 256 px and 256
samples a forward) planned on cards around its peak; four plans in-process share the
assertions."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from raytuner.config import load_job
from raytuner.families import FAMILIES
from raytuner.tools.plan.measure import measure
from raytuner.tools.plan.progress import Progress
from raytuner.tools.plan.report import print_plan
from raytuner.tools.plan.suggest import MOST_LORA_WORKERS
from raytuner.tools.plan.trace import MARGIN, trace_step

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs" / "tiny.toml"
# 256 px, checkpointing on, 256 samples a forward (512 over the 2 workers): a step of about 1 GiB
BIG = ["preprocess.resolution=256", "train.global_batch_size=512"]
BIG += ["train.gradient_checkpointing=true"]
SDXL = FAMILIES["sdxl"]


@pytest.fixture(scope="module")
def plans():
    """The job's worker peak P on a large card (no validation); the job planned on a card of
    exactly P; on the smallest card one sample a forward fits with the margin (validation on
    half a GPU, beside a training worker); on a card smaller than the CUDA overhead."""
    quiet = load_job(TINY, [*BIG, "validation.every_steps=0"])
    large = measure(quiet, SDXL, 80 * 2**30, compare=False)
    shapes, size = large["cache_shapes"], tuple(large["bucket"])
    one = trace_step(quiet, SDXL, shapes, size, 1, True)["peak_bytes"]
    card = int(one / (1 - MARGIN)) + 2
    assert card < large["peak_bytes"]  # the job does not fit it, with or without a margin
    sharing = load_job(TINY, [*BIG, "validation.gpus=0.5"])
    return {
        "large": large,
        "at_peak": measure(quiet, SDXL, large["peak_bytes"], compare=False),
        "one_fits": measure(sharing, SDXL, card, compare=False),
        "nothing_fits": measure(quiet, SDXL, 1000 * 2**20, compare=False),
    }


def test_a_worker_at_the_cards_size_does_not_fit_a_margin_is_kept(plans):
    """It "fit" at 24.0 of 24 GiB: now 5 % of the card is kept free (fragmentation, what the
    driver keeps) and the verdict says so."""
    large, at_peak = plans["large"], plans["at_peak"]
    assert large["fits"] and at_peak["peak_bytes"] == large["peak_bytes"]
    assert not at_peak["fits"]
    assert at_peak["usable_bytes"] == int(at_peak["gpu_memory_bytes"] * (1 - MARGIN))


def test_suggestions_change_only_what_the_job_has_not_and_a_lora_is_not_sharded_widely(plans):
    """The job already checkpoints: one sample a forward is offered without repeating
    ``train.gradient_checkpointing = true``; a LoRA is sharded over one node at most (it was
    offered fsdp at 64 workers)."""
    job = load_job(TINY, BIG)
    for name in ("one_fits", "nothing_fits"):
        suggestions = plans[name]["suggestions"]
        assert "train.micro_batch_size = 1" in [s["set"] for s in suggestions]
        for s in suggestions:
            for key, value in re.findall(r"(\w+\.\w+) = (\S+)", s["set"]):
                section, setting = key.split(".")
                has = getattr(getattr(job, section), setting)
                written = str(has).lower() if isinstance(has, bool) else str(has)
                assert value.strip('",') != written, f"{s['set']}: the job has {key} already"
        (fsdp,) = [s for s in suggestions if "fsdp" in s["set"]]
        workers = int(re.search(r"scaling.workers = (\d+)", fsdp["set"]).group(1))
        assert workers <= MOST_LORA_WORKERS


def test_plan_ends_with_what_to_do_when_nothing_fits_and_when_something_does(plans, capsys):
    nothing_fits, one_fits = plans["nothing_fits"], plans["one_fits"]
    assert not any(s["fits"] for s in nothing_fits["suggestions"])
    nearest = min(s["peak_bytes"] for s in nothing_fits["suggestions"])
    need = f"{nearest / (1 - MARGIN) / 2**30:.1f} GiB"
    assert nothing_fits["closing"].startswith("nothing plan tries fits")
    assert f"the job needs a GPU of at least {need}" in nothing_fits["closing"]
    assert not one_fits["fits"]
    assert one_fits["closing"].startswith(f"to fit {one_fits['gpu_memory_bytes'] / 2**30:.1f}")
    assert "set train.micro_batch_size = 1 (" in one_fits["closing"]
    print_plan(one_fits)
    assert capsys.readouterr().out.rstrip().endswith(one_fits["closing"])


def test_the_validation_actor_is_checked_when_the_job_validates_and_left_out_when_not(
    plans, capsys
):
    """tiny.toml validates every 4 steps: its actor on half a training GPU needs the worker's
    bytes and its own, more than the card; without validation there is no actor to print."""
    actor = plans["one_fits"]["validation_actor"]
    worker = plans["one_fits"]["peak_bytes"]
    assert actor["shares_training_gpu"] and actor["needs_bytes"] == actor["peak_bytes"] + worker
    assert not actor["fits"]
    assert "the validation actor needs" in plans["one_fits"]["closing"]
    print_plan(plans["one_fits"])
    assert "validation actor: weights" in capsys.readouterr().out
    assert plans["at_peak"]["validation_actor"] is None
    print_plan(plans["at_peak"])
    assert "validation actor" not in capsys.readouterr().out


@pytest.mark.slow
def test_plan_says_what_it_traces_on_stderr_and_json_stays_one_object():
    """It was silent for minutes (SDXL 307 s): now a line as each trace starts, and a line at
    least every 10 s while one runs (here checked with a few seconds' slack for a loaded
    host)."""
    args = ["plan", str(TINY), "--json", "--gpu-memory", "1090MiB"]
    args += ["--set", "train.global_batch_size=64"]
    result = subprocess.run(
        [sys.executable, "-m", "raytuner", *args],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if " raytuner.plan: " in x]
    text = "\n".join(lines)
    assert "tracing the encoder actor: 8 images at 64x64" in text
    assert "tracing the training worker at 64x64, 32 a forward, no checkpointing" in text
    assert "tracing the validation actor" in text and "planned in" in lines[-1]
    times = [datetime.strptime(x[:23], "%Y-%m-%d %H:%M:%S,%f") for x in lines]
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 15, text
    (line,) = result.stdout.strip().splitlines()
    assert json.loads(line)["suggestions"]  # 1090MiB: too small for 32 a forward


def test_a_long_trace_says_it_is_still_running(caplog):
    with caplog.at_level(logging.INFO, logger="raytuner.plan"), Progress(every_s=0.5) as progress:
        progress.tracing("a slow thing")
        time.sleep(2.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("tracing a slow thing (0.0 s in)")
    assert any(x.startswith("still tracing a slow thing (") for x in lines[1:-1])
    assert lines[-1].startswith("planned in") and "(1 trace, 0 reused)" in lines[-1]


class _Forgetful(dict):
    """A memo that remembers nothing: every op runs its kernel."""

    def __setitem__(self, key, value) -> None:
        pass


@pytest.mark.parametrize("checkpointing", [False, True])
def test_ops_answered_from_memory_count_what_their_kernels_would(monkeypatch, checkpointing):
    """``MetaMemo`` answers a repeated op without its meta kernel: the tiny Flux (repeated
    blocks, LoRA, float8 storage, the step and AdamW) makes and frees the same bytes after
    every op, and counts the same FLOPs, as with every kernel run, also from a memo already
    full."""
    from raytuner.tools.plan import meta as trace
    from raytuner.tools.plan.trace import largest_bucket, micro_batch, trace_encoders

    timelines = []

    class Timeline(trace.LiveBytes):  # the bytes held after each op
        def __init__(self) -> None:
            super().__init__()
            self.now_after: list = []
            timelines.append(self.now_after)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.now_after.append((str(func), self.now))
            return out

    monkeypatch.setattr(trace, "LiveBytes", Timeline)
    job = load_job(TINY, ['model.family="flux"', 'model.dtype="float8"'])
    flux = FAMILIES["flux"]
    size = largest_bucket(job, flux)
    shapes = trace_encoders(job, flux, size)[1]  # the tiny encoders' outputs
    runs = []
    for seen in (trace._SEEN, trace._SEEN, _Forgetful()):  # the second: from a full memo
        monkeypatch.setattr(trace, "_SEEN", seen)
        timelines.clear()
        result = trace_step(job, flux, shapes, size, micro_batch(job), checkpointing)
        runs.append((result, [list(t) for t in timelines]))
    assert runs[0] == runs[1] == runs[2]
    assert sum(len(t) for t in runs[0][1]) > 1000  # every op of the step seen


def test_a_clip_no_block_swap_fits_is_offered_its_activations_offloaded():
    """A long clip's step is mostly the block inputs gradient checkpointing saves (Wan 14B at
    81 frames, 720p: 52.4 GiB of them): on a card where swapping every block but the ring's
    still does not fit, plan offers memory.activation_offload with the fewest blocks swapped
    that fit (the tiny Wan, 81 frames)."""
    from raytuner.tools.plan.trace import swapped_peak

    wan, keys = FAMILIES["wan"], ['model.family="wan"', "preprocess.resolution=128"]
    keys += ["data.frames=[81]", "validation.every_steps=0", "train.micro_batch_size=1"]
    keys += ["train.gradient_checkpointing=true"]
    job = load_job(TINY, keys)
    large = measure(job, wan, 80 * 2**30, compare=False)
    shapes, size = large["cache_shapes"], tuple(large["bucket"])
    assert shapes["latent"][1] == 21  # 81 frames: 21 latent frames

    def fewest(worker) -> int:  # the lowest peak block swap reaches
        ring, blocks = job.memory.swap_ring, len(worker["block_bytes"])
        return min(swapped_peak(worker, n, ring) for n in range(blocks))

    plain = fewest(trace_step(job, wan, shapes, size, 1, True))
    offload = load_job(TINY, [*keys, "memory.activation_offload=true"])
    offloaded = fewest(trace_step(offload, wan, shapes, size, 1, True))
    assert offloaded < plain
    card = int(offloaded / (1 - MARGIN)) + 2
    plan = measure(job, wan, card, compare=False)
    assert not plan["fits"]
    fitting = [s["set"] for s in plan["suggestions"] if s.get("fits")]
    assert any("memory.activation_offload" in str(s) for s in fitting), plan["suggestions"]
