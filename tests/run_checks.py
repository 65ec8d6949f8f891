"""Checks on a training run from outside: what Ray Train has committed, and whether the LoRA
is what a user can use (the diffusers SDXL pipeline loads it)."""

from __future__ import annotations

import contextlib
import inspect
import json
from pathlib import Path

import numpy as np
import torch

from raytuner.families import FAMILIES
from raytuner.families.parts import Source

TINY = Source("tiny")


def _latest(run_dir: str) -> dict:
    """Ray Train's record of the latest checkpoint it registered (what a restart resumes from),
    from its snapshot file; {} before the first."""
    try:
        snapshot = json.loads(Path(run_dir, "checkpoint_manager_snapshot.json").read_text())
        return snapshot["latest_checkpoint_result"] or {}
    except (OSError, ValueError, KeyError, TypeError):  # not yet written, or being replaced
        return {}


def committed(run_dir: str) -> int:
    """The step of the latest checkpoint Ray Train has registered; 0 before the first."""
    return _latest(run_dir).get("metrics", {}).get("step", 0)


def committed_folder(run_dir: str) -> Path:
    """The folder of that checkpoint (a newer folder may exist, uploaded but not registered)."""
    return Path(run_dir, _latest(run_dir)["checkpoint_dir_name"])


def pipeline_image(pipe, **extra) -> np.ndarray:
    """Two seeded denoising steps at 64x64. Tiny models need two settings where a pipeline has
    them: their T5 / Gemma tokenizers keep 32 tokens, and Sana's resolution binning knows only
    the real models' sizes; a video pipeline's output is its frames; Flux.1 Kontext's renders
    about 1024 x 1024 unless its max_area says 64 x 64. ``extra``: more of the pipeline's
    arguments (an edit pipeline's reference image)."""
    accepts = set(inspect.signature(pipe.__call__).parameters)
    # a video pipeline (Wan) renders a one-frame clip
    tiny = {"max_sequence_length": 32, "use_resolution_binning": False, "num_frames": 1}
    tiny["max_area"] = 64 * 64
    out = pipe(
        prompt="a red circle",  # by name: FLUX.2's pipelines take an image first
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
        **{k: v for k, v in tiny.items() if k in accepts},
        **extra,
    )
    return out.images if hasattr(out, "images") else out.frames[:, 0]  # each clip's frame


def lora_changes_the_pipeline(lora_dir: str, family: str = "sdxl") -> bool:
    """Load ``lora_dir`` into the family's tiny pipeline: finite images that differ from the
    base model's."""
    pipe = FAMILIES[family].pipeline(TINY)
    before = pipeline_image(pipe)
    pipe.load_lora_weights(lora_dir)
    after = pipeline_image(pipe)
    return bool(np.isfinite(after).all() and not np.allclose(before, after))


def lora_checkpoint(folder: Path, name: str, jitter: float = 0.0) -> Path:
    """A checkpoint folder whose export is a LoRA of the tiny ``name`` family (its B matrices
    zero, or random with ``jitter``: then it changes the images)."""
    from raytuner.checkpoint.layout import EXPORT
    from raytuner.config import LoraConfig
    from raytuner.train.model import adapt

    family = FAMILIES[name]
    torch.manual_seed(0)
    weights = adapt(family.denoiser(TINY), mode="lora", lora=LoraConfig(rank=4),
                    targets=family.adapters.targets, ema_decay=0)  # fmt: skip
    with torch.no_grad():
        for p in weights.params:
            p.add_(torch.randn_like(p) * jitter)
    weights.export_lora(str(folder / EXPORT), family, {"raytuner.family": name})
    return folder


CACHE_JOB = """
[model]
family = "{family}"
pretrained = "{folder}"
[data]
images = "{images}"
cache = "{root}/cache"
[preprocess]
resolution = 64
bucket_step = 32
[train]
output = "{root}/runs"
"""


