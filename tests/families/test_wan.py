"""The Wan 2.1 family, trained on images (one-frame clips): its cache holds what WanPipeline's own
encoders make (UMT5's rows of the caption's tokens alone, the 3-D VAE's latents normalized per
channel), its loss pads the caption back to the pipeline's length with zero rows and calls the
transformer at sigma x 1000 as musubi-tuner's Wan trainer does, its LoRA loads through the
pipeline, its kohya file carries Wan's own module names (what ComfyUI maps) and `raytuner plan`
builds the released 14.29 B transformer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from run_checks import lora_changes_the_pipeline
from safetensors.torch import load_file

from raytuner.checkpoint.layout import DIFFUSERS_FILE, KOHYA_FILE
from raytuner.config import FlowObjective, LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.lora import export, kohya
from raytuner.lora.init_from import file_modules
from raytuner.train.model import adapt

TINY = Source("tiny")
WAN = FAMILIES["wan"]
CAPTIONS = ["a red circle", "a much longer caption: a blue square on a grey ground", ""]


@pytest.fixture(scope="module")
def pipe():
    return WAN.pipeline(TINY)


@pytest.fixture(scope="module")
def batch(pipe) -> dict[str, torch.Tensor]:
    pixels = torch.rand(3, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latent, std = WAN.image_encoder(TINY, "cpu")(pixels)
    assert latent.shape == std.shape == (3, 16, 1, 8, 12)  # 16 channels at 1/8, one frame
    return {"latent": latent, "pixels": pixels, **WAN.text_encoder(TINY, "cpu")(CAPTIONS)}


def _direct_text(pipe) -> torch.Tensor:
    """The pipeline's own encode_prompt: [B, max_sequence_length, width], zero-padded."""
    embeds, _ = pipe.encode_prompt(
        list(CAPTIONS), do_classifier_free_guidance=False, device=torch.device("cpu"),
        max_sequence_length=WAN.pipeline_options(pipe)["max_sequence_length"],
    )  # fmt: skip
    return embeds


def test_cached_text_is_the_pipelines_encode_prompt_without_its_zero_rows(pipe, batch):
    from raytuner.families.text import rows_kept

    direct = _direct_text(pipe)
    text = batch["prompt_embeds"]
    torch.testing.assert_close(text, direct)  # float32 rounding of the thread split apart
    assert not text[0, rows_kept(text)[0] :].any()  # zero rows after the caption's own
    kept = rows_kept(text)  # what the cache stores of each caption: its tokens and </s>
    ids = pipe.tokenizer(CAPTIONS, truncation=True, max_length=64).input_ids
    assert kept == [len(i) for i in ids] and kept[0] < kept[1] and kept[2] == 1


def test_cached_latent_is_what_the_pipeline_decodes(pipe, batch):
    """WanPipeline decodes latents / (1 / latents_std) + latents_mean (one frame: an image)."""
    mean = pipe.vae.encode(batch["pixels"].unsqueeze(2)).latent_dist.mean
    config = pipe.vae.config
    m = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(batch["latent"] / std + m, mean, rtol=1e-5, atol=1e-5)


def test_the_loss_is_a_flow_step_at_sigma_times_1000_with_512_style_zero_padding(pipe, batch):
    """Same noise and levels: x_t = (1 - s) x0 + s noise, the transformer on the one-frame clip
    at timestep 1000 s with the caption zero-padded to the pipeline's length, against
    noise - x0. Cut to its rows alone (no padding), the caption gives another loss: the zero
    rows matter, so the loss must put them back."""
    model = WAN.denoiser(TINY)
    objective = FlowObjective(resolution_shift=False, shift=3.0, timestep_sampling="uniform")
    loss = WAN.loss(TINY, objective)
    x0, full = batch["latent"], _direct_text(pipe)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    drawn = loss.draw(tuple(x0.shape), gens)
    longest = max(1, *(int(n) for n in (full != 0).any(-1).sum(1)))
    cut = full[:, :longest]  # the feed's batch: padded to its longest caption only
    ours = loss(model, {"latent": x0, "prompt_embeds": cut, **drawn})

    noise, sigmas = drawn["noise"], drawn["sigma"]
    s = sigmas[:, None, None, None, None]
    noisy = (1.0 - s) * x0 + s * noise
    with torch.no_grad():
        pred = model(noisy, sigmas * 1000, full, return_dict=False)[0]
        theirs = ((pred - (noise - x0)) ** 2).reshape(3, -1).mean(1)
        short = model(noisy, sigmas * 1000, cut, return_dict=False)[0]
    torch.testing.assert_close(ours.detach(), theirs)
    assert not torch.allclose(((short - (noise - x0)) ** 2).reshape(3, -1).mean(1), theirs)


