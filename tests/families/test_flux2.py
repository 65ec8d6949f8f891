"""The FLUX.2 families ([klein]: flux2-klein, [dev]: flux2-dev): the cache holds what the
pipelines' own encoders make (the stacked hidden states of three LLM layers over all 512 tokens
of the chat-templated caption; the VAE's mode patchified 2x2 and normalised by its BatchNorm
running stats), the loss is a step of diffusers' train_dreambooth_lora_flux2(_klein).py, the
LoRA loads through the pipeline, and `raytuner check` refuses what the families cannot do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from run_checks import cached_folder, lora_changes_the_pipeline
from sharded_lora import assert_sharded_lora_matches
from test_jobcheck import refused

from raytuner.config import FlowObjective, LoraConfig
from raytuner.families import FAMILIES, flux2
from raytuner.families.parts import Source, preset_names
from raytuner.train.model import adapt

TINY = Source("tiny")
NAMES = ("flux2-klein", "flux2-dev")
CAPTIONS = ["a red circle", "a much longer caption: a blue square on a grey ground", ""]


@pytest.fixture(scope="module", params=NAMES)
def fam(request):
    family = FAMILIES[request.param]
    return family, family.pipeline(TINY)


def _direct_text(family, pipe) -> torch.Tensor:
    embeds, _ = pipe.encode_prompt(
        list(CAPTIONS), device=torch.device("cpu"), **family.pipeline_options(pipe)
    )
    return embeds


def test_cached_text_is_the_pipelines_encode_prompt_every_row(fam):
    family, pipe = fam
    text = family.text_encoder(TINY, "cpu")(CAPTIONS)["prompt_embeds"]
    length = family.pipeline_options(pipe)["max_sequence_length"]
    assert text.shape == (3, length, 3 * 16)  # every token, three layers of a 16-wide LLM
    torch.testing.assert_close(text, _direct_text(family, pipe), rtol=0, atol=0)
    if family.name == "flux2-klein":
        # right padding: Qwen3's pad rows attend the caption, so they differ between captions
        # (what the transformer, which has no text mask, reads): every row is stored
        assert not torch.allclose(text[0, -1], text[1, -1])
    else:  # left padding, after the pipeline's system prompt
        ids = pipe.tokenizer(["x"], padding="max_length", max_length=length).input_ids[0]
        assert ids[0] == pipe.tokenizer.pad_token_id


def test_cached_latent_is_the_pipelines_encode_with_the_batchnorm_stats(fam):
    family, pipe = fam
    vae = pipe.vae
    gen = torch.Generator().manual_seed(3)
    vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=gen))
    vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=gen) + 0.5)
    pixels = torch.rand(2, 3, 64, 96, generator=gen) * 2 - 1
    latent, std = flux2.image_encoder(vae, "cpu")(pixels)
    assert latent.shape == std.shape == (2, 16, 4, 6)  # 4 channels x 2x2 at 1/16
    torch.testing.assert_close(latent, pipe._encode_vae_image(pixels, generator=None))
    # the family's own VAE (the preset's stats: 0 and 1) makes the unnormalised patches
    plain, _ = family.image_encoder(TINY, "cpu")(pixels)
    assert not torch.allclose(plain, latent)
    vae.bn.running_mean.zero_(), vae.bn.running_var.fill_(1.0)


@pytest.mark.parametrize("guidance", [1.0, 3.5])
def test_the_loss_is_a_step_of_diffusers_flux2_script(fam, guidance):
    """Same noise and levels: x_t = (1 - s) x0 + s noise, packed, the transformer at
    timestep s with the pipeline's ids (and guidance for [dev]), unpacked by ids, against
    noise - x0; the resolution shift's tokens are the 1/16 latent's pixels."""
    from diffusers import Flux2Pipeline

    family, pipe = fam
    model = family.denoiser(TINY)
    objective = FlowObjective(timestep_sampling="uniform", guidance=guidance)
    if family.name == "flux2-klein" and guidance != 1.0:
        pytest.skip("[klein] has no guidance embedding")
    loss = family.loss(TINY, objective)
    x0 = torch.randn(3, 16, 4, 6, generator=torch.Generator().manual_seed(1))
    text = _direct_text(family, pipe)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    drawn = loss.draw(tuple(x0.shape), gens)
    ours = loss(model, {"latent": x0, "prompt_embeds": text, **drawn})

    noise, sigmas = drawn["noise"], drawn["sigma"]
    s = sigmas[:, None, None, None]
    noisy = (1.0 - s) * x0 + s * noise
    img_ids = Flux2Pipeline._prepare_latent_ids(noisy)
    g = torch.full((3,), guidance) if family.guidance.embedding else None
    with torch.no_grad():
        out = model(
            hidden_states=Flux2Pipeline._pack_latents(noisy),
            timestep=sigmas * 1000 / 1000,
            guidance=g,
            encoder_hidden_states=text,
            txt_ids=Flux2Pipeline._prepare_text_ids(text),
            img_ids=img_ids,
            return_dict=False,
        )[0]
    pred = Flux2Pipeline._unpack_latents_with_ids(out, img_ids)  # [B, C, h, w], by the ids
    theirs = ((pred.float() - (noise - x0).float()) ** 2).reshape(3, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    # the shift: Flux.1's line at 4 x 6 = 24 tokens, the same draws unshifted and shifted
    mu = 0.5 + (24 - 256) * (1.15 - 0.5) / (4096 - 256)
    fixed = FlowObjective(timestep_sampling="uniform", resolution_shift=False, shift=np.exp(mu))
    again = family.loss(TINY, fixed).draw(
        tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(3)]
    )
    torch.testing.assert_close(again["sigma"], sigmas)


def test_a_trained_lora_loads_into_the_pipeline_and_changes_the_image(fam, tmp_path):
    family, _ = fam
    model = family.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(model, mode="lora", lora=lora, targets=family.adapters.targets, ema_decay=0)
    names = [n.split(".lora_B")[0] for n in weights.names if "lora_B" in n]
    # diffusers' targets: the double blocks' q, k, v, out; the single blocks' fused input, out
    assert len(names) == 2 * 4 + 2 * 2
    assert "single_transformer_blocks.1.attn.to_out" in names
    assert "single_transformer_blocks.0.attn.to_qkv_mlp_proj" in names
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss = family.loss(TINY, FlowObjective())
    gen = torch.Generator().manual_seed(0)
    batch = {
        "latent": torch.randn(2, 16, 4, 4, generator=gen),
        "prompt_embeds": family.text_encoder(TINY, "cpu")(CAPTIONS[:2])["prompt_embeds"],
    }
    for _ in range(3):
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        loss(model, batch, gens).mean().backward()
        opt.step(), opt.zero_grad()
    config = model.peft_config["default"].to_dict()
    family.save_lora(str(tmp_path / "lora"), weights.state(), config)
    assert lora_changes_the_pipeline(str(tmp_path / "lora"), family.name)


def test_the_tiny_pipeline_renders(fam):
    family, pipe = fam
    image = pipe(
        prompt="a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
        generator=torch.Generator().manual_seed(0), **family.pipeline_options(pipe),
    ).images  # fmt: skip
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


def test_a_distilled_klein_renders_in_its_four_steps_unless_the_line_says():
    """A step-distilled release (the pipeline's is_distilled) renders in 4 steps by default
    (validation.distilled = "auto"); a render's own steps win (``raytuner sample --steps``, a
    prompt line's ``--s``)."""
    from raytuner.render.prompts import Defaults, PromptLine, is_distilled, resolve
    from raytuner.render.sample import render

    family = FAMILIES["flux2-klein"]
    pipe = family.pipeline(TINY)
    assert not is_distilled(family, pipe, "tiny", "auto")  # the base model: its own 50
    pipe.register_to_config(is_distilled=True)
    assert is_distilled(family, pipe, "tiny", "auto")
    defaults = Defaults(size=(64, 64), seeds=(0,), steps=None)
    for steps, ran in ((None, 4), (2, 2)):
        lines = [PromptLine(prompt="a red circle", steps=steps)]
        (r,) = resolve(lines, family, defaults, distilled=True)
        assert r.guidance_scale == 1.0
        (row,) = render(pipe, family.pipeline_options(pipe), [r])
        assert len(pipe.scheduler.timesteps) == ran and row[0].size == (64, 64)


def test_klein_ships_its_9b_size_as_a_preset():
    assert preset_names("flux2-klein") == ("tiny", "random", "random-9b")
    assert preset_names("flux2-dev") == ("tiny", "random")
    assert Source("random-9b").preset == "random-9b" and Source("random-9b").full_size


@pytest.mark.parametrize(
    ("family", "setting", "says"),
    [
        ("flux2-klein", "preprocess.bucket_step=8", "multiples of 16 pixels"),
        ("flux2-dev", "lora.text_encoder=true", "lora.text_encoder = true"),
        ("flux2-dev", 'model.pretrained="random-9b"', "its presets: tiny, random"),
        ("flux2-klein", "objective.flow.guidance=3.5", "objective.flow.guidance"),
    ],
)
def test_check_refuses_what_flux2_cannot_do(tmp_path, capsys, family, setting, says):
    err = refused(tmp_path, capsys, setting, family=family)  # `raytuner check`, exit 2
    assert says in err, err


def _known_lora(family, rank: int = 2):
    """A LoRA of the tiny preset on the default targets, its B not zero (one that does
    something), as a run starts it."""
    from raytuner.config import ModelConfig, TrainConfig
    from raytuner.train.model import trainable_model

    model, train = ModelConfig(family=family.name), TrainConfig(output="unused")
    lora = LoraConfig(rank=rank, alpha=float(rank))
    weights = trainable_model(model, train, lora, family, torch.device("cpu")).weights
    for p in weights.params:
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    return weights


def _image_with(pipe, lora_path) -> np.ndarray:
    from run_checks import pipeline_image

    pipe.load_lora_weights(str(lora_path))
    try:
        return pipeline_image(pipe)
    finally:
        pipe.unload_lora_weights()


def test_the_kohya_file_in_bfl_names_loads_as_the_diffusers_file_and_init_from_reads_it(
    fam, tmp_path
):
    """The export's lora_kohya.safetensors names BFL's linears (double blocks' fused qkv at
    rank 3r, single blocks' linear1 / linear2, with alpha keys: what ComfyUI and musubi-tuner
    read); diffusers' FLUX.2 loader gives the diffusers file's image with it; lora.init_from
    starts the same LoRA from it and from ai-toolkit's layout (the same names under
    ``diffusion_model.`` as lora_A / lora_B, no alpha)."""
    from safetensors.torch import load_file, save_file

    from raytuner.config import ModelConfig, TrainConfig
    from raytuner.train.model import trainable_model

    family, pipe = fam
    known = _known_lora(family)
    known.export_lora(str(tmp_path / "own"), family, {})
    kohya = load_file(tmp_path / "own" / "lora" / "lora_kohya.safetensors")
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    assert kohya[f"{qkv}.lora_down.weight"].shape[0] == 3 * 2
    assert float(kohya[f"{qkv}.alpha"]) == 3 * 2.0
    assert {
        "lora_unet_single_blocks_1_linear1.alpha",
        "lora_unet_single_blocks_1_linear2.alpha",
    } <= set(kohya)
    assert "lora_unet_single_blocks_1_linear2.lora_up.weight" in kohya
    own = _image_with(pipe, tmp_path / "own" / "lora" / "pytorch_lora_weights.safetensors")
    np.testing.assert_allclose(
        _image_with(pipe, tmp_path / "own" / "lora" / "lora_kohya.safetensors"), own, atol=1e-5
    )
    aitk = {}
    for key, value in kohya.items():
        name, _, end = key.partition(".")
        if end == "alpha":
            continue
        bfl = name.removeprefix("lora_unet_")
        for flat, dotted in (
            ("double_blocks_", "double_blocks."),
            ("single_blocks_", "single_blocks."),
        ):
            if bfl.startswith(flat):
                index, _, rest = bfl.removeprefix(flat).partition("_")
                rest = rest.replace("attn_", "attn.").replace("mlp_", "mlp.")
                bfl = f"{dotted}{index}.{rest}"
        end = end.replace("lora_down", "lora_A").replace("lora_up", "lora_B")
        aitk[f"diffusion_model.{bfl}.{end}"] = value
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in aitk
    (tmp_path / "aitk").mkdir()
    save_file(aitk, str(tmp_path / "aitk" / "lora.safetensors"))
    state = known.state()
    for path in (tmp_path / "own" / "lora" / "lora_kohya.safetensors",
                 tmp_path / "aitk" / "lora.safetensors"):  # fmt: skip
        model, train = ModelConfig(family=family.name), TrainConfig(output="unused")
        lora = LoraConfig(rank=2, alpha=2.0, init_from=str(path))
        start = trainable_model(model, train, lora, family, torch.device("cpu")).weights.state()
        assert start.keys() == state.keys()
        for key in state:
            torch.testing.assert_close(start[key], state[key], msg=f"{path.parent.name}: {key}")
    np.testing.assert_allclose(_image_with(pipe, tmp_path / "aitk" / "lora.safetensors"), own,
                               atol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_ray_data_caches_the_pipelines_encodings_of_a_klein_folder(ray_local, tmp_path):
    """Preprocessed by Ray Data from a diffusers folder (the tiny [klein] saved): each row's
    text is the folder's pipeline's encode_prompt of its caption (all 512 rows, here the tiny
    tokenizer's 96), its latent the 2x2-patchified 1/16 grid."""
    from diffusers import Flux2KleinPipeline

    with cached_folder("flux2-klein", tmp_path) as (data, captions, folder):
        pipe = Flux2KleinPipeline.from_pretrained(folder)
        options = FAMILIES["flux2-klein"].pipeline_options(pipe)
        direct, _ = pipe.encode_prompt(list(captions), device=torch.device("cpu"), **options)
        for i, own in enumerate(direct):
            row = data.batch([i])
            assert row["prompt_embeds"][0].shape == own.shape == (96, 48)  # every row stored
            torch.testing.assert_close(row["prompt_embeds"][0], own.bfloat16().float())
            assert row["latent"].shape[1] == 16  # 4 channels x 2 x 2, at 1/16 of the bucket


@pytest.mark.slow
def test_a_sharded_lora_trains_what_one_process_trains(tmp_path):
    """Two sharded gloo workers (FSDP2 units: the double and single blocks; [dev]'s guidance
    embedding) end where one process on the whole batch does."""
    assert_sharded_lora_matches("flux2-dev", tmp_path)


@pytest.mark.parametrize(
    ("name", "preset", "transformer", "text_encoder"),
    [
        ("flux2-klein", "random", 3_875_544_576, 4_022_468_096),
        ("flux2-klein", "random-9b", 9_078_581_248, 8_190_735_360),
        ("flux2-dev", "random", 32_223_281_152, 23_340_272_640),
    ],
)
def test_the_full_size_presets_count_the_released_parameters(
    name, preset, transformer, text_encoder
):
    """Built on the meta device from the package's configs (no download): the released
    transformers' and text encoders' parameter counts, exactly."""
    family, source = FAMILIES[name], Source(preset, dtype=torch.bfloat16)
    for part, count in (("transformer", transformer), ("text_encoder", text_encoder)):
        model = family.part(source, part, "meta", weights=False)
        assert sum(p.numel() for p in model.parameters()) == count, part
