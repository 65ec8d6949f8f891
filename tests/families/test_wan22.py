"""Wan 2.2: the T2V A14B trains one of its two experts a run (``model.expert``), every sample's
noise level drawn in that expert's range (the pipeline's boundary_ratio), its LoRA on that
expert's transformer as WanPipeline loads it; the TI2V-5B caches its 48-channel latents at 1/16
as its pipeline decodes them and its loss is the pipeline's conditioning (one timestep a token)
in a hand-written flow step; `raytuner check` refuses an expert family without an expert."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from raytuner.cli import main
from raytuner.config import FlowObjective, LoraConfig, load_job
from raytuner.families import FAMILIES, get_family
from raytuner.families.parts import Source
from raytuner.train.model import adapt

TINY = Source("tiny")
A14B, TI2V = FAMILIES["wan22"], FAMILIES["wan22-5b"]
CAPTIONS = ["a red circle", "a much longer caption: a blue square on a grey ground"]
N = 256  # samples drawn to check where their noise levels fall


@pytest.fixture(scope="module")
def a14b_pipe():
    return A14B.pipeline(TINY)


def _draw(family, objective: FlowObjective, n: int = N) -> torch.Tensor:
    loss = family.loss(TINY, objective)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    return loss.draw((n, 16, 1, 4, 4), gens)["sigma"]


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_each_expert_draws_timesteps_in_the_range_its_pipeline_hands_it(a14b_pipe, sampling):
    """The pipeline runs ``transformer`` at timesteps >= boundary_ratio x 1000 (875) and
    ``transformer_2`` below: the high expert's drawn timesteps (sigma x 1000) are all >= 875,
    the low one's all below, and both are the family's density cut to the range (a level the
    full-range draw keeps is kept as it is)."""
    boundary = a14b_pipe.config.boundary_ratio * a14b_pipe.scheduler.config.num_train_timesteps
    assert boundary == 875
    objective = FlowObjective(resolution_shift=False, shift=3.0, timestep_sampling=sampling)
    full = _draw(A14B, objective) * 1000
    high = _draw(get_family("wan22", "high"), objective) * 1000
    low = _draw(get_family("wan22", "low"), objective) * 1000
    assert (high >= boundary).all() and (high <= 1000).all()
    assert (low < boundary).all() and (low > 0).all()
    assert (full < boundary).any() and (full >= boundary).any()  # the uncut draw spans both
    # each sample's first draw, when in range, is its level: the same generator, cut
    torch.testing.assert_close(high[full >= boundary], full[full >= boundary])
    torch.testing.assert_close(low[full < boundary], full[full < boundary])


def test_a_wan_2_1_draw_is_unchanged_by_the_expert_ranges():
    """A family of one denoiser draws over all levels: shift x u / (1 + (shift - 1) u) of each
    sample's uniform draw, after its noise, from its own generator."""
    objective = FlowObjective(resolution_shift=False, shift=3.0, timestep_sampling="uniform")
    sigmas = _draw(FAMILIES["wan"], objective, n=8)
    expected = []
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        torch.randn((16, 1, 4, 4), generator=g)
        u = torch.rand(1, generator=g).clamp(1e-3, 1 - 1e-3)
        expected.append(3.0 * u / (1 + 2.0 * u))
    torch.testing.assert_close(sigmas, torch.cat(expected))


def test_the_low_expert_trains_transformer_2_and_its_loss_is_a_flow_step_on_it(a14b_pipe):
    """model.expert = "low": the denoiser is the pipeline's transformer_2 (its weights, not
    transformer's), and the loss is x_t = (1 - s) x0 + s noise through it at timestep 1000 s
    with the caption zero-padded to the pipeline's length, against noise - x0."""
    low = get_family("wan22", "low")
    model = low.denoiser(TINY)
    theirs = a14b_pipe.transformer_2.state_dict()
    for key, ours in model.state_dict().items():
        torch.testing.assert_close(ours, theirs[key])
    assert not torch.equal(
        model.proj_out.weight, a14b_pipe.transformer.proj_out.weight
    )  # two experts, two sets of weights
    pixels = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x0, _ = low.image_encoder(TINY, "cpu")(pixels)
    text = low.text_encoder(TINY, "cpu")(CAPTIONS)["prompt_embeds"]
    objective = FlowObjective(resolution_shift=False, shift=3.0)
    loss = low.loss(TINY, objective)
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(2)])
    ours = loss(model, {"latent": x0, "prompt_embeds": text, **drawn})
    noise, sigmas = drawn["noise"], drawn["sigma"]
    assert (sigmas < 0.875).all()
    s = sigmas.view(-1, *[1] * (x0.ndim - 1))
    full = torch.nn.functional.pad(text, (0, 0, 0, 64 - text.shape[1]))  # the tokenizer's 64
    clip = (lambda t: t) if x0.ndim == 5 else (lambda t: t.unsqueeze(2))  # [B, C, T, h, w]
    with torch.no_grad():
        noisy = (1 - s) * x0 + s * noise
        pred = a14b_pipe.transformer_2(clip(noisy), sigmas * 1000, full, return_dict=False)[0]
        theirs = ((pred - clip(noise - x0)) ** 2).reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)


