"""The LTX-2 family, its video trained: its cache holds the connectors' input features of each
caption's own tokens, from which the loss makes exactly the video context LTX2Pipeline makes
(padded back to the pipeline's length); its latents are the video VAE's, normalized as the
pipeline does; its loss is the transformer's velocity error with the modalities isolated and
one silent audio token, frames placed in time by each sample's own frame rate; its LoRA (the
video attentions) loads through the pipeline in the diffusers layout and in ComfyUI's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from raytuner.checkpoint.layout import DIFFUSERS_FILE, KOHYA_FILE
from raytuner.config import FlowObjective, LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.ltx2 import video_context, video_coords
from raytuner.families.parts import Source
from raytuner.families.text import rows_kept
from raytuner.train.model import adapt

TINY = Source("tiny")
LTX2 = FAMILIES["ltx2"]
CAPTIONS = ["a red circle", "  a much longer caption: a blue square on a grey ground ", ""]
ROWS = 64  # the tiny tokenizer's length: the pipeline's max_sequence_length for it


@pytest.fixture(scope="module")
def pipe():
    return LTX2.pipeline(TINY)


@pytest.fixture(scope="module")
def encoded(pipe) -> dict[str, torch.Tensor]:
    clip = torch.rand(2, 3, 9, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latent, std = LTX2.image_encoder(TINY, "cpu")(clip)
    text = LTX2.text_encoder(TINY, "cpu")(CAPTIONS)
    return {"latent": latent, "std": std, "clip": clip, **text}


def _pipeline_context(pipe, captions):
    """What LTX2Pipeline hands its transformer: the connectors' video and audio contexts of
    the captions padded (left) to its max_sequence_length, and their mask."""
    embeds, mask, _, _ = pipe.encode_prompt(
        list(captions), do_classifier_free_guidance=False, max_sequence_length=ROWS, device="cpu"
    )
    return pipe.connectors(embeds, mask, padding_side="left")


def test_the_cached_features_make_the_pipelines_video_context_exactly(pipe, encoded):
    """Each caption's own rows (its tokens and BOS: the cache stores no padding) give, padded
    back with zero rows to the pipeline's length, the pipeline's video context bit for bit;
    padded only to the batch's longest caption they give another (the connectors' registers
    and positions depend on the length)."""
    features = encoded["text_features"]
    ids = pipe.tokenizer([c.strip() for c in CAPTIONS]).input_ids
    assert rows_kept(features) == [len(i) for i in ids] and features.shape[1] == len(ids[1])
    video, _, mask = _pipeline_context(pipe, CAPTIONS)
    assert mask.all()  # the registers fill every row: the transformer attends to all
    connector = pipe.connectors.video_connector
    with torch.no_grad():
        assert torch.equal(video_context(connector, features, ROWS), video)
        short = video_context(connector, features, 56)  # 8 registers: a multiple of 8
    n = features.shape[1]
    assert not torch.allclose(short[1, :n], video[1, :n])


def test_a_clip_encodes_to_n_plus_1_latent_frames_normalized_as_the_pipeline(pipe, encoded):
    latent, std = encoded["latent"], encoded["std"]
    assert latent.shape == std.shape == (2, 128, 2, 2, 3)  # 9 frames: 2; 1/32 of 64x96
    assert LTX2.cache_shapes(96, 64, frames=9)["latent"] == (128, 2, 2, 3)
    assert LTX2.cache_shapes(768, 512, frames=121)["latent"] == (128, 16, 16, 24)
    assert LTX2.cache_shapes(96, 64)["latent"] == (128, 1, 2, 3)
    vae = pipe.vae
    direct = vae.encode(encoded["clip"]).latent_dist.mean
    back = pipe._denormalize_latents(latent, vae.latents_mean, vae.latents_std)
    torch.testing.assert_close(back, direct, rtol=1e-5, atol=1e-5)
    image, _ = LTX2.image_encoder(TINY, "cpu")(encoded["clip"][:, :, 0])
    assert image.shape == (2, 128, 1, 2, 3)


def _loss_and_direct(pipe, encoded, fps):
    model = LTX2.denoiser(TINY)
    loss = LTX2.loss(TINY, FlowObjective())
    x0 = encoded["latent"]
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(2)])
    text = encoded["text_features"][:2, : max(rows_kept(encoded["text_features"][:2]))]
    ours = loss(model, {"latent": x0, "text_features": text, "fps": fps, **drawn})
    return model, ours, drawn


def test_the_loss_is_the_transformers_velocity_error_with_the_video_isolated(pipe, encoded):
    """Same noise and levels: the pipeline's contexts, its packing, timestep sigma x 1000, the
    modalities isolated; the audio the transformer is given does not change the video."""
    fps = torch.tensor([24.0, 24.0])
    model, ours, drawn = _loss_and_direct(pipe, encoded, fps)
    video, audio, mask = _pipeline_context(pipe, CAPTIONS[:2])
    x0, noise, s = encoded["latent"], drawn["noise"], drawn["sigma"]
    noisy = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise

    def direct(audio_tokens):
        with torch.no_grad():
            out = model(
                hidden_states=pipe._pack_latents(noisy), audio_hidden_states=audio_tokens,
                encoder_hidden_states=video, audio_encoder_hidden_states=audio,
                timestep=s * 1000, audio_timestep=s * 1000, sigma=s * 1000,
                encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                num_frames=2, height=2, width=3, fps=24.0, audio_num_frames=audio_tokens.shape[1],
                isolate_modalities=True, return_dict=False,
            )[0]  # fmt: skip
        return pipe._unpack_latents(out, 2, 2, 3)

    pred = direct(torch.zeros(2, 1, 4))
    theirs = ((pred - (noise - x0)) ** 2).reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    loud = direct(torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(loud, pred)


def test_each_sample_is_placed_in_time_by_its_own_frame_rate(pipe, encoded):
    """The positions are the transformer's own at one rate; a sample at another rate (a
    source sampled at 16 fps beside one at 24) gets another loss, the other sample the same."""
    rope = LTX2.denoiser(TINY).rope
    for rate in (24.0, 16.0):
        mine = video_coords((2, 2, 3), torch.tensor([rate] * 2), (8, 32, 32), 1)
        assert torch.equal(mine, rope.prepare_video_coords(2, 2, 2, 3, "cpu", fps=rate))
    _, same, _ = _loss_and_direct(pipe, encoded, torch.tensor([24.0, 24.0]))
    _, mixed, _ = _loss_and_direct(pipe, encoded, torch.tensor([24.0, 16.0]))
    assert mixed[0] == same[0] and mixed[1] != same[1]


def _trained(encoded):
    model = LTX2.denoiser(TINY)
    lora = LoraConfig(rank=4, alpha=4.0)
    weights = adapt(model, mode="lora", lora=lora, targets=LTX2.adapters.targets, ema_decay=0)
    opt = torch.optim.AdamW(weights.params, lr=1e-2)
    loss = LTX2.loss(TINY, FlowObjective())
    batch = {"latent": encoded["latent"], "text_features": encoded["text_features"][:2],
             "fps": torch.tensor([24.0, 24.0])}  # fmt: skip
    for _ in range(3):
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        loss(model, batch, gens).mean().backward()
        opt.step(), opt.zero_grad()
    return model, weights


def test_a_trained_lora_of_the_video_attentions_loads_and_has_comfyuis_names(encoded, tmp_path):
    """The LoRA is on the video attentions alone (not the audio ones, nor the audio-video
    cross-attention); the diffusers file changes the pipeline's image; the second file holds
    the same matrices under ComfyUI's names (``diffusion_model.`` + the module, with kohya's
    ``lora_down`` / ``lora_up`` / ``alpha``: its generic rule; diffusers' LTX-2 loader reads
    only ``lora`` keys, so diffusers users take the first file)."""
    from run_checks import lora_changes_the_pipeline

    _, weights = _trained(encoded)
    names = [n for n in weights.names if "lora_B" in n]
    assert {n.split(".")[2] for n in names} == {"attn1", "attn2"} and len(names) == 3 * 2 * 4
    weights.export_lora(str(tmp_path), LTX2, {"raytuner.family": "ltx2"})
    folder = tmp_path / "lora"
    assert lora_changes_the_pipeline(str(folder), "ltx2")
    comfy, diffusers = load_file(folder / KOHYA_FILE), load_file(folder / DIFFUSERS_FILE)
    assert len(comfy) == 3 * len(diffusers) // 2
    for key, value in diffusers.items():
        module, kind = key.removeprefix("transformer.").split(".lora_")
        down_up = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}[kind]
        assert torch.equal(comfy[f"diffusion_model.{module}.{down_up}"], value)
        assert comfy[f"diffusion_model.{module}.alpha"] == 4.0


def test_plan_counts_the_released_transformer_and_its_video_tokens():
    """The ``random`` preset is the released LTX-2 (2.0): 18.88 B parameters in its
    transformer; a clip of 121 frames at 768x512 is 6,144 tokens, which shift its noise
    levels by 16 on the pipeline's line."""
    from raytuner.families.ltx2 import SHIFT

    model = LTX2.denoiser(Source("random"), "meta", weights=False)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(18.876e9, rel=1e-3)
    assert SHIFT.shift(16 * 16 * 24) == pytest.approx(16.2, rel=0.01)


