"""Single-file checkpoints (``model.pretrained = "….safetensors"``) as model sites ship them: the
tiny SD1.5 and SDXL models written in the original LDM / SGM key layouts and the tiny Flux
transformer in BFL's (``single_file_layouts.py``), each described by a local diffusers folder
without those weights (no network), loaded with the file's weights, and a step trained on the
SD1.5 file through the worker's own setup; what ``raytuner check`` refuses, and a cache
fingerprint that tells files apart."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file
from single_file_layouts import bfl_flux, ldm_clip, ldm_unet, ldm_vae, sgm_open_clip

from raytuner import cli
from raytuner.config import ModelConfig, PreprocessConfig, load_job
from raytuner.data.cache import fingerprint
from raytuner.families import FAMILIES, parts
from raytuner.families.flux import _from_bfl
from raytuner.families.parts import Source
from raytuner.train import optim
from raytuner.train.model import trainable_model

SD15, SDXL, FLUX = FAMILIES["sd15"], FAMILIES["sdxl"], FAMILIES["flux"]
TINY = Source("tiny")


def _perturbed(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The module's weights moved a little: what a fine-tune saved, unlike the tiny preset."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v + 0.01 * torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v
        for k, v in module.state_dict().items()
    }


# --- fixtures ---------------------------------------------------------------------------------


def _without_weights(folder: Path, parts_: list[str]) -> None:
    """The diffusers folder keeps only configs, tokenizers and scheduler for ``parts_``."""
    for part in parts_:
        for f in (folder / part).glob("*.safetensors"):
            f.unlink()


@pytest.fixture(scope="module")
def sd15_file(tmp_path_factory) -> dict:
    """The tiny SD1.5 model, perturbed, as one LDM-layout file, and a config folder of the tiny
    pipeline without any weights."""
    root = tmp_path_factory.mktemp("single-sd15")
    pipe = SD15.pipeline(TINY)
    pipe.save_pretrained(root / "config")
    _without_weights(root / "config", ["unet", "vae", "text_encoder"])
    names = ("unet", "vae", "text_encoder")
    expected = {n: _perturbed(getattr(pipe, n), i) for i, n in enumerate(names)}
    layers = pipe.unet.config.layers_per_block
    tensors = (
        ldm_unet(expected["unet"], layers)
        | ldm_vae(expected["vae"])
        | ldm_clip(expected["text_encoder"])
    )
    path = root / "my-finetune.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return {"path": str(path), "config": str(root / "config"), "expected": expected}


def _same(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = module.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


# --- SD1.5: every part from the file, then a training step --------------------------------------


def test_sd15_single_file_loads_every_part_with_the_files_weights(sd15_file):
    source = parts.source(
        sd15_file["path"], "", "float32", "cpu", single_file_config=sd15_file["config"]
    )
    assert source.single_file and source.repo == sd15_file["config"]
    for part in ("unet", "vae", "text_encoder"):
        module = parts.load(SD15, source, part, SD15.parts.classes[part])
        _same(module, sd15_file["expected"][part])
    pipe = SD15.pipeline(source)  # what `raytuner sample` and validation build
    _same(pipe.unet, sd15_file["expected"]["unet"])
    _same(pipe.text_encoder, sd15_file["expected"]["text_encoder"])


def test_a_worker_trains_a_step_on_the_single_file_model(sd15_file, tmp_path):
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        f'[model]\nfamily = "sd15"\npretrained = "{sd15_file["path"]}"\n'
        f'single_file_config = "{sd15_file["config"]}"\n'
        f'[data]\nimages = "{tmp_path / "images"}"\ncache = "{tmp_path / "cache"}"\n'
        f'[train]\noutput = "{tmp_path / "runs"}"\n'
        "learning_rate = 1e-2\n[lora]\nrank = 4\nalpha = 4.0\n"
    )
    job = load_job(job_file)
    from PIL import Image

    (tmp_path / "images").mkdir()  # `check` lists the image folder: one image in it
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    assert cli.main(["check", str(job_file)]) == 0
    device = torch.device("cpu")
    source = parts.model_source(job.model, "cpu")
    # the preprocess encoders, from the file
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latent, _ = SD15.image_encoder(source, "cpu")(pixels)
    batch = {"latent": latent, **SD15.text_encoder(source, "cpu")(["a red circle", ""])}
    # the worker's own setup and one optimizer step
    denoiser, weights, source, amp, *_ = trainable_model(
        job.model, job.train, job.lora, SD15, device, job.memory
    )
    base = {k.replace(".base_layer", ""): v for k, v in denoiser.state_dict().items()}
    unet = sd15_file["expected"]["unet"]
    assert all(torch.equal(base[k], v) for k, v in unet.items())  # the file's frozen weights
    before = [p.detach().clone() for p in weights.params]
    opt, _ = optim.for_run(job.train, weights.params)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    loss = SD15.loss(source, job.objective.for_family(SD15))(denoiser, batch, generators).mean()
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, weights.params, strict=True))


def test_sdxl_single_file_tells_its_two_text_encoders_apart(tmp_path):
    """SGM's layout: both CLIPs of the tiny model have the same width, so only their key
    prefixes (``conditioner.embedders.0.`` / ``.1.``) say which is which."""
    pipe = SDXL.pipeline(TINY)
    pipe.save_pretrained(tmp_path / "config")
    names = ("unet", "vae", "text_encoder", "text_encoder_2")
    _without_weights(tmp_path / "config", list(names))
    expected = {n: _perturbed(getattr(pipe, n), 10 + i) for i, n in enumerate(names)}
    layers = pipe.unet.config.layers_per_block
    tensors = (
        ldm_unet(expected["unet"], layers)
        | ldm_vae(expected["vae"])
        | ldm_clip(expected["text_encoder"], "conditioner.embedders.0.")
        | sgm_open_clip(expected["text_encoder_2"])
    )
    path = tmp_path / "sdxl-finetune.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    source = parts.source(
        str(path), "", "float32", "cpu", family="sdxl", single_file_config=str(tmp_path / "config")
    )
    for name in names:
        _same(parts.load(SDXL, source, name, SDXL.parts.classes[name]), expected[name])
    text = SDXL.text_encoder(source, "cpu")(["a red circle"])
    assert text["prompt_embeds"].shape == (1, 77, 64)


# --- Flux: the transformer from a BFL file, the rest from the diffusers folder ------------------


def test_flux_single_file_holds_the_transformer_in_bfl_layout(tmp_path):
    pipe = FLUX.pipeline(TINY)
    pipe.save_pretrained(tmp_path / "config")
    _without_weights(tmp_path / "config", ["transformer"])
    expected = _perturbed(pipe.transformer, 7)
    path = tmp_path / "flux1-finetune.safetensors"
    comfy = {f"model.diffusion_model.{k}": v.contiguous() for k, v in bfl_flux(expected).items()}
    save_file(comfy, str(path))  # ComfyUI's prefix; bare BFL names are read the same way
    source = parts.source(
        str(path), "", "float32", "cpu", family="flux", single_file_config=str(tmp_path / "config")
    )
    _same(FLUX.denoiser(source), expected)
    vae = parts.load(FLUX, source, "vae", FLUX.parts.classes["vae"])  # from the folder
    _same(vae, pipe.vae.state_dict())


def test_bfl_conversion_matches_diffusers_at_flux1_width():
    """diffusers' converter assumes Flux.1's width (3072), so the tiny test above cannot run it;
    at that width (one block of each kind, thin tensors) both give the same tensors."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, joint_attention_dim=64)
    gen = torch.Generator().manual_seed(0)
    thin = {k: torch.randn(v.shape[0], generator=gen) for k, v in model.state_dict().items()}
    bfl = bfl_flux(thin)
    ours = _from_bfl(dict(bfl))
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert set(ours) == set(theirs) == set(thin)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor) and torch.equal(tensor, thin[key]), key


