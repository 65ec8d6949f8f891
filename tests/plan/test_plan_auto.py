"""``scaling.strategy = "auto"`` (the default): ddp while one replica fits the memory a worker
has, fsdp over the fewest workers that fit otherwise, decided before any worker loads weights
and said with its reason; `raytuner plan` shows the choice, `raytuner check` refuses a job
whose workers fit with no strategy, and a strategy the job names is kept
(``tools/plan/auto.py``, ``adopt.before_workers``). Traced on the tiny SDXL job, with memories
chosen between the peaks plan traces (its 1 GiB of CUDA overhead makes them all about 1 GiB:
they differ by MiB)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from raytuner.cli import main
from raytuner.config import ConfigError, load_job
from raytuner.families import FAMILIES
from raytuner.tools.plan import adopt, auto
from raytuner.tools.plan.report import print_plan
from raytuner.tools.plan.trace import MARGIN

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs" / "tiny.toml"
SDXL = FAMILIES["sdxl"]
MiB = 2**20


def _job(*settings: str):
    # 16 samples a step: up to 8 workers (a LoRA's most), 2 named by the job file
    return load_job(TINY, ["train.global_batch_size=16", *settings])


def _unnamed_workers(job):
    """``job`` as if its file left ``scaling.workers`` out (raytuner's to choose)."""
    return dataclasses.replace(job, given=job.given - {"scaling.workers"})


def _memory(peak: int) -> int:
    """A worker memory whose usable part (plan's margin kept free) holds ``peak`` and no more."""
    return int(peak / (1 - MARGIN)) + 4096


@pytest.fixture(scope="module")
def peaks() -> dict:
    """A CPU run's peaks (no step settings left free): a replica's, and a sharded worker's at
    1 to 8 workers."""
    job = _job()
    traces = adopt.traces_of(job, SDXL)
    out = {"replica": auto.replica_peak(job, traces)}
    return out | {n: auto.sharded_peak(job, traces, n) for n in range(1, 9)}


def _decide(job, memory: int):
    return adopt.decided(job, SDXL, auto.Memory(memory, "a test GPU"))


def test_auto_picks_ddp_where_a_replica_fits(peaks):
    choice = _decide(_job(), 80 * 2**30)
    assert choice.job.scaling.strategy == "ddp" and choice.job.scaling.workers == 2
    assert choice.line.startswith("strategy auto → ddp: a replica needs 1.0 GiB, within the ")
    assert "a test GPU's 80.0 GiB" in choice.line and not choice.refusal


def test_auto_shards_over_the_fewest_workers_that_fit_when_a_replica_does_not(peaks):
    # a memory a replica does not fit, nor 1 to 3 sharded workers: 4 do
    assert peaks["replica"] > peaks[3] > peaks[4]
    job = _unnamed_workers(_job())
    choice = _decide(job, _memory(peaks[4]))
    assert (choice.job.scaling.strategy, choice.job.scaling.workers) == ("fsdp", 4)
    assert choice.line.startswith("strategy auto → fsdp: a replica needs 1.0 GiB, more than")
    assert "sharded over 4 workers" in choice.line
    assert "the fewest that fit: scaling.workers = 4" in choice.line
    # everything but the strategy and the workers as the job says
    assert dataclasses.replace(choice.job.scaling, strategy="auto", workers=2) == job.scaling
    assert choice.job.train == job.train and choice.job.given == job.given


def test_workers_the_job_names_are_kept_and_must_fit(peaks):
    fits = _decide(_job(), _memory(peaks[2]))
    assert (fits.job.scaling.strategy, fits.job.scaling.workers) == ("fsdp", 2)
    assert "sharded over 2 workers" in fits.line and "the fewest" not in fits.line
    refused = _decide(_job(), _memory(peaks[4]))  # 2 named, 4 needed
    assert refused.refusal.startswith("scaling.workers = 2: a replica needs")
    assert "set scaling.workers = 4 or more" in refused.refusal


def test_a_job_nothing_fits_is_refused_naming_what_to_change(peaks):
    choice = _decide(_unnamed_workers(_job()), _memory(peaks[8]) - MiB)
    assert choice.refusal.startswith('scaling.strategy = "auto": a replica needs')
    assert "sharded over 8 workers" in choice.refusal and "`raytuner plan`" in choice.refusal
    blocked = _decide(_job("lora.text_encoder=true"), _memory(peaks[2]))
    assert "cannot take lora.text_encoder = true" in blocked.refusal
    # each worker skips other modules: never sharded (config/rules refuses it with fsdp)
    dropped = _decide(_job('lora.kind="loha"', "lora.module_dropout=0.1"), _memory(peaks[2]))
    assert "cannot take lora.module_dropout = 0.1" in dropped.refusal


def test_a_strategy_the_job_names_is_kept(peaks):
    for name in ("ddp", "fsdp"):
        job = _job(f'scaling.strategy="{name}"')
        assert _decide(job, _memory(peaks["replica"])) == auto.Choice(job, "")
    small = _memory(peaks[4])
    ddp = _decide(_job('scaling.strategy="ddp"'), small).refusal
    assert ddp.startswith('scaling.strategy = "ddp": a replica needs') and '"auto"' in ddp
    fsdp = _decide(_job('scaling.strategy="fsdp"'), small).refusal
    assert "scaling.workers = 2 with" in fsdp and "set scaling.workers = 4 or more" in fsdp


def test_a_run_decides_before_its_workers_and_says_why(peaks, caplog):
    """``api.train`` hands ``before_workers``'s job to the trainer: on CPU workers auto is a
    replica; with scaling.worker_memory it is decided on that memory."""
    caplog.set_level(logging.INFO, logger="raytuner")
    pinned = adopt.before_workers(_job('scaling.strategy="fsdp"'), SDXL)
    assert pinned.scaling.strategy == "fsdp" and "strategy auto" not in caplog.text
    cpu = adopt.before_workers(_job(), SDXL)
    assert cpu.scaling.strategy == "ddp"
    assert "strategy auto → ddp: CPU workers (scaling.use_gpu = false)" in caplog.text
    memory = f"scaling.worker_memory=\"{_memory(peaks[2]) / MiB:.3f}MiB\""
    sharded = adopt.before_workers(_job(memory), SDXL)
    assert sharded.scaling.strategy == "fsdp" and sharded.scaling.workers == 2
    assert "of scaling.worker_memory's" in caplog.text
    with pytest.raises(ConfigError, match="set scaling.workers = 4 or more"):
        adopt.before_workers(_job(f'scaling.worker_memory="{_memory(peaks[4]) / MiB:.3f}MiB"'),
                             SDXL)  # fmt: skip


def test_check_refuses_workers_that_fit_with_no_strategy(peaks, capsys):
    memory = f"scaling.worker_memory={_memory(peaks[4]) / MiB:.3f}MiB"
    assert main(["check", str(TINY), "--set", "train.global_batch_size=16", "--set", memory]) == 2
    err = capsys.readouterr().err
    assert "scaling.workers = 2: a replica needs" in err and "scaling.workers = 4 or more" in err
    assert main(["check", str(TINY), "--set", "scaling.worker_memory=80GiB"]) == 0
    assert main(["check", str(TINY), "--set", 'scaling.worker_memory="80"']) == 2
    assert "scaling.worker_memory = '80': give a size" in capsys.readouterr().err


def test_plan_shows_the_choice(capsys):
    """Plan decides on its --gpu-memory as a run on GPUs would (its step settings free)."""
    args = ["plan", str(TINY), "--json", "--gpu-memory"]
    assert main([*args, "80GiB"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["strategy"] == "ddp" and roomy["sharded"] is None
    assert roomy["strategy_choice"].startswith("strategy auto → ddp: a replica needs")
    job = load_job(TINY)
    lean = auto.lean(job, auto.free_keys(job))
    traces = adopt.traces_of(job, SDXL)
    replica, two = auto.replica_peak(lean, traces), auto.sharded_peak(lean, traces, 2)
    assert two < replica
    between = f"{_memory(two) / MiB:.3f}MiB"
    assert main([*args, between]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["strategy"] == "fsdp" and tight["workers"] == 2
    assert tight["sharded"]["by_workers"][0]["workers"] == 2
    assert tight["strategy_choice"].startswith("strategy auto → fsdp: a replica needs")
    print_plan(tight)
    out = capsys.readouterr().out
    assert "  strategy auto → fsdp: " in out and "training worker of 2 (fsdp, sharded)" in out
    # without --gpu-memory, the memory the job says a worker has
    assert main(["plan", str(TINY), "--json", "--set", f"scaling.worker_memory={between}"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert named["gpu_memory"] == between and named["strategy"] == "fsdp"
    pinned = ["plan", str(TINY), "--json", "--set", 'scaling.strategy="ddp"', "--gpu-memory"]
    assert main([*pinned, between]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["strategy"] == "ddp" and kept["strategy_choice"] is None