def _trained(batch) -> tuple[torch.nn.Module, object]:
    model = WAN.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(model, mode="lora", lora=lora, targets=WAN.adapters.targets, ema_decay=0)
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss = WAN.loss(TINY, FlowObjective())
    train = {k: v for k, v in batch.items() if k != "pixels"}
    for _ in range(3):
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        loss(model, train, gens).mean().backward()
        opt.step(), opt.zero_grad()
    return model, weights


def test_a_clip_encodes_to_n_plus_1_latent_frames_of_the_vae_and_trains(pipe):
    """A clip of 4n + 1 frames: [B, 16, n + 1, h, w], the VAE's own latents in the
    transformer's scale, the shape ``cache_shapes`` names; the loss runs on it with T x h/2 x
    w/2 tokens shifting the drawn levels (more frames: a larger shift, noisier levels)."""
    clip = torch.rand(2, 3, 9, 32, 48, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latent, std = WAN.image_encoder(TINY, "cpu")(clip)
    assert latent.shape == std.shape == (2, 16, 3, 4, 6)
    assert WAN.cache_shapes(48, 32, frames=9)["latent"] == (16, 3, 4, 6)
    assert WAN.cache_shapes(832, 480, frames=81)["latent"] == (16, 21, 60, 104)
    assert WAN.cache_shapes(48, 32)["latent"] == (16, 1, 4, 6)
    config = pipe.vae.config
    m = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    s = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    direct = pipe.vae.encode(clip).latent_dist.mean
    torch.testing.assert_close(latent * s + m, direct, rtol=1e-5, atol=1e-5)
    loss = WAN.loss(TINY, FlowObjective(resolution_shift=True, timestep_sampling="uniform"))
    # 21 latent frames of 4x6 tokens shift as one frame of 4x126: the same 504 tokens
    clip = loss.draw((2, 16, 21, 8, 12), [torch.Generator().manual_seed(i) for i in range(2)])
    wide = loss.draw((2, 16, 1, 8, 252), [torch.Generator().manual_seed(i) for i in range(2)])
    frame = loss.draw((2, 16, 1, 8, 12), [torch.Generator().manual_seed(i) for i in range(2)])
    torch.testing.assert_close(clip["sigma"], wide["sigma"])
    assert (clip["sigma"] > frame["sigma"]).all()
    text = WAN.text_encoder(TINY, "cpu")(CAPTIONS[:2])
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    out = loss(WAN.denoiser(TINY), {"latent": latent, **text}, gens)
    assert out.shape == (2,) and torch.isfinite(out).all()


def test_a_trained_lora_loads_into_wan_pipeline_in_both_layouts(batch, tmp_path):
    """The diffusers file, and the second file in Wan's own names under ComfyUI's
    ``diffusion_model.`` (which diffusers' Wan loader converts) change the pipeline's image
    alike."""
    model, weights = _trained(batch)
    names = [n for n in weights.names if "lora_B" in n]
    assert {n.split(".")[2] for n in names} == {"attn1", "attn2"} and len(names) == 3 * 8
    weights.export_lora(str(tmp_path), WAN, {"raytuner.family": "wan"})
    folder = tmp_path / "lora"
    kohya_file = load_file(folder / KOHYA_FILE)
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in kohya_file
    assert "diffusion_model.blocks.1.cross_attn.o.alpha" in kohya_file
    assert lora_changes_the_pipeline(str(folder), "wan")
    diffusers_image = _image_with(str(folder / DIFFUSERS_FILE))
    kohya_image = _image_with(str(folder / KOHYA_FILE))
    np.testing.assert_allclose(kohya_image, diffusers_image, atol=2e-3)


def _image_with(path: str) -> np.ndarray:
    from run_checks import pipeline_image

    pipe = WAN.pipeline(TINY)
    pipe.load_lora_weights(path)
    return pipeline_image(pipe)


def test_init_from_reads_the_kohya_file_back_into_the_same_modules(batch, tmp_path):
    model, weights = _trained(batch)
    weights.export_lora(str(tmp_path), WAN, {"raytuner.family": "wan"})
    tensors = load_file(tmp_path / "lora" / KOHYA_FILE)
    found = file_modules(tensors, {}, WAN, model)
    state = weights.state()
    assert set(found) == set(kohya.modules_of(state))
    for module, (down, up, alpha) in found.items():
        torch.testing.assert_close(down, state[f"{module}.lora_A.weight"].to(down.dtype))
        torch.testing.assert_close(up, state[f"{module}.lora_B.weight"].to(up.dtype))
        assert alpha == 4.0
    assert export.kohya_names(WAN, model) is not None


def test_the_tiny_pipeline_renders_an_image_through_the_sample_path(pipe):
    from raytuner.render.prompts import Defaults, PromptLine, resolve
    from raytuner.render.sample import render

    (r,) = resolve([PromptLine(prompt="a red circle", steps=2)], WAN,
                   Defaults(size=(48, 64), seeds=(0,), steps=None))  # fmt: skip
    [[image]] = render(pipe, WAN.pipeline_options(pipe), [r])
    assert image.size == (48, 64) and np.isfinite(np.asarray(image)).all()


def test_plan_traces_the_encoder_actor_on_clips_of_a_frame_count():
    """``trace_encoders(frames=81)`` (by default the largest frame bucket: 81): the 3-D VAE's
    pass over 81 frames at 480x832 makes the released latent 16x21x60x104 and needs more
    memory than one frame."""
    from pathlib import Path

    from raytuner.config import load_job
    from raytuner.tools.plan import trace

    job = load_job(Path(__file__).parents[2] / "jobs" / "tiny.toml", ['model.family="wan"'])
    image, shapes = trace.trace_encoders(job, WAN, (832, 480), frames=1)
    clip, clip_shapes = trace.trace_encoders(job, WAN, (832, 480), frames=81)
    assert shapes["latent"] == (16, 1, 60, 104) and clip_shapes["latent"] == (16, 21, 60, 104)
    assert clip["peak_bytes"] > image["peak_bytes"]


def _normalized(vae, dist) -> tuple[torch.Tensor, torch.Tensor]:
    """A VAE's latent distribution in the transformer's scale, as WanPipeline decodes it."""
    m = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    s = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (dist.mean - m) / s, dist.std / s


@pytest.mark.parametrize(
    ("name", "tile", "stride", "apart"),
    [("wan", 64, 48, 0.1), ("wan22-5b", 32, 24, 0.25)],  # 5B: tiles of its 2x2-patched pixels
)
def test_frames_above_the_tile_threshold_are_encoded_in_diffusers_tiles(
    name, tile, stride, apart, monkeypatch
):
    """A frame of more than ``wan.TILE_ABOVE`` pixels (720p and above) is encoded with
    diffusers' ``AutoencoderKLWan`` tiling on: the family's encoder gives exactly the VAE's own
    tiled encode of the same frames (a clip of 5 frames, 2 x 3 tiles), which differs from the
    whole frame's encode by the seams' blending and the tiles' borders (the tiny random VAE's
    mid-block attention sees the whole frame: no latent is left unchanged; measured: 3 % of
    the mean magnitude for Wan 2.1's VAE, 13 % for the 5B's at these tiny tiles); a frame at the
    threshold is encoded whole again after it. At test sizes: the tiny VAE's tiles cut to
    ``tile`` pixels and the threshold lowered to 96 x 96 (a 720p frame takes it ~30 s)."""
    from raytuner.families import wan

    monkeypatch.setattr(wan, "TILE_ABOVE", 96 * 96)
    vae = FAMILIES[name].part(TINY, "vae", "cpu")
    vae.enable_tiling(tile, tile, stride, stride)  # the tile sizes; the encoder switches it
    vae.disable_tiling()
    encode = wan.wan_image_encoder(vae, "cpu")  # what the family's image_encoder returns
    g = torch.Generator().manual_seed(2)
    clip = torch.rand(1, 3, 5, 96, 128, generator=g) * 2 - 1  # above the threshold
    image = torch.rand(1, 3, 96, 96, generator=g) * 2 - 1  # at it

    mean, std = encode(clip)
    at = encode(image)[0]  # right after: tiling turned off again
    vae.enable_tiling()
    tiled = _normalized(vae, vae.encode(clip).latent_dist)
    vae.disable_tiling()
    whole = _normalized(vae, vae.encode(clip).latent_dist)
    assert torch.equal(mean, tiled[0]) and torch.equal(std, tiled[1])
    difference = ((mean - whole[0]).abs().mean() / whole[0].abs().mean()).item()
    assert 0 < difference < apart

    vae.enable_tiling()
    at_tiled = _normalized(vae, vae.encode(image.unsqueeze(2)).latent_dist)[0]
    vae.disable_tiling()
    assert torch.equal(at, _normalized(vae, vae.encode(image.unsqueeze(2)).latent_dist)[0])
    assert not torch.equal(at, at_tiled)  # the VAE would have tiled it
