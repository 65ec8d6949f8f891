"""Qwen-Image-Edit-2509 (qwen-image-edit): the loss is a step of ``QwenImageEditPlusPipeline``'s
conditioning (each reference's packed latent after the target's tokens, ``img_shapes`` listing
them all, the text mask, the target's tokens alone), the text row of a caption depends on its
reference images, and one edit dataset end to end on the tiny model saved as a diffusers folder:
its cache holds what the pipeline's own ``encode_prompt`` and ``_encode_vae_image`` /
``prepare_latents`` make of each pair, a pair is encoded once (a rerun encodes nothing, a changed
reference its pair's text row again), it trains on two workers, resumes, exports a LoRA the
pipeline loads to render the trained model's image, and a render depends on its reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from raytuner.config import ConfigError, FlowObjective, load_job
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.families.qwen_image_edit import condition_images

TINY = Source("tiny")
EDIT = FAMILIES["qwen-image-edit"]
SIDE = 64


def _picture(seed: int, size=(SIDE, SIDE)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny_pipe():
    return EDIT.pipeline(TINY)


def test_the_loss_is_a_step_of_the_edit_pipelines_conditioning(tiny_pipe):
    """x_t = (1 - s) x0 + s noise packed, each reference's packed latent after it, the
    transformer at timestep s with img_shapes [target, reference, reference] and the caption
    mask; its output's first tokens (the target's), unpacked, against noise - x0."""
    from diffusers import QwenImageEditPlusPipeline as Pipe

    model = EDIT.denoiser(TINY)
    loss = EDIT.loss(TINY, FlowObjective(timestep_sampling="uniform"))
    g = torch.Generator().manual_seed(1)
    x0, refs = torch.randn(2, 16, 4, 6, generator=g), torch.randn(2, 2, 16, 4, 6, generator=g)
    text = torch.randn(2, 9, 16, generator=g)
    text[1, 6:] = 0  # the second caption is 6 rows long
    drawn = loss.draw(tuple(x0.shape), [torch.Generator().manual_seed(i) for i in range(2)])
    batch = {"latent": x0, "prompt_embeds": text, **drawn}
    ours = loss(model, batch | {"reference_latent": refs})

    noise, sigmas = drawn["noise"], drawn["sigma"]
    s = sigmas[:, None, None, None]
    noisy = (1.0 - s) * x0 + s * noise
    packed = [Pipe._pack_latents(x, 2, 16, 4, 6) for x in (noisy, refs[:, 0], refs[:, 1])]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        out = model(
            hidden_states=torch.cat(packed, dim=1),
            timestep=sigmas,
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, 2, 3), (1, 2, 3), (1, 2, 3)]] * 2,
            return_dict=False,
        )[0][:, : 2 * 3]
    pred = Pipe._unpack_latents(out, 4 * 8, 6 * 8, 8)[:, :, 0]
    theirs = ((pred - (noise - x0)) ** 2).reshape(2, -1).mean(1)
    torch.testing.assert_close(ours.detach(), theirs)
    assert (loss(model, batch) - ours).abs().max() > 1e-4  # the references condition it


def test_a_captions_text_rows_are_the_pipelines_with_its_references(tiny_pipe):
    """The text encoder (what the preprocess caches) gives the edit pipeline's
    ``encode_prompt`` of the caption with its references resized as ``__call__`` resizes them;
    another reference, a second one or none gives other rows."""
    encode = EDIT.text_encoder(TINY, "cpu")
    one, other = _picture(1), _picture(2, (48, 64))
    rows = encode(["make it red"] * 4, references=[[one], [other], [one, other], []])
    rows = rows["prompt_embeds"]
    for i, images in enumerate([[one], [other], [one, other], None]):
        conditions = condition_images(tiny_pipe, images) if images else None
        theirs, _ = tiny_pipe.encode_prompt(["make it red"], image=conditions)
        n = theirs.shape[1]
        torch.testing.assert_close(rows[i, :n], theirs[0])
        assert not rows[i, n:].any()  # zero rows after it: the cache keeps its own
    lengths = [int(r.abs().sum(-1).bool().sum()) for r in rows]
    assert lengths[3] < lengths[0] < lengths[2]  # a reference's vision tokens are rows
    # the caption's rows after the image see it (causal: the rows before it do not)
    assert (rows[0, lengths[0] - 1] - rows[1, lengths[1] - 1]).abs().max() > 1e-3


# ---- one edit dataset end to end (slow) ----

JOB = """
[model]
family = "qwen-image-edit"
pretrained = "{root}/model"

