"""The Qwen-Image family: its cache holds what QwenImagePipeline's own encoders make
(Qwen2.5-VL's last hidden states of the caption's own tokens after the template's prefix, and
its mask; latents of the 3-D VAE's one frame, normalized per channel), its loss is a step of
diffusers' train_dreambooth_lora_qwen_image.py, its noise levels shift on Qwen-Image's own line,
its LoRA loads through the pipeline, validation guides with true_cfg_scale, and `raytuner plan`
builds the released 20.43 B transformer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from run_checks import (
    assert_other_trainers_layouts_start_the_lora,
    cached_folder,
    pipeline_image,
    pipeline_image_with,
)
from sharded_lora import assert_sharded_lora_matches

from raytuner.config import FlowObjective, LoraConfig
from raytuner.data.tensors import ragged_cell_column, stacked
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.families.qwen_image import prefix_tokens, text_mask
from raytuner.train.model import adapt

TINY = Source("tiny")
QI = FAMILIES["qwen-image"]
CAPTIONS = ["a red circle", "a much longer caption: a blue square on a grey ground", ""]
WIDTH = 16  # the tiny text encoder's hidden size


@pytest.fixture(scope="module")
def pipe():
    return QI.pipeline(TINY)


@pytest.fixture(scope="module")
def batch(pipe) -> dict[str, torch.Tensor]:
    pixels = torch.rand(3, 3, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latent, std = QI.image_encoder(TINY, "cpu")(pixels)
    assert latent.shape == std.shape == (3, 16, 8, 12)  # 16 channels at 1/8, the frame dropped
    return {"latent": latent, "pixels": pixels, **QI.text_encoder(TINY, "cpu")(CAPTIONS)}


def _direct_text(pipe, captions=CAPTIONS):
    """The pipeline's own encode_prompt: embeds [B, L, D] and its mask (or None)."""
    options = QI.pipeline_options(pipe)
    return pipe.encode_prompt(list(captions), device=torch.device("cpu"), **options)


def test_cached_text_is_the_pipelines_encode_prompt_and_its_mask_the_rows_kept(pipe, batch):
    embeds, mask = _direct_text(pipe)
    text = batch["prompt_embeds"]
    torch.testing.assert_close(text, embeds, rtol=0, atol=0)
    lengths = mask.sum(dim=1).tolist()
    assert lengths[1] > lengths[0] > lengths[2] > 0  # the template's closing tokens are kept
    # the loss's mask, rebuilt from the rows the cache kept, is the pipeline's
    assert torch.equal(text_mask(text), mask)
    assert text_mask(text[1:2]) is None  # one caption fills its batch: the pipeline's None
    # the cache stores each caption's rows alone (2 bytes a value in bfloat16) and the feed
    # pads them back to the batch's longest with zero rows
    cells, shapes, _ = ragged_cell_column(text, "bfloat16")
    assert shapes == [[n, WIDTH] for n in lengths]
    assert [len(c.as_py()) for c in cells] == [n * WIDTH * 2 for n in lengths]
    read = [
        torch.frombuffer(bytearray(c.as_py()), dtype=torch.bfloat16).view(*s)
        for c, s in zip(cells, shapes, strict=True)
    ]
    torch.testing.assert_close(stacked(read, torch.float32), text.bfloat16().float())


def test_the_template_prefix_dropped_is_the_tokenizers_own(pipe):
    """The pipeline's 34 counts the released tokenizer's prefix tokens; the preset's byte-level
    tokenizer (and a folder saved from it: the slow cache test) writes the prefix in more, and
    the rows kept start at the caption's first token: the last hidden states of the templated
    caption from there on."""
    assert pipe.prompt_template_encode_start_idx == prefix_tokens(pipe) > 34
    caption = "a red circle"
    ids = pipe.tokenizer(pipe.prompt_template_encode.format(caption), return_tensors="pt")
    drop = pipe.prompt_template_encode_start_idx
    assert pipe.tokenizer.decode(ids.input_ids[0, drop:]).startswith(caption + "<|im_end|>")
    with torch.no_grad():
        hidden = pipe.text_encoder(input_ids=ids.input_ids, output_hidden_states=True)
    embeds, _ = _direct_text(pipe, [caption])
    torch.testing.assert_close(embeds[0], hidden.hidden_states[-1][0, drop:])


def test_cached_latent_is_what_the_pipeline_decodes(pipe, batch):
    """The pipeline decodes latent x latents_std + latents_mean of one frame: the cache holds
    the VAE's mean of the image as a one-frame video put through the inverse, as the
    diffusers training script normalizes it."""
    mean = pipe.vae.encode(batch["pixels"].unsqueeze(2)).latent_dist.mean
    config = pipe.vae.config
    std = torch.tensor(config.latents_std).view(1, 16, 1, 1, 1)
    shift = torch.tensor(config.latents_mean).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(batch["latent"].unsqueeze(2) * std + shift, mean)
    assert config.latents_std[0] == 2.8184  # the released per-channel statistics


