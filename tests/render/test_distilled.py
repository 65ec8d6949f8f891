"""A step- and guidance-distilled release (Z-Image Turbo, Flux.2 [klein]'s distilled ones) renders
in its few steps without classifier-free guidance where the job and the prompt line say
nothing (``validation.distilled``): in validation grids and in `raytuner sample`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from raytuner.checkpoint.layout import EXPORT
from raytuner.cli import main
from raytuner.config import LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.render.prompts import Defaults, PromptLine, is_distilled, resolve
from raytuner.render.sample import render
from raytuner.render.validation import RenderSpec, Validator
from raytuner.train.model import adapt

ZI = FAMILIES["z-image"]
TURBO = "Tongyi-MAI/Z-Image-Turbo"
LINE = [PromptLine(prompt="a red circle")]
DEFAULTS = Defaults(size=(32, 32), seeds=(0,), steps=None)


@pytest.fixture(scope="module")
def pipe():
    return ZI.pipeline(Source("tiny"))


def test_a_distilled_release_takes_its_few_steps_and_no_guidance(pipe):
    assert is_distilled(ZI, pipe, TURBO, "auto") and not is_distilled(ZI, pipe, "tiny", "auto")
    assert is_distilled(ZI, pipe, "/models/my-turbo-copy", "yes")
    assert not is_distilled(ZI, pipe, TURBO, "no")
    (turbo,) = resolve(LINE, ZI, DEFAULTS, distilled=True)
    (base,) = resolve(LINE, ZI, DEFAULTS, distilled=False)
    assert (turbo.steps, turbo.guidance_scale) == (8, 0.0)
    assert (base.steps, base.guidance_scale) == (None, 5.0)  # the pipeline's steps, its CFG
    # what the job or the line says still wins
    said = [PromptLine(prompt="a red circle", steps=3, scale=2.0)]
    (line,) = resolve(said, ZI, DEFAULTS, distilled=True)
    assert (line.steps, line.guidance_scale) == (3, 2.0)
    (job,) = resolve(LINE, ZI, Defaults(size=(32, 32), seeds=(0,), steps=4, guidance_scale=1.5),
                     distilled=True)  # fmt: skip
    assert (job.steps, job.guidance_scale) == (4, 1.5)


def test_a_pipeline_whose_config_says_is_distilled_is_one():
    pipe = ZI.pipeline(Source("tiny"))
    pipe.register_to_config(is_distilled=True)  # as Flux2KleinPipeline registers it
    assert is_distilled(ZI, pipe, "tiny", "auto")
    pipe.register_to_config(is_distilled=False)
    assert not is_distilled(ZI, pipe, "tiny", "auto")


def test_the_distilled_render_is_the_pipelines_few_step_render_without_cfg(pipe):
    (turbo,) = resolve(LINE, ZI, DEFAULTS, distilled=True)
    [[image]] = render(pipe, {}, [turbo])
    direct = pipe(
        "a red circle", width=32, height=32, num_inference_steps=8, guidance_scale=0.0,
        generator=torch.Generator("cpu").manual_seed(0), output_type="pil",
    ).images[0]  # fmt: skip
    assert np.array_equal(np.asarray(image), np.asarray(direct))
    (base,) = resolve([PromptLine(prompt="a red circle", steps=8)], ZI, DEFAULTS)
    [[guided]] = render(pipe, {}, [base])  # 8 steps with the family's CFG: another image
    assert not np.array_equal(np.asarray(image), np.asarray(guided))


def _z_image_lora_checkpoint(folder: Path) -> Path:
    """A checkpoint folder whose export is a Z-Image LoRA."""
    torch.manual_seed(0)
    weights = adapt(
        ZI.denoiser(Source("tiny")),
        mode="lora",
        lora=LoraConfig(rank=4),
        targets=ZI.adapters.targets,
        ema_decay=0,
    )
    weights.export_lora(str(folder / EXPORT), ZI, {"raytuner.family": "z-image"})
    return folder


def test_validation_of_a_distilled_model_records_its_few_steps_and_no_guidance(tmp_path):
    spec = RenderSpec(
        family="z-image", pretrained="tiny", revision="", dtype="auto", prompts=["a red circle"],
        seeds=[0], steps=0, size=(32, 32), run_dir=str(tmp_path / "run"), tensorboard=False,
        distilled="yes",
    )  # fmt: skip
    validator = Validator(asdict(spec))
    checkpoint = _z_image_lora_checkpoint(tmp_path / "ckpt")
    validator.enqueue(2, str(checkpoint), pafs.LocalFileSystem())
    (done,) = validator.drain()
    assert "error" not in done, done
    record = json.loads((tmp_path / "run" / "validation" / "step_000002.json").read_text())
    assert record["distilled"] is True
    assert [(r["steps"], r["guidance_scale"]) for r in record["lines"]] == [(8, 0.0)]


def test_check_refuses_distilled_yes_for_a_family_without_such_a_release(tmp_path, capsys):
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\nfamily = "sd15"\n[data]\nimages = "x"\ncache = "c"\n[train]\noutput = "o"\n'
        '[validation]\ndistilled = "yes"\n'
    )
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert 'validation.distilled = "yes": sd15 has no step-distilled release' in err