[data]
cache = "{root}/cache"

[[data.sources]]
path = "{root}/edits"
references = "control"

[preprocess]
resolution = 64
bucket_step = 16
dtype = "float32"  # the cache compared to the pipeline's own encode, not to bf16 rounding

[train]
output = "{root}/runs"
max_steps = 2
global_batch_size = 2
learning_rate = 1e-2
log_every = 1

[lora]
save_dtype = "float32"

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 1
"""

# target -> (its caption, the seeds of its references): t3 is t0's instruction with another
# reference (another text row), t4 t0's instruction and reference bytes (t0's row)
PAIRS = {
    "t0": ("make it red", [100]),
    "t1": ("put the two together", [101, 102]),
    "t2": ("make it blue", [103]),
    "t3": ("make it red", [104]),
    "t4": ("make it red", [100]),
}


def _write_pairs(root: Path) -> None:
    edits, control = root / "edits", root / "edits" / "control"
    control.mkdir(parents=True)
    for i, (name, (caption, seeds)) in enumerate(PAIRS.items()):
        _picture(i).save(edits / f"{name}.png")
        (edits / f"{name}.txt").write_text(caption)
        if len(seeds) == 1:
            _picture(seeds[0]).save(control / f"{name}.png")
        for k, seed in enumerate(seeds if len(seeds) > 1 else []):
            _picture(seed).save(control / f"{name}_{k}.png")


@pytest.fixture(scope="module")
def edited(ray_local, tmp_path_factory):
    """The tiny model saved as a diffusers folder, the edit dataset, its job and the report of
    its first preprocess."""
    from raytuner.api import preprocess

    root = tmp_path_factory.mktemp("qwen-edit")
    EDIT.pipeline(TINY).save_pretrained(root / "model")
    _write_pairs(root)
    (root / "job.toml").write_text(JOB.format(root=root))
    return root, preprocess(load_job(root / "job.toml"))


def _dataset(root: Path):
    from raytuner.data import cache
    from raytuner.data.reader import open_dataset

    job = load_job(root / "job.toml")
    return open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))


def _own_rows(text: torch.Tensor) -> torch.Tensor:
    from raytuner.families.text import rows_kept

    return text[: rows_kept(text[None])[0]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_cache_holds_the_pipelines_own_encode_of_each_pair(edited):
    root, report = edited
    assert report["pairs"] == {
        "targets": 5, "references": 5, "per_target": 2, "encoded": 5, "texts_encoded": 4,
    }  # fmt: skip
    data, pipe = _dataset(root), EDIT.pipeline(Source(str(root / "model")))
    control = root / "edits" / "control"
    for name, files in (("t0", ["t0.png"]), ("t1", ["t1_0.png", "t1_1.png"])):
        batch = data.batch([data.paths.index(f"{name}.png")])
        images = [Image.open(control / f).convert("RGB") for f in files]
        with torch.no_grad():
            text, _ = pipe.encode_prompt([PAIRS[name][0]], image=condition_images(pipe, images))
            pixels = [pipe.image_processor.preprocess(x, SIDE, SIDE).unsqueeze(2) for x in images]
            latents = [pipe._encode_vae_image(x, generator=None) for x in pixels]
            _, packed = pipe.prepare_latents(pixels, 1, 16, SIDE, SIDE, torch.float32, "cpu", None)
        torch.testing.assert_close(_own_rows(batch["prompt_embeds"][0]), text[0])
        refs = batch["reference_latent"][0]  # the dataset's most: 2 (zeros after t0's one)
        assert int(batch["reference_count"][0]) == len(files) and refs.shape[0] == 2
        refs = refs[: len(files)]
        for k, latent in enumerate(latents):
            torch.testing.assert_close(refs[k], latent[0, :, 0])
        ours = torch.cat([pipe._pack_latents(r[None], 1, 16, 8, 8) for r in refs], dim=1)
        torch.testing.assert_close(ours, packed)
    # one row a pair: t3 (t0's caption, another reference) its own, t4 (t0's pair) t0's
    rows = {n: _own_rows(data.batch([data.paths.index(f"{n}.png")])["prompt_embeds"][0])
            for n in ("t0", "t3", "t4")}  # fmt: skip
    assert torch.equal(rows["t0"], rows["t4"]) and not torch.equal(rows["t0"], rows["t3"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rerun_encodes_nothing_and_a_changed_reference_its_pairs_text_row(edited):
    from raytuner.api import preprocess

    root, _ = edited
    job = load_job(root / "job.toml")
    again = preprocess(job)
    assert again["encoded"] == 0 and again["pairs"]["texts_encoded"] == 0
    before = _dataset(root)
    old = _own_rows(before.batch([before.paths.index("t2.png")])["prompt_embeds"][0])
    _picture(999).save(root / "edits" / "control" / "t2.png")
    changed = preprocess(job)
    assert changed["pairs"]["encoded"] == 1 and changed["pairs"]["texts_encoded"] == 1
    after = _dataset(root)
    new = _own_rows(after.batch([after.paths.index("t2.png")])["prompt_embeds"][0])
    assert new.shape == old.shape and not torch.equal(new, old)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_edit_run_trains_resumes_and_its_lora_renders_the_trained_image(edited, tmp_path):
    """2 steps on 2 workers, then the same run to 3 steps resumes at its checkpoint; the
    exported LoRA loaded into QwenImageEditPlusPipeline renders the image `raytuner sample`
    renders with the trained model, and another reference gives another image."""
    from raytuner.api import sample, train

    root, _ = edited
    job = load_job(root / "job.toml")
    first = train(job)
    assert first["step"] == 2 and np.isfinite(first["loss"])
    run = Path(job.train.output, job.train.name)
    before = {p.name for p in run.glob("checkpoint_*")}
    resumed = train(load_job(root / "job.toml", ["train.max_steps=3"]))
    assert resumed["step"] == 3 and np.isfinite(resumed["loss"])
    # resumed at step 2's checkpoint: step 3's is the one checkpoint written again
    new = {p.name for p in run.glob("checkpoint_*")} - before
    assert len(new) == 1 and new.pop().endswith("step-000003")

    # flat colours: the pipeline renders from a reference resized to about 1024 x 1024, 4,096
    # tokens the tiny model attends to in the mean (two noise images have about one mean)
    for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220))):
        Image.new("RGB", (SIDE, SIDE), colour).save(tmp_path / f"{name}.png")

    def render(reference: str, out: str, checkpoint: str = "latest") -> np.ndarray:
        (path,) = sample(job, ["make it red"], steps=2, out=str(tmp_path / out),
                         references=[str(tmp_path / reference)], checkpoint=checkpoint)  # fmt: skip
        return np.asarray(Image.open(path), dtype=np.float32)

    trained = render("red.png", "red")
    assert np.abs(render("blue.png", "blue") - trained).max() > 2
    assert np.abs(render("red.png", "base", "base") - trained).max() > 2

    pipe = EDIT.pipeline(Source(str(root / "model")))
    pipe.load_lora_weights(str(Path(resumed["lora"]).parent))
    reference = Image.open(tmp_path / "red.png").convert("RGB")
    theirs = pipe(
        image=[reference], prompt="make it red", negative_prompt=" ", true_cfg_scale=4.0,
        height=SIDE, width=SIDE, num_inference_steps=2, output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip
    assert np.abs(theirs * 255 - trained).max() <= 1


def test_check_refuses_renders_without_a_reference(tmp_path):
    from raytuner.api import check, sample

    _write_pairs(tmp_path)
    tiny = JOB.replace('"{root}/model"', '"tiny"')
    (tmp_path / "job.toml").write_text(tiny.format(root=tmp_path))
    job = load_job(tmp_path / "job.toml")
    with pytest.raises(ConfigError, match="renders only from a reference image"):
        sample(job, ["make it red"], out=str(tmp_path / "out"))
    prompts = ["validation.every_steps=1", 'validation.prompts=["make it red"]']
    with pytest.raises(ConfigError, match="validation.prompts: qwen-image-edit's pipeline"):
        check(load_job(tmp_path / "job.toml", prompts))
    lines = tmp_path / "prompts.txt"
    lines.write_text(f"make it red --ci {tmp_path}/edits/control/t0.png\nmake it blue\n")
    file = ["validation.every_steps=1", f'validation.prompts_file="{lines}"']
    with pytest.raises(ConfigError, match="line 2: qwen-image-edit's pipeline renders only"):
        check(load_job(tmp_path / "job.toml", file))