def test_the_loss_is_a_step_of_diffusers_qwen_image_script(pipe, batch):
    """Same noise and noise levels: x_t = (1 - s) x0 + s noise as a one-frame video, packed
    2x2, the transformer at timestep s with the pipeline's mask and img_shapes, against
    noise - x0."""
    from diffusers import QwenImagePipeline

    model = QI.denoiser(TINY)
    objective = FlowObjective(resolution_shift=False, timestep_sampling="uniform")
    loss = QI.loss(TINY, objective)
    x0 = batch["latent"]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    drawn = loss.draw(tuple(x0.shape), gens)
    ours = loss(model, {"latent": x0, "prompt_embeds": batch["prompt_embeds"], **drawn})

    embeds, mask = _direct_text(pipe)
    noise, sigmas = drawn["noise"].unsqueeze(2), drawn["sigma"]
    video = x0.unsqueeze(2)  # [B, C, 1, H, W]
    s = sigmas[:, None, None, None, None]
    noisy = ((1.0 - s) * video + s * noise).permute(0, 2, 1, 3, 4)
    b, c, _, h, w = video.shape
    packed = QwenImagePipeline._pack_latents(noisy, b, c, h, w)
    with torch.no_grad():
        out = model(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=sigmas * 1000 / 1000,
            img_shapes=[(1, h // 2, w // 2)] * b,
            return_dict=False,
        )[0]
    pred = QwenImagePipeline._unpack_latents(out, h * 8, w * 8, 8)
    theirs = ((pred.float() - (noise - video).float()) ** 2).reshape(b, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    # without the mask the padded captions' zero rows are attended: another loss
    with torch.no_grad():
        unmasked = model(
            hidden_states=packed, encoder_hidden_states=embeds, timestep=sigmas,
            img_shapes=[(1, h // 2, w // 2)] * b, return_dict=False,
        )[0]  # fmt: skip
    assert not torch.allclose(unmasked[0], out[0])


def test_noise_levels_shift_on_qwen_images_line_not_fluxs():
    """The resolution shift is the scheduler's own line (0.5 at 256 tokens, 0.9 at 8192:
    e^mu = 2.0 at 1024 px), as QwenImagePipeline computes mu; Flux keeps 1.15 at 4096."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    def sigma_at(family, size: int) -> float:
        loss = family.loss(TINY, FlowObjective(timestep_sampling="uniform"))
        shape = (1, 16, size // 8, size // 8)
        sigma = loss.draw(shape, [torch.Generator().manual_seed(3)])["sigma"]
        gen = torch.Generator().manual_seed(3)
        torch.randn(shape[1:], generator=gen)  # the noise first, then the level
        u = torch.rand(1, generator=gen).clamp(1e-3, 1 - 1e-3)
        return float(sigma), float(u)

    sigma, u = sigma_at(QI, 1024)
    shift = float(np.exp(calculate_shift(4096, 256, 8192, 0.5, 0.9)))
    assert shift == pytest.approx(2.0, abs=0.01)
    assert sigma == pytest.approx(shift * u / (1 + (shift - 1) * u), rel=1e-5)
    flux, _ = sigma_at(FAMILIES["flux"], 1024)
    assert flux > sigma  # Flux's line shifts 1024 px further (e^1.15 = 3.16)


def test_a_trained_lora_loads_into_the_qwen_image_pipeline(pipe, batch, tmp_path):
    model = QI.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(model, mode="lora", lora=lora, targets=QI.adapters.targets, ema_decay=0)
    # diffusers' targets: the image stream's attention projections of every block
    names = [n for n in weights.names if "lora_B" in n]
    assert len(names) == 4 * 3 and all(".attn.to_" in n for n in names)
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss = QI.loss(TINY, FlowObjective())
    train = {k: v for k, v in batch.items() if k != "pixels"}
    for _ in range(3):
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        loss(model, train, gens).mean().backward()
        opt.step(), opt.zero_grad()
    QI.save_lora(str(tmp_path / "lora"), weights.state(), model.peft_config["default"].to_dict())

    before, after = pipeline_image(pipe), pipeline_image_with(pipe, tmp_path / "lora")
    assert np.isfinite(after).all() and not np.allclose(before, after)


def test_validation_renders_with_true_cfg_and_a_blank_negative_prompt(pipe):
    """validation.guidance_scale (else 4, the pipeline's) is its true_cfg_scale, which guides
    only with a negative prompt: " " where none is set, none at a scale of 1."""
    from raytuner.render.prompts import Defaults, PromptLine, resolve
    from raytuner.render.sample import render

    defaults = Defaults(size=(64, 64), seeds=(0,), steps=2)
    guided, plain = resolve([PromptLine(prompt="a red circle"), PromptLine(prompt="a", scale=1)],
                            QI, defaults)  # fmt: skip
    assert guided.call() == {"width": 64, "height": 64, "true_cfg_scale": 4.0,
                             "num_inference_steps": 2, "negative_prompt": " "}  # fmt: skip
    assert "negative_prompt" not in plain.call() and "scale_argument" not in guided.record()
    (image,), = render(pipe, QI.pipeline_options(pipe), [guided])  # fmt: skip
    assert image.size == (64, 64)
    unguided = pipe("a red circle", num_inference_steps=2, height=64, width=64, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]  # fmt: skip
    assert not np.allclose(np.asarray(image) / 255, unguided, atol=1 / 255)


@pytest.mark.slow
def test_the_cache_holds_each_captions_own_rows_of_encode_prompt(ray_local, tmp_path):
    """Preprocessed by Ray Data from a diffusers folder: a row read alone is its caption's
    encode_prompt rows, of its own length; rows read together are padded with zero rows and
    their mask is the pipeline's."""
    with cached_folder("qwen-image", tmp_path) as (data, captions, _):
        embeds, mask = _direct_text(QI.pipeline(TINY), captions)
        lengths = mask.sum(dim=1).tolist()
        assert len(set(lengths)) > 1  # captions of several lengths
        for i, n in enumerate(lengths):
            alone = data.batch([i])["prompt_embeds"][0]
            assert alone.shape == (n, WIDTH)  # its tokens alone, no padding stored
            torch.testing.assert_close(alone, embeds[i, :n].bfloat16().float(), rtol=0, atol=0)
        together = data.batch(list(range(len(data))))["prompt_embeds"]
        assert together.shape == embeds.shape
        assert torch.equal(text_mask(together), mask)


@pytest.mark.slow
def test_a_sharded_lora_trains_what_one_process_trains(tmp_path):
    """Captions of several lengths on each rank (each batch padded to its own longest, the
    mask rebuilt from it): two sharded gloo workers end where one process on the whole batch
    does."""
    assert_sharded_lora_matches("qwen-image", tmp_path)


def test_init_from_reads_the_layouts_other_qwen_image_trainers_write(pipe, tmp_path):
    """ai-toolkit's and ComfyUI's (the diffusers names under ``diffusion_model.`` with
    ``.alpha`` keys), musubi-tuner's (kohya's ``lora_unet_`` over the diffusers names) and
    peft's ``.default`` keys: each starts the run from the same LoRA, and diffusers'
    QwenImagePipeline loads each as the same LoRA as raytuner's own file."""
    assert_other_trainers_layouts_start_the_lora("qwen-image", pipe, tmp_path, peft=True)


def test_check_refuses_a_text_encoder_lora_and_sides_off_its_grid(tmp_path, capsys):
    """Qwen2.5-VL is not trained (diffusers' script offers no text-encoder LoRA); bucket sides
    are multiples of 16 (the VAE's 8 x the 2x2 packing)."""
    from test_jobcheck import accepted, refused

    err = refused(tmp_path, capsys, "lora.text_encoder=true", family="qwen-image")
    assert "lora.text_encoder" in err
    err = refused(tmp_path, capsys, "preprocess.bucket_step=8", family="qwen-image")
    assert "preprocess.bucket_step = 8" in err and "16" in err
    accepted(tmp_path, capsys, "preprocess.bucket_step=16", family="qwen-image")


def test_a_full_fine_tunes_checkpoint_renders(pipe, tmp_path):
    """`raytuner sample` and validation of a full fine-tune build the denoiser on meta from its
    checkpoint a block at a time: the rotary tables diffusers keeps outside the state dict come
    from the pipeline's own denoiser, and the render is the trained weights'."""
    import json

    from safetensors.torch import save_file

    from raytuner.checkpoint import layout
    from raytuner.lora.find import ExportedWeights
    from raytuner.render.sample import apply_weights

    trained = QI.denoiser(TINY)
    with torch.no_grad():
        trained.proj_out.bias.add_(0.5)  # a fine-tune that renders otherwise
    (tmp_path / "ckpt").mkdir()
    state = {k: v.contiguous() for k, v in trained.state_dict().items()}
    save_file(state, str(tmp_path / "ckpt" / layout.WEIGHTS))
    (tmp_path / "ckpt" / layout.DENOISER).write_text(json.dumps(dict(trained.config)))
    base, before = pipe.transformer, pipeline_image(pipe)
    try:
        apply_weights(pipe, QI, ExportedWeights("checkpoint", str(tmp_path / "ckpt")), "cpu")
        after = pipeline_image(pipe)
    finally:
        pipe.register_modules(transformer=base)
    assert np.isfinite(after).all() and not np.allclose(before, after)