def test_clips_of_two_rates_are_cached_and_each_row_reads_its_sources_rate(ray_local, tmp_path):
    """Clips of 8n + 1 frames through the preprocess stream on a real local Ray: a 9-frame
    sample is 2 latent frames of the VAE at 1/32; the training reader gives each row its
    source's rate (24 and 16 frames a second), the loss's ``fps``."""
    from clip_files import clip

    from raytuner.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
    from raytuner.data import cache
    from raytuner.data.reader import open_dataset
    from raytuner.preprocess.job import update_cache

    folders = {}
    for name, rate in (("fast", 24), ("slow", 16)):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "a.mp4").write_bytes(clip(12, rate, size=(96, 64), seed=rate))
        (folders[name] / "a.txt").write_text(f"a clip at {rate} frames a second")
    data = DataConfig(images="", cache=str(tmp_path / "cache"), frames=[9], fps=24.0,
                      sources=[SourceConfig(path=str(folders["fast"])),
                               SourceConfig(path=str(folders["slow"]), fps=16.0)])  # fmt: skip
    model = ModelConfig(family="ltx2", pretrained="tiny")
    pre = PreprocessConfig(resolution=64, bucket_step=32, min_size=32, dtype="float32")
    report = update_cache(model, data, pre, family=LTX2)
    assert report["encoded"] == 2 and not report["skipped"], report
    dataset = open_dataset(data.cache, cache.fingerprint(model, pre))
    try:
        batch = dataset.batch([0, 1])
    finally:
        dataset.close()
    assert batch["latent"].shape[:3] == (2, 128, 2) and batch["latent"].shape[3] * 32 <= 96
    assert sorted(batch["fps"].tolist()) == [16.0, 24.0]
    # each caption's own rows: its BOS and 28 bytes, the tiny tokenizer's tokens
    assert rows_kept(batch["text_features"]) == [29, 29]


