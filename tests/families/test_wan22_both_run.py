"""Wan 2.2 A14B's two experts trained in one run (``model.expert = "both"``) by two Ray Train
workers on the tiny model (slow, one shared preprocess and reference run): both ranks train the
same expert at each step, in turns of ``model.expert_switch_every`` steps, each sample's noise
level in its range (the sample log); both LoRAs trained; the validation actor renders with them;
a SIGKILLed worker resumes exactly; sharded (fsdp), a resumed run ends as the replicated one;
both exported files load into WanPipeline, each onto its expert, and `raytuner sample` renders
with both. The reference run validates; the killed and the sharded runs, whose checks are of
training alone, run without the validation actor (``validation.every_steps = 0``). The quick
tests: ``test_wan22_both.py``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from run_checks import pipeline_image
from safetensors.torch import load_file
from test_clip_training import _kill_after
from test_wan22_both import EVERY, RANGES, TINY

from raytuner.api import preprocess, train
from raytuner.checkpoint import layout
from raytuner.cli import main
from raytuner.config import load_job
from raytuner.families import FAMILIES, get_family, mixture
from raytuner.train import sample_log

# room after the kill's step: a loaded machine trains on while the kill is set up (as
# tests/train/test_clip_training.py)
STEPS = 16
E2E = """
[model]
family = "wan22"
expert = "both"
expert_switch_every = {every}
[data]
images = "{images}"
cache = "{root}/cache"
[preprocess]
resolution = 64
bucket_step = 32
[train]
output = "{root}/runs"
max_steps = {steps}
global_batch_size = 4
learning_rate = 1e-2
log_every = 1
sample_log = true
[objective.flow]
timestep_sampling = "uniform"
resolution_shift = false
shift = 3.0
[lora]
save_dtype = "float32"
[scaling]
workers = 2
cpus_per_worker = 0.5
[checkpoint]
every_steps = 4
keep = 2
max_failures = 2
[validation]
every_steps = {steps}
prompts = ["a red circle"]
steps = 2
width = 64
height = 64
frames = 1
"""


@pytest.fixture(scope="module")
def both_job(ray_local, tmp_path_factory) -> Path:
    from raytuner.tools.demo_images import make_demo_images

    root = tmp_path_factory.mktemp("a14b-both")
    images = make_demo_images(root / "images", per_aspect=2)
    path = root / "job.toml"
    path.write_text(E2E.format(every=EVERY, steps=STEPS, images=images, root=root))
    assert preprocess(load_job(path))["encoded"] == 6
    return path


RUNS: dict[str, tuple[dict, str]] = {}
UNVALIDATED = "validation.every_steps=0"  # no validation actor: the reference run checks it


def _run(job_file: Path, name: str, *settings: str) -> tuple[dict, str]:
    if name not in RUNS or settings:
        job = load_job(job_file, [f'train.name="{name}"', *settings])
        RUNS[name] = train(job), f"{job.train.output}/{name}"
    return RUNS[name]


def _assert_same_loras(summary: dict, expected: dict, tolerance: float) -> float:
    """Each expert's exported LoRA within ``tolerance`` (relative norm, each tensor) of the
    reference run's; returns the largest difference."""
    worst = 0.0
    for expert in ("high", "low"):
        wa, wb = load_file(summary["experts"][expert]), load_file(expected["experts"][expert])
        assert wa.keys() == wb.keys()
        for key in wa:
            change = float((wa[key] - wb[key]).norm() / wa[key].norm().clamp_min(1e-12))
            assert change <= tolerance, f"{expert} {key}: relative difference {change:.2e}"
            worst = max(worst, change)
    return worst


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_workers_train_both_experts_in_turn_and_resume_exactly_after_a_kill(both_job):
    """The sample log: both ranks train the same expert at each step, high for 2 steps then
    low, every sample's noise level in its range; both exported LoRAs trained (B no longer
    zero); the validation actor rendered the last checkpoint with them. A worker SIGKILLed
    after a checkpoint: the run resumes there and ends with the uninterrupted run's
    rows and both experts' weights."""
    expected, reference_dir = _run(both_job, "reference")
    assert expected["step"] == STEPS and set(expected["experts"]) == {"high", "low"}
    validated = Path(reference_dir) / "validation" / f"step_{STEPS:06d}"
    record = json.loads(validated.with_suffix(".json").read_text())
    assert "error" not in record and validated.with_suffix(".png").is_file(), record
    (attempt,) = sample_log.read_attempts(reference_dir)
    for step, ranks in sorted(attempt.items()):
        name = ("high", "low")[(step - 1) // EVERY % 2]
        assert [ranks[r]["expert"] for r in (0, 1)] == [name, name], step
        low, high = RANGES[name]
        assert all(low <= s < high for r in (0, 1) for s in ranks[r]["sigma"]), step
    for path in expected["experts"].values():
        ups = [v for k, v in load_file(path).items() if ".lora_B." in k]
        assert ups and all(v.abs().max() > 0 for v in ups), path

    run_dir = str(Path(load_job(both_job).train.output) / "killed")
    killed: list = []
    killer = threading.Thread(target=_kill_after, args=(run_dir, 5, killed))
    killer.start()
    summary, _ = _run(both_job, "killed", UNVALIDATED)
    killer.join()
    assert killed, "the run finished before a worker could be killed"
    assert killed[0] < STEPS, f"the worker was killed after the last step ({killed[0]})"
    second = sample_log.read_attempts(run_dir)[1]
    resumed = min(second) - 1  # at the newest checkpoint Ray had registered (every 4 steps)
    assert resumed % 4 == 0 and 4 <= resumed <= killed[0], (resumed, killed[0])
    assert sample_log.trained(run_dir) == sample_log.trained(reference_dir)
    _assert_same_loras(summary, expected, 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_both_experts_sharded_resume_from_a_sharded_checkpoint_and_end_as_ddp(both_job):
    """``scaling.strategy = "fsdp"``: each expert's blocks sharded over the two workers, half
    the steps, then the same command to the end resumes from the sharded checkpoint (the idle
    expert's rows and its adapter's optimizer state included) and ends with the replicated
    run's rows and both experts' LoRAs (float rounding apart: the bound of tests/train/
    test_fsdp.py)."""
    expected, reference_dir = _run(both_job, "reference")
    sharded = ('scaling.strategy="fsdp"', UNVALIDATED)
    _run(both_job, "sharded", *sharded, f"train.max_steps={STEPS // 2}")
    summary, run_dir = _run(both_job, "sharded", *sharded)
    newest = Path(layout.complete_checkpoints(run_dir)[1][0])
    assert len(list((newest / layout.WEIGHTS_DIR).glob("shard-*.safetensors"))) == 2  # a worker's
    attempts = sample_log.read_attempts(run_dir)
    assert [(min(a), max(a)) for a in attempts] == [(1, STEPS // 2), (STEPS // 2 + 1, STEPS)]
    assert sample_log.trained(run_dir) == sample_log.trained(reference_dir)
    worst = _assert_same_loras(summary, expected, 1e-4)
    print(f"both experts sharded, resumed, against ddp: largest relative difference {worst:.1e}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_both_exported_loras_load_into_wanpipeline_and_sample_renders_with_both(both_job, tmp_path):
    """lora/high/ loads into ``transformer`` (as a high-noise run's), lora/low/ with
    load_into_transformer_2 into ``transformer_2``; each changes the render, and with both the
    image is neither's alone. What `raytuner sample` and validation load (the run's lora/
    folder, ``apply_weights``) is both: the image with both; `raytuner sample` of the run's
    latest checkpoint renders another image than the base model."""
    from raytuner.lora.find import find_weights
    from raytuner.render.sample import apply_weights

    expected, _ = _run(both_job, "reference")
    lora = Path(expected["lora"])
    pipe = FAMILIES["wan22"].pipeline(TINY)
    images = {"base": pipeline_image(pipe)}
    for name, loads in (("high", {}), ("low", {"load_into_transformer_2": True})):
        pipe.load_lora_weights(str(lora / name), **loads)
        part = "transformer_2" if loads else "transformer"
        assert any("lora" in k for k in getattr(pipe, part).state_dict()), name
        images[name] = pipeline_image(pipe)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(lora / "low"), load_into_transformer_2=True)
    images["low alone"] = pipeline_image(pipe)
    assert not np.allclose(images["base"], images["high"])
    assert not np.allclose(images["base"], images["low alone"])
    assert not np.allclose(images["low"], images["high"])  # both: the low one added
    assert not np.allclose(images["low"], images["low alone"])  # both: the high one too

    family = get_family("wan22", mixture.BOTH)
    apply_weights(pipe, family, find_weights(str(lora)), "cpu")
    np.testing.assert_allclose(pipeline_image(pipe), images["low"], atol=1e-6)

    out = {}
    for checkpoint in ("latest", "base"):
        folder = tmp_path / checkpoint
        args = ["sample", str(both_job), "--checkpoint", checkpoint, "--prompt", "a red circle"]
        args += ["--seed", "0", "--steps", "2", "--out", str(folder)]
        assert main([*args, "--set", 'train.name="reference"']) == 0
        (png,) = folder.glob("*.png")
        out[checkpoint] = np.asarray(Image.open(png))
    assert not np.array_equal(out["latest"], out["base"])