# --- what `raytuner check` refuses, and the cache fingerprint -----------------------------------


def _check(tmp_path: Path, family: str, pretrained: str, extra: str = "") -> int:
    job = tmp_path / f"{family}.toml"
    job.write_text(
        f'[model]\nfamily = "{family}"\npretrained = "{pretrained}"\n{extra}'
        f'[data]\nimages = "{tmp_path / "images"}"\ncache = "{tmp_path / "cache"}"\n'
        f'[train]\noutput = "{tmp_path / "runs"}"\n'
    )
    return cli.main(["check", str(job)])


def test_check_refuses_single_files_it_cannot_load(tmp_path, capsys, sd15_file):
    assert _check(tmp_path, "sana", sd15_file["path"]) == 2
    assert "model.pretrained" in capsys.readouterr().err
    missing = str(tmp_path / "nowhere.safetensors")
    assert _check(tmp_path, "sdxl", missing) == 2
    assert "no such file" in capsys.readouterr().err
    pickled = tmp_path / "model.ckpt"
    pickled.write_bytes(b"\x80\x04")
    assert _check(tmp_path, "sd15", str(pickled)) == 2
    assert ".safetensors" in capsys.readouterr().err
    config = 'single_file_config = "some/repo"\n'
    assert _check(tmp_path, "sd15", "tiny", config) == 2
    assert "model.single_file_config" in capsys.readouterr().err


def test_the_cache_fingerprint_tells_single_files_apart(sd15_file, tmp_path):
    pre = PreprocessConfig()

    def fp(path: str, config: str = "") -> str:
        model = ModelConfig(family="sd15", pretrained=path, single_file_config=config)
        return fingerprint(model, pre)

    original = fp(sd15_file["path"])
    assert fp(sd15_file["path"]) == original
    assert fp(sd15_file["path"], sd15_file["config"]) != original  # another config repo
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(sd15_file["path"], copy)
    first = fp(str(copy))
    save_file({"first_stage_model.x": torch.zeros(2)}, str(copy))  # replaced in place
    os.utime(copy, ns=(0, os.stat(copy).st_mtime_ns + 1))
    assert fp(str(copy)) not in (first, original)