def _exported_low_expert_lora(folder):
    """The tiny low expert with a LoRA of random values, exported to ``folder``: (its family,
    its denoiser, the trained weights)."""
    low = get_family("wan22", "low")
    model = low.denoiser(TINY)
    weights = adapt(model, mode="lora", lora=LoraConfig(rank=4, alpha=4.0),
                    targets=low.adapters.targets, ema_decay=0)  # fmt: skip
    for p in weights.params:
        torch.nn.init.normal_(p, std=0.1)
    weights.export_lora(str(folder), low, {"raytuner.family": "wan22"})
    return low, model, weights


def test_the_low_experts_lora_loads_into_transformer_2_alone(a14b_pipe, tmp_path):
    """Its LoRA file is diffusers' layout under ``transformer.`` (the only part WanPipeline
    saves) and loads, with the family's ``lora_load`` (load_into_transformer_2), into the
    low-noise transformer: transformer_2 changes, transformer stays as it was."""
    low, model, weights = _exported_low_expert_lora(tmp_path)
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert all(k.startswith("transformer.blocks.") for k in keys)
    pipe = A14B.pipeline(TINY)
    high_before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(tmp_path / "lora"), **low.lora_load)
    assert low.lora_load == {"load_into_transformer_2": True}
    assert any("lora" in k for k in pipe.transformer_2.state_dict())
    assert not any("lora" in k for k in pipe.transformer.state_dict())
    assert all(torch.equal(v, high_before[k]) for k, v in pipe.transformer.state_dict().items())


JOB = """
[model]
family = "wan22"
{expert}
[data]
images = "{images}"
cache = "{root}/cache"
[train]
output = "{root}/runs"
"""


def test_check_refuses_a14b_without_an_expert_and_names_each_run_after_its_expert(
    tmp_path, capsys
):
    images = tmp_path / "images"
    images.mkdir()
    from PIL import Image

    Image.new("RGB", (64, 64)).save(images / "a.png")
    job = tmp_path / "a14b.toml"
    job.write_text(JOB.format(expert="", images=images, root=tmp_path))
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err
    assert "model.expert = ''" in err and "'high'" in err and "'low'" in err
    job.write_text(JOB.format(expert='expert = "low"', images=images, root=tmp_path))
    assert load_job(job).train.name == "a14b-low"  # the two runs' LoRA files apart
    assert main(["check", str(job)]) == 0
    capsys.readouterr()
    wan = tmp_path / "wan.toml"
    wan.write_text(JOB.format(expert='expert = "low"', images=images, root=tmp_path)
                   .replace('"wan22"', '"wan"'))  # fmt: skip
    assert main(["check", str(wan)]) == 2
    assert "wan has one denoiser; leave model.expert out" in capsys.readouterr().err


@pytest.fixture(scope="module")
def ti2v_pipe():
    return TI2V.pipeline(TINY)


def test_ti2v_latent_is_48_channels_at_1_16_as_its_pipeline_decodes_them(ti2v_pipe):
    """WanPipeline (expand_timesteps) decodes latents / (1 / latents_std) + latents_mean with
    the 48 values of its VAE's config; sides are multiples of 32 (16 x 2x2 patches)."""
    assert ti2v_pipe.config.expand_timesteps and ti2v_pipe.vae_scale_factor_spatial == 16
    assert TI2V.geometry.pixel_multiple == 32
    pixels = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latent, std = TI2V.image_encoder(TINY, "cpu")(pixels)
    clip = latent if latent.ndim == 5 else latent.unsqueeze(2)
    assert clip.shape == (2, 48, 1, 4, 6)
    assert TI2V.cache_shapes(96, 64)["latent"][0] == 48
    assert TI2V.cache_shapes(96, 64)["latent"][-2:] == (4, 6)
    config = ti2v_pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    direct = ti2v_pipe.vae.encode(pixels.unsqueeze(2)).latent_dist.mean
    torch.testing.assert_close(clip / inv_std + mean, direct, rtol=1e-5, atol=1e-5)


