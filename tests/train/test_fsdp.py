"""Sharded training (``scaling.strategy = "fsdp"``) in real Ray Train runs (2 gloo workers on
CPU) against the same job trained replicated (``"ddp"``): the same loss at every step and the
same final weights, for a full fine-tune of the tiny Flux and the tiny SDXL in float32 and for a
LoRA with bfloat16 frozen weights (FSDP's mixed precision); a SIGKILLed worker of an
elastic group resumes from the sharded checkpoint; the export of a full fine-tune loads with
``from_pretrained`` and renders; a run cannot switch strategy. One run of `raytuner train`
serves the last two tests: a SIGKILLed worker is reported as the death it is; the run resumes
from its checkpoint at 1 worker, then at 2 (DCP reshards 2 -> 1 -> 2) and ends where the
uninterrupted run does; a damaged sharded checkpoint of it is then skipped naming the file.
The replicated reference run is trained once for the module.

Tolerance: the two strategies compute the same sums in another order (a reduce-scatter of the
gradients instead of an all-reduce, the gradient norm summed from each worker's rows) and the
float rounding of that order is all that differs; AdamW's normalised steps carry it through the
run. Measured on this machine (16 steps, lr 1e-3): at most 2e-6 (full Flux), and a LoRA equal
to the bit; the bound is 1e-4, the scale the 3-worker DDP run of test_train_exact.py allows.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image
from run_checks import TINY, lora_changes_the_pipeline, pipeline_image
from safetensors.torch import load_file
from test_train_exact import _workers_of_this_test

from raytuner.api import preprocess, sample, train
from raytuner.checkpoint import layout
from raytuner.config import ConfigError, load_job
from raytuner.families import FAMILIES
from raytuner.placement.strategy import SHARDED
from raytuner.train import sample_log

STEPS = 16
EVERY = 4
TOLERANCE = 1e-4

FLUX_JOB = """
[model]
family = "flux"
pretrained = "tiny"

[data]
images = "{root}/images"
cache = "{root}/cache"

[preprocess]
resolution = 64
bucket_step = 16
batch_size = 16

[train]
output = "{root}/runs"
max_steps = 16
global_batch_size = 4
learning_rate = 1e-3
log_every = 1
sample_log = true
mode = "full"

[lora]
save_dtype = "float32"  # exports compared to float rounding

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 4
keep = 2
max_failures = 2
"""


@pytest.fixture(scope="module")
def flux_job(ray_local, tmp_path_factory) -> Path:
    """A tiny Flux job on 10 images of two buckets, preprocessed once."""
    root = tmp_path_factory.mktemp("flux")
    rng = np.random.default_rng(1)
    (root / "images").mkdir()
    for i, (w, h) in enumerate([(64, 64)] * 6 + [(96, 64)] * 4):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"img{i}.png")
        (root / "images" / f"img{i}.txt").write_text(f"a noisy picture number {i}")
    path = root / "job.toml"
    path.write_text(FLUX_JOB.format(root=root))
    assert preprocess(load_job(path))["encoded"] == 10
    return path


_RUNS: dict[str, tuple[dict, Path]] = {}


def run(job_file: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    """Train (or resume) run ``name``; returns the summary and the run folder."""
    job = load_job(job_file, [f'train.name="{name}"', *overrides])
    return train(job), Path(job.train.output, name)


def once(job_file: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    """``run``, once per module and name."""
    key = f"{job_file}:{name}"
    if key not in _RUNS:
        _RUNS[key] = run(job_file, name, *overrides)
    return _RUNS[key]


def model_weights(summary: dict, part: str = "transformer") -> dict[str, torch.Tensor]:
    """The exported denoiser's tensors (every file of the model folder)."""
    folder = Path(summary["model"], part)
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    return {k: v for f in files for k, v in load_file(f).items()}


