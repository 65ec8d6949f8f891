"""Every family end to end, as a user runs it on a real checkpoint folder: the tiny model saved
with save_pretrained (a local diffusers folder), preprocessed by Ray Data, trained 3 steps by 2
Ray Train workers, and its exported LoRA loaded into the family's diffusers pipeline, which
loads the same folder with from_pretrained. Both export layouts carry the run's metadata, and the
kohya file gives the same images where diffusers can read it. `raytuner sample` of the latest
checkpoint renders two prompts x two seeds and their grid; its first image is another than the
base model's (rendered once per job file: a family's LoRA run and full fine-tune share it) and
the same as an exported folder's (one image each). Five families are also fine-tuned in full
with EMA, four on their LoRA runs' caches and SDXL on the session's skewed job; Flux trains again
with its blocks swapped (to the plain run's LoRA) and with float8 weights (a cache of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from run_checks import pipeline_image
from safetensors import safe_open
from safetensors.torch import load_file

from raytuner.api import preprocess, train
from raytuner.cli import main
from raytuner.config import load_job
from raytuner.families import FAMILIES, get_family
from raytuner.families.parts import Source

TINY = Source("tiny")
TRAINED: dict[str, dict] = {}  # family -> the summary of its plain 2-worker LoRA run

# diffusers converts kohya keys for these (FLUX.2's BFL names at any width); Flux's kohya file is
# sd-scripts' fused layout, which diffusers' converter splits only at Flux.1's own widths
# (tests/lora/test_lora_files.py checks it there, and on the tiny model for the modules it splits
# at any width; Wan's in its own names); Sana gets none
KOHYA_READ_BY_DIFFUSERS = {"sd15", "sdxl", "flux2-klein", "flux2-dev", "wan", "wan22", "wan22-5b"}
# [model] keys a family needs besides these: Wan 2.2 A14B trains one expert a run (the low-noise
# transformer_2: its LoRA loads with load_into_transformer_2)
MODEL_KEYS = {"wan22": 'expert = "low"'}
# [data] keys a family needs: LTX-2 places frames in time by seconds (every source a rate)
DATA_KEYS = {"ltx2": "fps = 24.0"}

JOB = """
[model]
family = "{family}"
pretrained = "{folder}"
{model_keys}
[data]
images = "{images}"
cache = "{root}/cache"
{data_keys}
[preprocess]
resolution = 64
bucket_step = 32  # a multiple of every family's latent grid (Sana: 32)
[train]
output = "{root}/runs"
max_steps = 3
global_batch_size = 4
learning_rate = 1e-2
log_every = 3
[lora]
save_dtype = "float32"  # exports compared to float rounding (the default float16 rounds)
[scaling]
workers = 2
cpus_per_worker = 0.5
[checkpoint]
every_steps = 3
"""


@pytest.fixture(scope="module")
def prepared(ray_local, tmp_path_factory):
    """family name -> its job file: the tiny model saved as a diffusers folder, 12 images
    drawn and preprocessed into a committed cache (once per family for this module)."""
    from raytuner.tools.demo_images import make_demo_images

    jobs: dict[str, Path] = {}

    def prepare(name: str) -> Path:
        if name not in jobs:
            root = tmp_path_factory.mktemp(name)
            FAMILIES[name].pipeline(TINY).save_pretrained(root / "model")
            images = make_demo_images(root / "images", per_aspect=4)
            keys = MODEL_KEYS.get(name, "")
            text = JOB.format(family=name, folder=root / "model", images=images, root=root,
                              model_keys=keys, data_keys=DATA_KEYS.get(name, ""))  # fmt: skip
            (root / "job.toml").write_text(text)
            job = load_job(root / "job.toml")
            report = preprocess(job)
            assert report["encoded"] == 12 and not report["skipped"]
            jobs[name] = root / "job.toml"
        return jobs[name]

    return prepare


FIRST = "00-a-red-circle-seed0.png"  # the first prompt at the first seed
BASE: dict[tuple, np.ndarray] = {}  # (job file, render options) -> the base model's FIRST


def sample(job_file: Path, checkpoint: str, out: Path, *more: str, one: bool = False) -> dict:
    """`raytuner sample` of two prompts x two seeds (``one``: the first prompt at the first
    seed alone: one PNG, no grid), 2 steps: file name -> pixels."""
    prompts = ["--prompt", "a red circle"] + ([] if one else ["--prompt", "a blue square"])
    seeds = ["--seed", "0"] + ([] if one else ["--seed", "7"])
    args = ["sample", str(job_file), "--checkpoint", checkpoint, *prompts, *seeds]
    code = main([*args, "--steps", "2", "--out", str(out), *more])
    assert code == 0
    record = json.loads((out / "samples.json").read_text())
    if one:
        assert record["files"] == [FIRST]
    else:
        assert len(record["files"]) == 5 and record["files"][-1] == "grid.png"
    return {name: np.asarray(Image.open(out / name)) for name in record["files"]}


def assert_sampling_uses_the_trained_weights(
    job_file: Path, tmp: Path, weights: str | None, *frames: str, run: str = "", levels: int = 0
) -> None:
    """`raytuner sample` with the latest checkpoint (of the run ``run``, else the job's):
    four 64x64 PNGs and their 2x2 grid; its first image differs from the base model's and
    (when given) equals that of the exported folder ``weights``, within ``levels`` of 255 per
    pixel. The base model's image is rendered once per job file (the LoRA run and the full
    fine-tune of a family share it)."""
    named = ("--set", f'train.name="{run}"') if run else ()
    latest = sample(job_file, "latest", tmp / "latest", *named, *frames)
    assert latest["grid.png"].shape == (128, 128, 3)
    assert all(image.shape == (64, 64, 3) for name, image in latest.items() if name != "grid.png")
    top_left = latest["grid.png"][:64, :64]  # first prompt, first seed
    assert np.array_equal(top_left, latest[FIRST])
    key = (str(job_file), frames)
    if key not in BASE:
        BASE[key] = sample(job_file, "base", tmp / "base", *frames, one=True)[FIRST]
    assert not np.array_equal(latest[FIRST], BASE[key])
    if weights is not None:
        exported = sample(job_file, weights, tmp / "exported", *named, *frames, one=True)
        difference = np.abs(exported[FIRST].astype(int) - latest[FIRST].astype(int))
        assert difference.max() <= levels, difference.max()


# SDXL runs the same path in tests/operate/test_demo.py (the demo is an SDXL job); Qwen-Image-Edit
# renders only from a reference image, which these renders have none of: its end-to-end run is
# on edit pairs, in tests/families/test_qwen_image_edit.py
ELSEWHERE = {"sdxl", "qwen-image-edit"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(FAMILIES) - ELSEWHERE))
def test_family_trains_on_two_workers_and_its_lora_loads(name, prepared, tmp_path):
    job = load_job(prepared(name))
    family, folder = get_family(name, job.model.expert), job.model.pretrained
    summary = TRAINED[name] = train(job)
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
    lora = load_file(summary["lora"])
    ups = [v for k, v in lora.items() if "lora.up" in k or "lora_B" in k]
    assert ups and all(v.abs().sum() > 0 for v in ups)  # B starts at zero: training moved it

    lora_dir = str(Path(summary["lora"]).parent)
    pipe = family.pipeline(Source(folder))
    before = pipeline_image(pipe)
    pipe.load_lora_weights(lora_dir, **family.lora_load)  # an expert's LoRA on its part
    after = pipeline_image(pipe)
    assert after.shape == (1, 64, 64, 3) and np.isfinite(after).all()
    assert not np.allclose(before, after)

    assert ("kohya" in summary) == bool(family.adapters.files.kohya)
    for path in (summary["lora"], summary.get("kohya", summary["lora"])):
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        assert meta["raytuner.family"] == name and meta["raytuner.steps"] == "3", path
        assert meta["raytuner.base_model"] == folder and meta["raytuner.run"] == job.train.name
        assert meta.get("raytuner.expert", "") == job.model.expert  # "job-low": its run
    if name in KOHYA_READ_BY_DIFFUSERS:  # the kohya file gives the same images
        pipe = family.pipeline(Source(folder))
        kohya = Path(summary["kohya"]).name
        pipe.load_lora_weights(lora_dir, weight_name=kohya, **family.lora_load)
        np.testing.assert_allclose(pipeline_image(pipe), after, atol=1e-5)
    # a LoRA export as --checkpoint: once (the full fine-tunes below check a model folder)
    exported = lora_dir if name == "sd15" else None
    # images (a video family's one-frame clips; its clips: tests/render/test_render_clips.py)
    one = ("--frames", "1") if family.geometry.frame_multiple else ()
    assert_sampling_uses_the_trained_weights(prepared(name), tmp_path, exported, *one)


@pytest.mark.slow
def test_flux_with_blocks_swapped_trains_the_same_lora_on_two_workers(prepared):
    """All but one of the tiny Flux's four blocks streamed through a ring of two, activations
    offloaded, under DDP on two gloo workers: the exported LoRA is the plain run's (gradient
    checkpointing recomputes the same numbers; only float rounding may differ)."""
    if "flux" not in TRAINED:
        TRAINED["flux"] = train(load_job(prepared("flux")))
    low = ["memory.blocks_to_swap=3", "memory.activation_offload=true"]
    overrides = ['train.name="swapped"', "train.gradient_checkpointing=true", *low]
    summary = train(load_job(prepared("flux"), overrides))
    assert summary["step"] == 3
    plain, swapped = load_file(TRAINED["flux"]["lora"]), load_file(summary["lora"])
    assert plain.keys() == swapped.keys()
    for key in plain:
        torch.testing.assert_close(swapped[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_float8_weights_with_8bit_adamw_and_swapped_blocks_train_a_lora_that_loads(prepared):
    """Flux with its frozen linear weights in float8 (computed in bfloat16), three of four
    blocks streamed, bitsandbytes' AdamW8bit and a cosine schedule, on one worker: the run
    trains, and its LoRA loads into the diffusers pipeline (float32) and changes the image.
    (8-bit optimizer state itself: tests/train/test_lowvram.py, on matrices over its threshold.)"""
    low = ['model.dtype="float8"', "memory.blocks_to_swap=3", "train.gradient_checkpointing=true"]
    optimizer = ['train.optimizer="adamw8bit"', 'train.lr_scheduler="cosine"']
    one = ["scaling.workers=1", "scaling.cpus_per_worker=1"]  # two: the test above
    job = load_job(prepared("flux"), ['train.name="fp8"', *low, *optimizer, *one])
    assert preprocess(job)["encoded"] == 12  # bf16 encoders
    summary = train(job)
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
    pipe = FAMILIES["flux"].pipeline(Source(job.model.pretrained))
    before = pipeline_image(pipe)
    pipe.load_lora_weights(str(Path(summary["lora"]).parent))
    after = pipeline_image(pipe)
    assert np.isfinite(after).all() and not np.allclose(before, after)


@pytest.mark.slow
# a UNet family, a transformer family, one whose captions are of their own lengths, one
# whose latents are patchified and normalised by its VAE's BatchNorm statistics, and the
# low-noise expert of Wan 2.2 A14B (its transformer_2 exported and rendered)
@pytest.mark.parametrize("name", ["sdxl", "flux", "z-image", "flux2-klein", "wan22"])
def test_full_fine_tune_with_ema_exports_a_model_folder(name, prepared, request, tmp_path):
    """SDXL trains on the session's skewed job (tiny model, committed cache), Flux, Z-Image,
    FLUX.2 [klein] and Wan 2.2 A14B (its job's low expert) on the caches the LoRA test above
    prepared: no extra preprocessing."""
    overrides = ['train.name="full"', 'train.mode="full"', "train.ema_decay=0.5"]
    overrides += ["train.max_steps=3", "checkpoint.every_steps=3", "train.sample_log=false"]
    job_file = request.getfixturevalue("job_file") if name == "sdxl" else prepared(name)
    job = load_job(job_file, overrides)
    family = get_family(name, job.model.expert)
    summary = train(job)
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
    exported = Path(summary["model"]) / family.parts.denoiser
    base = family.denoiser(Source(job.model.pretrained))
    model = type(base).from_pretrained(exported)  # a diffusers model folder
    meta = json.loads((exported / "raytuner.json").read_text())
    assert meta["raytuner.family"] == name and meta["raytuner.steps"] == "3"

    # the export holds the moving average, not the last trained weights
    newest = max(p for p in Path(job.train.output, "full").glob("checkpoint_*") if p.is_dir())
    trained, ema = load_file(newest / "weights.safetensors"), load_file(newest / "ema.safetensors")
    exported_state = model.state_dict()
    moved = [k for k in ema if not torch.equal(ema[k], trained[k])]
    assert moved, "an EMA of 0.5 over 3 steps differs from the trained weights"
    for key in moved:
        torch.testing.assert_close(exported_state[key], ema[key])
    assert any(not torch.equal(base.state_dict()[k], exported_state[k]) for k in moved)

    pipe = family.pipeline(Source(job.model.pretrained))
    setattr(pipe, family.parts.denoiser, model.eval())
    image = pipeline_image(pipe)
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
    # the latest checkpoint's weights, read a block at a time into freshly allocated tensors,
    # against the export that from_pretrained maps from its files: the same values at other
    # memory alignments, which the CPU's matmul kernels round differently (measured: 2.4e-7 in
    # the tiny Flux's output)
    one = ("--frames", "1") if family.geometry.frame_multiple else ()  # images, as above
    assert_sampling_uses_the_trained_weights(
        job_file, tmp_path, summary["model"], *one, run="full", levels=2
    )