@contextlib.contextmanager
def cached_folder(name: str, root: Path):
    """The tiny ``name`` family saved as a diffusers folder and 6 demo images preprocessed from
    it by Ray Data (a local Ray running): yields (the open dataset, its rows' captions as the
    preprocess reads them: whitespace runs one space, ends stripped, the folder)."""
    from raytuner.api import preprocess
    from raytuner.config import load_job
    from raytuner.data import cache
    from raytuner.data.reader import open_dataset
    from raytuner.tools.demo_images import make_demo_images

    FAMILIES[name].pipeline(TINY).save_pretrained(root / "model")
    images = make_demo_images(root / "images", per_aspect=2)
    job_file = root / "job.toml"
    job_file.write_text(CACHE_JOB.format(family=name, folder=root / "model", images=images,
                                         root=root))  # fmt: skip
    job = load_job(job_file)
    assert preprocess(job)["encoded"] == 6
    data = open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    try:
        files = [(images / p).with_suffix(".txt") for p in data.paths]
        yield data, [" ".join(f.read_text().split()) for f in files], root / "model"
    finally:
        data.close()


def pipeline_image_with(pipe, lora_dir) -> np.ndarray:
    """The tiny pipeline's image with the LoRA of ``lora_dir`` loaded, then unloaded."""
    pipe.load_lora_weights(str(lora_dir))
    try:
        return pipeline_image(pipe)
    finally:
        pipe.unload_lora_weights()


def assert_other_trainers_layouts_start_the_lora(name: str, pipe, out: Path, peft: bool = False):
    """A rank-2 LoRA of the tiny ``name`` family written as other trainers write it: the
    diffusers names under ComfyUI's ``diffusion_model.`` with ``.alpha`` keys (ai-toolkit,
    ComfyUI), kohya's ``lora_unet_`` over the diffusers names (musubi-tuner), and with ``peft``
    also peft's ``.default`` keys. Each starts a run (``lora.init_from``) from raytuner's own
    LoRA, and the family's pipeline loads each as the same LoRA as raytuner's own file."""
    from safetensors.torch import save_file

    from raytuner.config import LoraConfig, ModelConfig, TrainConfig
    from raytuner.train.model import trainable_model

    family = FAMILIES[name]

    def weights(lora: LoraConfig):
        model, train = ModelConfig(family=name), TrainConfig(output="unused")
        return trainable_model(model, train, lora, family, torch.device("cpu")).weights

    known = weights(LoraConfig(rank=2, alpha=4.0))
    for p in known.params:  # B starts at zero: a LoRA that does something
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    known.export_lora(str(out / "own"), family, {})
    state = known.state()  # "<module>.lora_A.weight" / "lora_B"
    layouts: dict[str, dict] = {"comfy": {}, "kohya": {}} | ({"peft": {}} if peft else {})
    for m in sorted({k.rsplit(".lora_", 1)[0] for k in state}):
        down, up = state[f"{m}.lora_A.weight"], state[f"{m}.lora_B.weight"]
        comfy = f"diffusion_model.{m}"
        layouts["comfy"] |= {f"{comfy}.lora_A.weight": down, f"{comfy}.lora_B.weight": up,
                             f"{comfy}.alpha": torch.tensor(4.0)}  # fmt: skip
        flat = "lora_unet_" + m.replace(".", "_")
        layouts["kohya"] |= {f"{flat}.lora_down.weight": down, f"{flat}.lora_up.weight": up,
                             f"{flat}.alpha": torch.tensor(4.0)}  # fmt: skip
        if peft:
            layouts["peft"] |= {f"{comfy}.lora_A.default.weight": down,
                                f"{comfy}.lora_B.default.weight": up,
                                f"{comfy}.alpha": torch.tensor(4.0)}  # fmt: skip
    own = pipeline_image_with(pipe, out / "own" / "lora")
    for layout, tensors in layouts.items():
        (out / layout).mkdir()
        path = out / layout / "pytorch_lora_weights.safetensors"
        save_file(tensors, str(path))
        start = weights(LoraConfig(rank=2, alpha=4.0, init_from=str(path))).state()
        assert start.keys() == state.keys()
        for key in state:
            torch.testing.assert_close(start[key], state[key], msg=f"{layout}: {key}")
        np.testing.assert_allclose(pipeline_image_with(pipe, out / layout), own, atol=1e-5)