def test_a_clip_renders_at_the_rate_its_file_plays_at(pipe):
    """A clip's render passes its rate (validation.fps, `sample --fps`) as LTX2Pipeline's
    frame_rate, where its positions are in seconds: another rate, another clip; an image and
    Wan's pipeline (frames by index) get no rate."""
    from raytuner.render.prompts import Defaults, PromptLine, resolve
    from raytuner.render.sample import render

    def rendered(family, fps: float, frames: int = 9):
        defaults = Defaults(size=(96, 64), seeds=(0,), steps=2, frames=frames, fps=fps)
        return resolve([PromptLine(prompt="a red circle")], family, defaults)

    (r,) = rendered(LTX2, 16.0)
    assert r.call()["frame_rate"] == 16.0 and r.call()["num_frames"] == 9
    assert "frame_rate" not in rendered(LTX2, 16.0, frames=1)[0].call()
    assert "frame_rate" not in rendered(FAMILIES["wan"], 16.0)[0].call()
    options = LTX2.pipeline_options(pipe)
    [[slow]], [[fast]] = (render(pipe, options, rendered(LTX2, f)) for f in (16.0, 24.0))
    assert slow.shape == fast.shape == (9, 64, 96, 3) and not np.array_equal(slow, fast)


def test_a_first_frame_kept_clean_is_image_conditioning_left_out_of_the_loss(encoded):
    """``first_frame_p``: a clip sample's first latent frame clean (level 0 on its tokens, as
    LTX2ImageToVideoPipeline conditions on an image) and its loss the mean over the other
    frames (Lightricks' trainer); an image draws no clean frame; the draw leaves the noise and
    levels as they were."""
    model = LTX2.denoiser(TINY)
    x0, fps = encoded["latent"], torch.tensor([24.0, 24.0])
    text = encoded["text_features"][:2, : max(rows_kept(encoded["text_features"][:2]))]

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(2)]

    loss = LTX2.loss(TINY, FlowObjective(first_frame_p=1.0))
    drawn = loss.draw(tuple(x0.shape), gens())
    plain = LTX2.loss(TINY, FlowObjective()).draw(tuple(x0.shape), gens())
    assert drawn["first_frame"].tolist() == [1.0, 1.0] and "first_frame" not in plain
    assert all(torch.equal(drawn[k], plain[k]) for k in ("noise", "sigma"))
    assert loss.draw((2, 128, 1, 2, 3), gens())["first_frame"].tolist() == [0.0, 0.0]
    ours = loss(model, {"latent": x0, "text_features": text, "fps": fps, **drawn})

    noise, s = drawn["noise"], drawn["sigma"]
    noisy = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise
    noisy[:, :, 0] = x0[:, :, 0]
    time = (s * 1000).view(2, 1).repeat(1, 2 * 2 * 3)
    time[:, : 2 * 3] = 0  # the first latent frame's tokens
    context = video_context(LTX2._video_connector(TINY, "cpu"), text, ROWS)
    with torch.no_grad():
        out = model(
            hidden_states=noisy.flatten(2).transpose(1, 2),
            audio_hidden_states=torch.zeros(2, 1, 4),
            encoder_hidden_states=context, audio_encoder_hidden_states=context[:, :1],
            timestep=time, audio_timestep=s * 1000, sigma=s * 1000,
            encoder_attention_mask=torch.ones(2, ROWS),
            audio_encoder_attention_mask=torch.ones(2, 1),
            num_frames=2, height=2, width=3, fps=24.0, audio_num_frames=1, isolate_modalities=True,
            return_dict=False,
        )[0]  # fmt: skip
    pred = out.transpose(1, 2).reshape(x0.shape)
    theirs = ((pred - (noise - x0)) ** 2)[:, :, 1:].reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