def assert_close(a: dict, b: dict, tolerance: float = TOLERANCE) -> float:
    """Every tensor within ``tolerance`` (relative norm); returns the largest difference."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        change = ((a[key] - b[key]).norm() / a[key].norm().clamp_min(1e-12)).item()
        assert change <= tolerance, f"{key}: relative difference {change:.2e}"
        worst = max(worst, change)
    return worst


def losses(run_dir: Path) -> dict[int, float]:
    """``train/loss`` at every step, as TensorBoard shows it (a resume's purge applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / layout.TENSORBOARD))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def assert_same_losses(a: Path, b: Path, tolerance: float = 1e-4) -> None:
    la, lb = losses(a), losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    for step in la:
        assert abs(la[step] - lb[step]) <= tolerance * abs(la[step]), (step, la[step], lb[step])


def _kill_after_checkpoint(run_dir: Path, killed: list, errors: list) -> None:
    """Once a complete checkpoint exists and the first attempt trained past it: hold the
    workers, SIGKILL one of them, let the other go on."""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            attempts = sample_log.read_attempts(str(run_dir))
            complete = layout.complete_checkpoints(str(run_dir))[1]
            if complete and attempts and max(attempts[0], default=0) > EVERY:
                workers = _workers_of_this_test()
                for worker in workers:
                    worker.suspend()
                at = max(sample_log.read_attempts(str(run_dir))[0])
                workers[-1].kill()
                for worker in workers[:-1]:
                    worker.resume()
                killed.append(at)
            time.sleep(0.02)
    except BaseException as e:  # raised again by the test
        errors.append(e)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_full_finetune_trains_as_ddp_and_resumes_a_killed_worker(flux_job):
    """The sharded run of a tiny Flux full fine-tune, an elastic group (``scaling.workers =
    [1, 2]``), has a worker SIGKILLed after its first checkpoint; the group starts again (on
    the workers the cluster then holds), resumes from that sharded checkpoint, trains every step
    once, and ends with the loss curve and the weights of the uninterrupted replicated run. Its
    export loads with ``from_pretrained`` and renders other images than the base model."""
    expected, reference = once(flux_job, "ddp", 'scaling.strategy="ddp"')
    run_dir = flux_job.parent / "runs" / "fsdp"
    killed, errors = [], []
    killer = threading.Thread(target=_kill_after_checkpoint, args=(run_dir, killed, errors))
    killer.start()
    summary, _ = run(flux_job, "fsdp", 'scaling.strategy="fsdp"', "scaling.workers=[1, 2]")
    killer.join()
    if errors:
        raise errors[0]
    assert killed, "the run finished before a worker could be killed"
    first, second = sample_log.read_attempts(str(run_dir))[:2]
    worlds = [{r["world"] for ranks in a.values() for r in ranks.values()} for a in (first, second)]
    assert worlds[0] == {2} and worlds[1] in ({1}, {2}), worlds
    resumed_from = min(second) - 1
    assert resumed_from % EVERY == 0 and 0 < resumed_from <= killed[0]
    assert summary["step"] == STEPS
    assert sample_log.trained(str(run_dir)) == sample_log.trained(str(reference))
    print(f"killed after step {killed[0]}, resumed from {resumed_from}")

    worst = assert_close(model_weights(expected), model_weights(summary))
    print(f"fsdp against ddp: largest relative difference {worst:.2e}")
    assert_same_losses(reference, run_dir)

    # the sharded checkpoint: every worker's rows in a file of its own, no export inside
    newest = Path(layout.complete_checkpoints(str(run_dir))[1][0])
    assert newest.name.endswith(f"_step-{STEPS:06d}")
    assert len(list((newest / layout.WEIGHTS_DIR).glob("*.safetensors"))) == 2
    assert not (newest / layout.EXPORT).exists() and not (newest / layout.WEIGHTS).exists()

    # `raytuner sample` reads the newest (sharded) checkpoint's weights a block at a time
    job = load_job(flux_job, ['train.name="fsdp"', 'scaling.strategy="fsdp"'])
    out = flux_job.parent / "samples"
    files = sample(job, ["a red circle"], seeds=[0], steps=2, out=str(out))
    record = json.loads((out / "samples.json").read_text())
    assert record["checkpoint"] == str(newest) and files[0].is_file()

    from diffusers import FluxTransformer2DModel

    pipe = FAMILIES["flux"].pipeline(TINY)
    base = pipeline_image(pipe)
    exported = FluxTransformer2DModel.from_pretrained(Path(summary["model"], "transformer"))
    pipe.register_modules(transformer=exported)
    image = pipeline_image(pipe)
    assert np.isfinite(image).all() and not np.allclose(image, base)


@pytest.mark.slow
def test_a_run_cannot_switch_strategy(flux_job):
    _, run_dir = once(flux_job, "ddp", 'scaling.strategy="ddp"')
    before = sorted(p.name for p in run_dir.iterdir())
    message = r"scaling.strategy = .ddp.*cannot switch.*checkpoint.resume=false"
    with pytest.raises(ConfigError, match=message):
        run(flux_job, "ddp", 'scaling.strategy="fsdp"', f"train.max_steps={STEPS + 4}")
    assert sorted(p.name for p in run_dir.iterdir()) == before


# FSDP's collectives (torch.distributed), by the names torch has called them
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor")  # fmt: skip


def _bf16_sharded_step(rank: int, port: int, out: str) -> None:
    """One of two gloo workers: the worker's own sharded LoRA model of the tiny Flux with
    bfloat16 frozen weights, one step of its own train step, every collective FSDP makes
    recorded (name, dtype) as it passes through; then the dtypes of the rows it keeps."""
    import torch.distributed as dist
    from test_sharded_checkpoints import _slice

    from raytuner.config import LoraConfig, MemoryConfig, ModelConfig, ObjectiveConfig, TrainConfig
    from raytuner.placement import sharding
    from raytuner.train import optim
    from raytuner.train.model import trainable_model
    from raytuner.train.step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    flux, cpu = FAMILIES["flux"], torch.device("cpu")
    model = ModelConfig(family="flux", pretrained="tiny", dtype="bfloat16")
    train = TrainConfig(output="unused", global_batch_size=4, max_steps=10)
    lora = LoraConfig(rank=4, alpha=4.0)
    trained = trainable_model(model, train, lora, flux, cpu, strategy=SHARDED)
    opt, sched = optim.for_run(train, trained.weights.params)
    loss_fn = flux.loss(trained.source, ObjectiveConfig().for_family(flux))
    step = train_step(trained, trained.denoiser, loss_fn, opt, sched, train, MemoryConfig(), cpu, 2)
    calls = []

    def recorded(name, real):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            calls.append((name, sorted({str(t.dtype) for t in tensors})))
            return real(*args, **kwargs)

        return call

    for name in (n for n in COLLECTIVES if hasattr(dist, n)):
        setattr(dist, name, recorded(name, getattr(dist, name)))
    loss = step(_slice(0, rank, 2)).item()
    rows = {name: str(sharding.local(p).dtype) for name, p in trained.denoiser.named_parameters()}
    Path(out, f"{rank}.json").write_text(json.dumps({"calls": calls, "rows": rows, "loss": loss}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_bfloat16_sharded_step_gathers_in_bfloat16_and_reduces_in_float32(tmp_path):
    """``model.dtype = "bfloat16"`` (every GPU run) reaches FSDP's mixed precision on a CPU: in
    a real sharded step of two gloo workers every all-gather moves bfloat16 (the units' rows,
    the float32 LoRA's cast) and every reduce-scatter float32 (the gradients); the LoRA keeps
    float32 rows, the frozen weights bfloat16 ones, and the loss is finite."""
    from ray_head import free_ports

    mp.spawn(_bf16_sharded_step, args=(free_ports(1)[0], str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"{rank}.json").read_text())
        gathers = [dtypes for name, dtypes in result["calls"] if "gather" in name]
        reduces = [dtypes for name, dtypes in result["calls"] if "reduce" in name]
        assert gathers and reduces, result["calls"]
        assert all(d == ["torch.bfloat16"] for d in gathers), gathers
        assert all(d == ["torch.float32"] for d in reduces), reduces
        rows = result["rows"]
        assert {d for n, d in rows.items() if ".lora_" in n} == {"torch.float32"}
        assert {d for n, d in rows.items() if ".lora_" not in n} == {"torch.bfloat16"}
        assert np.isfinite(result["loss"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_bfloat16_lora_sharded_trains_as_ddp(flux_job):
    """LoRA mode end to end: the frozen base sharded with its adapter, in bfloat16 (frozen
    weights bfloat16, autocast), trains, its losses finite, its checkpoint's rows float32, and
    ends where the replicated bfloat16 run does to float32's bound; the gathered export has the
    replicated run's kohya keys and changes the pipeline's images. (A float32 sharded LoRA is
    checked against one process per family in sharded_lora.py; a float32 sharded run end to
    end by the full fine-tunes here.) A unit's inputs are not cast (they
    are what a replicated block gets, test_fsdp_inputs.py), so the two round at the same places:
    measured (16 steps, lr 1e-3, 2026-11-27) equal to the bit. When FSDP cast each unit's inputs
    to bfloat16 the first step's losses differed by 1.4e-5 and the LoRA's B matrices by 5e-3."""
    bf16 = ('train.mode="lora"', "lora.rank=4", "lora.alpha=4.0", 'model.dtype="bfloat16"')
    assert preprocess(load_job(flux_job, list(bf16)))["encoded"] == 10  # encoded in bfloat16
    ddp, ddp_dir = run(flux_job, "bf16-ddp", *bf16, 'scaling.strategy="ddp"')
    fsdp, fsdp_dir = run(flux_job, "bf16-fsdp", *bf16, 'scaling.strategy="fsdp"')
    for run_dir in (ddp_dir, fsdp_dir):
        assert all(np.isfinite(v) for v in losses(run_dir).values()), losses(run_dir)
    newest = Path(layout.complete_checkpoints(str(fsdp_dir))[1][0])
    shards = sorted((newest / layout.WEIGHTS_DIR).glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        assert {t.dtype for t in load_file(shard).values()} == {torch.float32}, shard.name
    worst = assert_close(load_file(ddp["lora"]), load_file(fsdp["lora"]))
    print(f"bfloat16 LoRA fsdp against ddp: largest relative difference {worst:.2e}")
    assert_same_losses(ddp_dir, fsdp_dir)
    assert load_file(ddp["kohya"]).keys() == load_file(fsdp["kohya"]).keys()
    assert lora_changes_the_pipeline(str(Path(fsdp["lora"]).parent), "flux")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sharded_sdxl_full_finetune_trains_as_ddp(job_file):
    """The UNet sharded by its down/mid/up blocks, on the skewed job (12 steps, lr 1e-2, a
    padded bucket, rank 0 accumulating micro-batches). The validation actor renders the last
    sharded checkpoint (its weights read a block at a time)."""
    full = ('train.mode="full"', "train.learning_rate=1e-3", "train.micro_batch_size=1")
    ddp, ddp_dir = run(job_file, "full-ddp", *full, 'scaling.strategy="ddp"')
    validation = ("validation.every_steps=12", 'validation.prompts=["a red circle"]')
    validation += ("validation.steps=2",)
    fsdp, fsdp_dir = run(job_file, "full-fsdp", *full, 'scaling.strategy="fsdp"', *validation)
    rendered = json.loads((fsdp_dir / layout.VALIDATION / "step_000012.json").read_text())
    assert "error" not in rendered and (fsdp_dir / layout.VALIDATION / "step_000012.png").is_file()
    worst = assert_close(model_weights(ddp, "unet"), model_weights(fsdp, "unet"))
    print(f"SDXL fsdp against ddp: largest relative difference {worst:.2e}")
    assert sample_log.trained(str(ddp_dir)) == sample_log.trained(str(fsdp_dir))


def _raytuner_train(job_file: Path, tmp: Path, *settings: str, kill=None):
    """`raytuner train` of the job in a process of its own (its own local Ray), the workers'
    temporary files in ``tmp`` alone; ``kill(process)``: called meanwhile, in a thread.
    Returns (exit code, stderr, what ``kill`` returned)."""
    command = [sys.executable, "-m", "raytuner", "train", str(job_file)]
    for setting in settings:
        command += ["--set", setting]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"TMPDIR": str(tmp), "RAY_TMPDIR": tempfile.gettempdir()}  # Ray's sockets: short
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    killed = []
    killer = threading.Thread(target=lambda: killed.append(kill(process))) if kill else None
    if killer:
        killer.start()
    try:
        _, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if killer:
        killer.join()
    return process.returncode, err, killed[0] if killed else None


def _sigkill_a_worker_after_a_checkpoint(run_dir: Path):
    """Once the run has a complete checkpoint: SIGKILL one of its training workers; its pid."""

    def kill(process) -> int | None:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and process.poll() is None:
            if layout.complete_checkpoints(str(run_dir))[1]:
                children = psutil.Process(process.pid).children(recursive=True)
                workers = [p for p in children if "RayTrainWorker" in " ".join(p.cmdline())]
                workers[-1].kill()
                return workers[-1].pid
            time.sleep(0.1)
        return None

    return kill


def _newest_step(run_dir: Path) -> int:
    newest = layout.complete_checkpoints(str(run_dir))[1][0]
    return json.loads(Path(newest, layout.STATE).read_text())["step"]


def _flip_a_shard(checkpoint: Path) -> Path:
    """8 bytes flipped in the middle of the tensor data of the second worker's weights shard."""
    shard = sorted((checkpoint / layout.WEIGHTS_DIR).glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    middle = (8 + int.from_bytes(data[:8], "little") + len(data)) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    shard.write_bytes(bytes(data))
    return shard


# One sharded full fine-tune of `raytuner train` that the last two tests share: killed, then
# resumed at 1 worker, then at 2 (``killed_and_resharded``), then its final checkpoint damaged
KILLED = "killed"
SETTINGS = (f'train.name="{KILLED}"', 'scaling.strategy="fsdp"', "checkpoint.max_failures=0")


@pytest.fixture(scope="module")
def killed_and_resharded(flux_job, tmp_path_factory) -> dict:
    """A sharded full fine-tune submitted three times (each end-to-end run serves both tests
    below; what each left is kept here, before the damaged-checkpoint test changes the run):

    1. `raytuner train` at 2 workers, one SIGKILLed after the first checkpoint: the run ends
       (``checkpoint.max_failures = 0``) at the newest complete checkpoint;
    2. `raytuner train` again at 1 worker, one checkpoint further: it resumes from that
       checkpoint, its rows read back resharded (2 -> 1);
    3. ``train`` (in process, the session's Ray) at 2 workers to the end: it resumes from the
       1-worker checkpoint (1 -> 2)."""
    tmp, run_dir = tmp_path_factory.mktemp("killed"), flux_job.parent / "runs" / KILLED
    for attempt in ("1", "2"):
        (tmp / attempt).mkdir()
    kill = _sigkill_a_worker_after_a_checkpoint(run_dir)
    killed = _raytuner_train(flux_job, tmp / "1", *SETTINGS, "train.max_steps=400", kill=kill)
    assert killed[2] is not None and killed[0] == 1, killed[1][-3000:]  # (the test's, said early)
    newest = _newest_step(run_dir)
    assert newest + EVERY < STEPS, f"killed after step {newest}: no steps left to resume at 2"
    resumed = _raytuner_train(flux_job, tmp / "2", *SETTINGS, "scaling.workers=1",
                              f"train.max_steps={newest + EVERY}")  # fmt: skip
    assert resumed[0] == 0, resumed[1][-3000:]
    summary, _ = run(
        flux_job, KILLED, *SETTINGS[1:], "scaling.workers=2", f"train.max_steps={STEPS}"
    )
    return {
        "run_dir": run_dir, "killed": killed, "newest": newest, "resumed": resumed[:2],
        "resumed_tmp": tmp / "2", "summary": summary,
        "attempts": sample_log.read_attempts(str(run_dir)),
        "trained": sample_log.trained(str(run_dir)),
        "weights": model_weights({"model": str(run_dir / layout.MODEL_DIR)}),
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_sharded_checkpoint_resumes_on_another_number_of_workers(flux_job, killed_and_resharded):
    """The killed run's first steps at 2 workers, one checkpoint's more at 1, the rest at 2
    again: each checkpoint's rows are read back resharded (2 -> 1, then 1 -> 2), and the run
    ends with the uninterrupted run's rows and weights."""
    expected, reference = once(flux_job, "ddp", 'scaling.strategy="ddp"')
    chain, newest = killed_and_resharded, killed_and_resharded["newest"]
    assert chain["summary"]["step"] == STEPS
    first, *attempts = chain["attempts"]
    assert min(first) == 1 and max(first) >= newest
    assert [(min(a), max(a)) for a in attempts] == [(newest + 1, newest + EVERY),
                                                   (newest + EVERY + 1, STEPS)]  # fmt: skip
    assert {len(first[step]) for step in range(1, newest + 1)} == {2}  # the killed attempt's
    assert {r["world"] for ranks in first.values() for r in ranks.values()} == {2}
    assert [{len(r) for r in a.values()} for a in attempts] == [{1}, {2}]
    assert chain["trained"] == sample_log.trained(str(reference))
    worst = assert_close(model_weights(expected), chain["weights"])
    print(f"2 -> 1 -> 2 workers against ddp: largest relative difference {worst:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_killed_worker_and_a_damaged_sharded_checkpoint_say_what_happened(
    flux_job, killed_and_resharded, tmp_path
):
    """`raytuner train` of a sharded full fine-tune (``killed_and_resharded``):

    1. a worker SIGKILLed after the first checkpoint: the run ends naming that worker (not the
       survivor's lost gloo connection) and the newest complete checkpoint to resume from;
    2. the same command (at 1 worker) resumes there, trains another checkpoint and leaves no
       temporary copy of it (a worker's ``raytuner-ckpt-*``) in TMPDIR; the run is then
       trained to the end;
    3. 8 flipped bytes in a weights shard of its final checkpoint: the finished run submitted
       again is not exported from it; a warning names the shard, the workers skip it and train
       the last steps again from the checkpoint before, to the same weights (before checksums,
       the run resumed and exported the flipped weights silently), and leave no temporary copy
       of every worker's in TMPDIR."""
    chain = killed_and_resharded
    newest, run_dir = chain["newest"], chain["run_dir"]
    code, err, pid = chain["killed"]
    lines = [line for line in err.splitlines() if line.startswith("raytuner:")]
    print(lines[-1:])
    assert pid is not None and code == 1, err[-3000:]
    assert re.fullmatch(
        rf"raytuner: train failed: WorkerDied: training worker \d \(pid {pid} on \S+\) died: "
        rf".*SIGKILL.*\. The newest complete checkpoint is step {newest} \(.+\): the same "
        r"command resumes from it",
        lines[-1],
    ), lines

    code, err = chain["resumed"]
    assert code == 0, err[-3000:]
    assert f"rank 0 resumed at step {newest} " in err
    assert not list(chain["resumed_tmp"].glob("raytuner-ckpt-*")), "temporary copies left behind"

    final = Path(layout.complete_checkpoints(str(run_dir))[1][0])
    assert final.name.endswith(f"_step-{STEPS:06d}")
    shard = _flip_a_shard(final)
    code, err, _ = _raytuner_train(flux_job, tmp_path, *SETTINGS, f"train.max_steps={STEPS}")
    assert code == 0, err[-3000:]
    assert re.search(rf"not exporting run {KILLED}'s final checkpoint, which is damaged: "
                     rf"{re.escape(str(shard))}: the bytes of ", err), err[-3000:]  # fmt: skip
    assert f"skipping unreadable checkpoint: {shard}: " in err
    assert f"rank 0 resumed at step {STEPS - EVERY} " in err
    assert not list(tmp_path.glob("raytuner-ckpt-*")), "temporary copies left behind"
    again, expected = model_weights({"model": str(run_dir / layout.MODEL_DIR)}), chain["weights"]
    assert again.keys() == expected.keys()
    assert all(torch.equal(again[k], expected[k]) for k in expected)