def test_ti2v_loss_is_a_flow_step_with_the_pipelines_timestep_per_token(ti2v_pipe):
    """The 5B pipeline hands the transformer a timestep per token ([B, T x h/2 x w/2], all the
    step's); the loss's one timestep a sample gives the same prediction."""
    pixels = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(2)) * 2 - 1
    x0, _ = TI2V.image_encoder(TINY, "cpu")(pixels)
    text = TI2V.text_encoder(TINY, "cpu")(CAPTIONS)["prompt_embeds"]
    model = TI2V.denoiser(TINY)
    loss = TI2V.loss(TINY, FlowObjective(resolution_shift=False, shift=5.0))
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(2)])
    ours = loss(model, {"latent": x0, "prompt_embeds": text, **drawn})
    clip = (lambda t: t) if x0.ndim == 5 else (lambda t: t.unsqueeze(2))
    noise, sigmas = clip(drawn["noise"]), drawn["sigma"]
    x = clip(x0)
    s = sigmas.view(-1, 1, 1, 1, 1)
    noisy = (1 - s) * x + s * noise
    tokens = math.prod((x.shape[2], x.shape[3] // 2, x.shape[4] // 2))
    per_token = (sigmas * 1000)[:, None].expand(-1, tokens)  # as expand_timesteps makes it
    full = torch.nn.functional.pad(text, (0, 0, 0, 64 - text.shape[1]))
    with torch.no_grad():
        pred = model(noisy, per_token, full, return_dict=False)[0]
    theirs = ((pred - (noise - x)) ** 2).reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs, rtol=1e-4, atol=1e-5)


def test_ti2v_first_frame_kept_clean_is_its_image_to_video_pipelines_conditioning(ti2v_pipe):
    """``first_frame_p``: a clip's first latent frame clean and its patches at timestep 0, as
    WanImageToVideoPipeline (``expand_timesteps``) conditions the 5B on an image, and out of the
    loss, the mean over the other frames."""
    clip = torch.rand(2, 3, 9, 64, 96, generator=torch.Generator().manual_seed(3)) * 2 - 1
    x0, _ = TI2V.image_encoder(TINY, "cpu")(clip)  # [2, 48, 3, 4, 6]
    text = TI2V.text_encoder(TINY, "cpu")(CAPTIONS)["prompt_embeds"]
    model = TI2V.denoiser(TINY)
    loss = TI2V.loss(TINY, FlowObjective(resolution_shift=False, shift=5.0, first_frame_p=1.0))
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(2)])
    assert drawn["first_frame"].tolist() == [1.0, 1.0]
    ours = loss(model, {"latent": x0, "prompt_embeds": text, **drawn})
    noise, s = drawn["noise"], drawn["sigma"].view(-1, 1, 1, 1, 1)
    mask = torch.ones_like(x0)
    mask[:, :, 0] = 0  # the pipeline's first_frame_mask
    noisy = (1 - mask) * x0 + mask * ((1 - s) * x0 + s * noise)
    per_token = torch.stack([(mask[0, 0, :, ::2, ::2] * t).flatten() for t in s.flatten() * 1000])
    full = torch.nn.functional.pad(text, (0, 0, 0, 64 - text.shape[1]))
    with torch.no_grad():
        pred = model(noisy, per_token, full, return_dict=False)[0]
    theirs = ((pred - (noise - x0)) ** 2)[:, :, 1:].reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs, rtol=1e-4, atol=1e-5)


def test_full_size_presets_count_the_released_parameters():
    """The released transformers built on meta from the package's configs (diffusers' count):
    Wan 2.1 1.3B, each A14B expert, TI2V-5B."""
    from raytuner.families.parts import preset

    def count(family: str, preset_name: str, part: str = "transformer") -> int:
        from diffusers import WanTransformer3DModel

        with torch.device("meta"):
            model = WanTransformer3DModel(**preset(family, preset_name)[part]["config"])
        return sum(p.numel() for p in model.parameters())

    assert count("wan", "random-1.3b") == 1_418_996_800
    assert count("wan22", "random") == count("wan22", "random", "transformer_2")
    assert count("wan22", "random") == 14_288_491_584
    assert count("wan22-5b", "random") == 4_999_787_712
    repos = json.loads((Path(__file__).resolve().parents[2] / "raytuner" / "families"
                        / "configs" / "wan22-5b.random.json").read_text())["_repos"]  # fmt: skip
    assert repos == ["Wan-AI/Wan2.2-TI2V-5B-Diffusers"]


def test_init_from_reads_the_low_experts_files_back_into_transformer_2(tmp_path):
    """lora.init_from of a low-noise run's files (its diffusers file under ``transformer.``,
    its Wan-named file) starts transformer_2's LoRA from the same values."""
    from safetensors.torch import load_file

    from raytuner.checkpoint.layout import DIFFUSERS_FILE, KOHYA_FILE
    from raytuner.lora.init_from import file_modules

    low, model, weights = _exported_low_expert_lora(tmp_path)
    state = weights.state()
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        found = file_modules(load_file(tmp_path / "lora" / name), {}, low, model)
        assert len(found) == 3 * 8, name
        for module, (down, up, _) in found.items():
            torch.testing.assert_close(down, state[f"{module}.lora_A.weight"].to(down.dtype))
            torch.testing.assert_close(up, state[f"{module}.lora_B.weight"].to(up.dtype))


@pytest.mark.slow
def test_a_sharded_low_expert_lora_trains_what_one_process_trains(tmp_path):
    """The low-noise expert (transformer_2) sharded over two gloo workers (fsdp) ends where one
    process on the whole batch does, its noise levels drawn in its range on each rank."""
    from sharded_lora import assert_sharded_lora_matches

    assert_sharded_lora_matches("wan22:low", tmp_path)


@pytest.mark.slow
def test_both_experts_sharded_train_the_lora_one_process_trains(tmp_path):
    """Both experts in turn (``model.expert = "both"``) sharded over two gloo workers: each
    expert's blocks are units of their own, each expert's weights read from its own part's
    files, and three steps (high, low, high) end where one process on the whole batch does."""
    from sharded_lora import assert_sharded_lora_matches

    assert_sharded_lora_matches("wan22:both", tmp_path)
