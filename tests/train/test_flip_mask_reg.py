"""What users of kohya's sd-scripts, SimpleTuner and OneTrainer bring: flip augmentation
(``data.flip``), loss masks (``data.mask``: alpha channels, ``-masklabel.png`` files) and
regularization images (kohya's ``reg/1_person/`` folders, ``train.prior_loss_weight``).

One dataset of the three kinds, preprocessed once for the module: a flipping source with two
half-transparent images (``mask = "alpha"``), a source with mask files, and a kohya reg
folder. The report counts them apart, a rerun encodes nothing, a flipped latent is the VAE's
encoding of the mirror image, every rank and a resume flip the same samples, masked pixels
add no gradient, and regularization samples weigh ``train.prior_loss_weight``. The slow test
trains it on two workers, resumes it exactly, and counts its steps from ``train.epochs``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from run_checks import lora_changes_the_pipeline
from safetensors.torch import load_file

from raytuner import placement
from raytuner.api import preprocess, train
from raytuner.checkpoint import layout
from raytuner.config import ObjectiveConfig, load_job
from raytuner.data import cache
from raytuner.data.reader import CachedDataset, open_dataset
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.preprocess.decode import decode_row
from raytuner.preprocess.job import decode_spec
from raytuner.preprocess.worklist import pair_regularization, report_lines
from raytuner.train import sample_log
from raytuner.train.feed import Feed
from raytuner.train.step import forward_backward

TINY = Source("tiny")
SIDE = 64  # every image: one 64x64 bucket, latents of 8x8
JOB = """
[model]
family = "sdxl"

[data]
images = "{root}/images"
cache = "{root}/cache"
flip = "random"  # every source's, unless it sets its own
mask = "alpha"

[[data.sources]]
path = "{root}/masked"
flip = "none"
mask = "file"

[[data.sources]]
path = "{root}/reg"
regularization = true
repeats_from_folder = true

[preprocess]
resolution = 64
bucket_step = 16

[train]
output = "{root}/runs"
epochs = 2
global_batch_size = 4
learning_rate = 1e-2
prior_loss_weight = 0.5
log_every = 1
sample_log = true

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 5
"""


def _draw(root: Path) -> None:
    """6 + 2 images (the 2 with a transparent left half) that flip, 2 with mask files (their
    top half trains), 3 in a kohya reg folder ``1_person`` (captioned "person")."""
    rng = np.random.default_rng(0)

    def noise(channels: int = 3) -> np.ndarray:
        return rng.integers(0, 256, (SIDE, SIDE, channels), dtype=np.uint8)

    for folder in ("images", "masked", "reg/1_person"):
        (root / folder).mkdir(parents=True)
    for i in range(6):
        Image.fromarray(noise()).save(root / "images" / f"rgb{i}.png")
        (root / "images" / f"rgb{i}.txt").write_text(f"a noisy picture {i}")
    for i in range(2):
        rgba = noise(4)
        rgba[:, : SIDE // 2, 3], rgba[:, SIDE // 2 :, 3] = 0, 255
        Image.fromarray(rgba, "RGBA").save(root / "images" / f"rgba{i}.png")
    top = np.zeros((SIDE, SIDE), np.uint8)
    top[: SIDE // 2] = 255
    for i in range(2):
        Image.fromarray(noise()).save(root / "masked" / f"m{i}.png")
        Image.fromarray(top).save(root / "masked" / f"m{i}-masklabel.png")
    for i in range(3):
        Image.fromarray(noise()).save(root / "reg" / "1_person" / f"r{i}.png")


def write_job(root: Path) -> Path:
    """The dataset drawn under ``root`` and its job file."""
    _draw(root)
    (root / "job.toml").write_text(JOB.format(root=root))
    return root / "job.toml"


@pytest.fixture(scope="module")
def features(ray_local, tmp_path_factory) -> tuple[Path, dict]:
    """The job file and the report of its first preprocess."""
    job_file = write_job(tmp_path_factory.mktemp("features"))
    return job_file, preprocess(load_job(job_file))


def dataset(job_file: Path) -> CachedDataset:
    job = load_job(job_file)
    return open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))


def test_the_report_counts_flips_masks_and_regularization_images_apart(features):
    _, report = features
    assert report["total"] == 13 and report["encoded"] == 13  # mask files are no inputs
    assert report["flipped"] == 11  # the reg folder takes data.flip too
    assert report["masked"] == {"alpha": 2, "file": 2}
    # kohya's pairing: 3 reg images x 1 repeat, then one more each in turn up to the 10
    # training samples
    assert report["regularization"] == {
        "images": 3,
        "unused": 0,
        "samples": 10,
        "training_images": 10,
        "training_samples": 10,
    }
    assert report["folders"] == [
        {"source": report["folders"][0]["source"], "folder": "1_person", "images": 3,
         "repeats": 1, "name_captions": 3}
    ]  # fmt: skip
    lines = "\n".join(report_lines(report))
    assert "masked: 2 by their alpha channel, 2 by mask files" in lines
    assert "regularization: 3 images (0 left out), 10 samples an epoch" in lines


def test_kohyas_pairing_repeats_or_leaves_out_regularization_images():
    def rows(train: list[int], reg: list[int]) -> list[dict]:
        made = [{"regularization": False, "repeats": n} for n in train]
        made += [{"regularization": True, "repeats": n} for n in reg]
        return [r | {"source_index": 0, "path": f"{i:02d}"} for i, r in enumerate(made)]

    def paired(train, reg):
        return [r["repeats"] for r in pair_regularization(rows(train, reg)) if r["regularization"]]

    assert paired([10], [1, 1, 1]) == [4, 3, 3]  # short: one more each, in turn
    assert paired([3, 2], [2, 2, 2]) == [2, 2, 2]  # 6 >= 5: each with its own repeats
    assert paired([4], [3, 3, 3]) == [3, 3, 0]  # reached: the rest is left out
    assert paired([], [1]) == [0]


@pytest.mark.slow
def test_a_rerun_encodes_nothing_and_an_edited_mask_only_its_image(features, tmp_path):
    job_file, first = features
    for folder in ("images", "masked", "reg", "cache"):
        shutil.copytree(job_file.parent / folder, tmp_path / folder, symlinks=True)
    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path))
    job = load_job(tmp_path / "job.toml")
    again = preprocess(job)
    assert (again["encoded"], again["already_cached"]) == (0, 13)
    assert {k: again[k] for k in ("flipped", "masked")} == {
        k: first[k] for k in ("flipped", "masked")
    }
    bottom = np.zeros((SIDE, SIDE), np.uint8)
    bottom[SIDE // 2 :] = 255
    Image.fromarray(bottom).save(tmp_path / "masked" / "m0-masklabel.png")
    edited = preprocess(job)
    assert (edited["encoded"], edited["already_cached"]) == (1, 12)
    data = dataset(tmp_path / "job.toml")
    mask = data.batch([data.paths.index("m0.png")])["mask"][0, 0]
    assert mask[:4].sum() == 0 and (mask[4:] == 1).all()  # the new mask, bottom half


def test_a_mask_file_is_cut_like_its_image_or_its_image_skipped_with_the_reason(tmp_path):
    """A mask at half the image's size is resized to it (its top half trains); one of another
    aspect ratio, or one that is no image, skips the image, naming the mask file."""
    job = load_job(write_job(tmp_path))
    spec = decode_spec(FAMILIES["sdxl"], job.data, job.preprocess)
    folder = tmp_path / "masked"
    half = np.zeros((SIDE // 2, SIDE // 2), np.uint8)
    half[: SIDE // 4] = 255
    cases = {"half": Image.fromarray(half), "wide": Image.new("L", (SIDE, SIDE // 2), 255)}
    for name, mask in cases.items():
        mask.save(folder / f"{name}-masklabel.png")
    (folder / "broken-masklabel.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    image = (folder / "m0.png").read_bytes()

    def decoded(name: str) -> dict:
        row = {"source": 1, "path": "m0.png", "key": "ab" * 32}
        return decode_row(row | {"mask_path": f"{name}-masklabel.png"}, spec, image, "file")

    cut = np.frombuffer(decoded("half")["mask"], np.uint8).reshape(SIDE, SIDE)
    edge = SIDE // 2  # resized bilinearly: the rows beside the edge blend
    assert (cut[: edge - 1] == 255).all() and (cut[edge + 1 :] == 0).all()
    wide, broken = decoded("wide"), decoded("broken")
    assert wide["status"] == broken["status"] == "skipped"
    assert wide["reason"] == (
        "mask file 'wide-masklabel.png': 64x32, the image 64x64: a mask must have the image's "
        "aspect ratio"
    )
    assert broken["reason"].startswith("mask file 'broken-masklabel.png': corrupt")


def _encoded(family, image: Image.Image) -> torch.Tensor:
    pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    return family.image_encoder(TINY, "cpu")(pixels[None].float() / 127.5 - 1.0)[0][0]


def test_the_flipped_latent_is_the_vae_encoding_of_the_mirror_image(features):
    job_file, _ = features
    data, family = dataset(job_file), FAMILIES["sdxl"]
    i = data.paths.index("rgb0.png")
    original = Image.open(job_file.parent / "images" / "rgb0.png")
    latent, flipped = (data.batch([i], flipped=[f])["latent"][0] for f in (False, True))
    expected = _encoded(family, ImageOps.mirror(original))
    # stored in bfloat16 (preprocess.dtype): its rounding
    torch.testing.assert_close(flipped, expected.to(torch.bfloat16).float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(latent, _encoded(family, original), rtol=0, atol=2e-2)
    assert (flipped - latent).abs().max() > 0.1  # not the same latent


def _flips(data: CachedDataset, world: int, cursor: tuple[int, int], steps: int) -> list:
    """From ``cursor`` on, each global batch's samples in order: (cache row, flipped), and
    whether each flipped sample's latent is its row's flipped latent."""
    feeds = [
        Feed(data, seed=3, global_batch_size=4, remainder="pad", rank=r, world=world,
             prefetch=1, pin=False)
        for r in range(world)
    ]  # fmt: skip
    out, (epoch, index) = [], cursor
    for _ in range(steps):
        batches = feeds[0].epoch(epoch)
        parts = [f.assemble(epoch, index, batches) for f in feeds]
        for p in parts:
            for j, (row, flip) in enumerate(zip(p.ids, p.flipped, strict=True)):
                own = data.batch([data.paths.index(row)], flipped=[flip])["latent"][0]
                assert torch.equal(p.tensors["latent"][j], own), (row, flip)
        out.append([pair for p in parts for pair in zip(p.ids, p.flipped, strict=True)])
        epoch, index = parts[0].after()
    return out


def test_every_rank_and_a_resume_flip_the_same_samples(features):
    job_file, _ = features
    data = dataset(job_file)
    one = _flips(data, 1, (0, 0), 10)  # two epochs of 5 global batches
    assert one == _flips(data, 2, (0, 0), 10)
    assert one[7:] == _flips(data, 2, (1, 2), 3)  # resumed at epoch 1, batch 2
    flips = [(row, flip) for batch in one for row, flip in batch]
    assert not any(flip for row, flip in flips if row.startswith("m"))  # masked: flip = none
    share = sum(flip for _, flip in flips) / sum(not row.startswith("m") for row, _ in flips)
    assert 0.25 < share < 0.75
    assert one[:5] != one[5:], "each epoch draws its flips again"


def test_masks_are_cached_at_latent_resolution_mirrored_with_their_flip(features):
    job_file, _ = features
    data = dataset(job_file)
    half = SIDE // 16  # latent columns / rows of one half (8 x 8 latents)
    rgba, masked, plain = (data.paths.index(p) for p in ("rgba0.png", "m0.png", "rgb0.png"))
    masks = data.batch([rgba, plain], flipped=[False, True])["mask"]
    assert masks.shape == (2, 1, 8, 8)
    assert (masks[0, 0, :, :half] == 0).all() and (masks[0, 0, :, half:] == 1).all()
    assert (masks[1] == 1).all()  # no mask: every pixel trains
    mirrored = data.batch([rgba], flipped=[True])["mask"][0, 0]
    assert (mirrored[:, :half] == 1).all() and (mirrored[:, half:] == 0).all()
    top = data.batch([masked])["mask"][0, 0]
    assert (top[:half] == 1).all() and (top[half:] == 0).all()


def _example(family, n: int) -> dict:
    """``n`` samples of the shapes the family's tiny encoders make at 64x64."""
    latent = _encoded(family, Image.new("RGB", (SIDE, SIDE)))
    text = family.text_encoder(TINY, "cpu")(["a cat"])
    shapes = {"latent": tuple(latent.shape)} | {k: tuple(v.shape[1:]) for k, v in text.items()}
    return family.example_batch(shapes, n, (SIDE, SIDE), "cpu", torch.float32)


@pytest.mark.parametrize("name", ["sdxl", "flux"])  # a UNet and a packed transformer
def test_a_masked_out_region_gives_its_pixels_no_gradient(name):
    """The loss's gradient on the denoiser's prediction is zero on every masked-out latent
    pixel (the left half) and not on the others; a mask of ones is the unmasked loss."""
    family = FAMILIES[name]
    denoiser, batch = family.denoiser(TINY), _example(family, 2)
    loss_fn = family.loss(TINY, ObjectiveConfig().for_family(family))
    outputs = []

    def keep(module, args, output):  # the prediction, before the loss
        output.sample.retain_grad()
        outputs.append(output.sample)

    denoiser.register_forward_hook(keep)

    def loss(mask=None) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
        return loss_fn(denoiser, batch | ({} if mask is None else {"mask": mask}), generators)

    mask = torch.ones(2, 1, 8, 8)
    torch.testing.assert_close(loss(mask), loss())
    mask[..., :4] = 0
    loss(mask).sum().backward()
    grad = outputs[-1].grad
    if name == "flux":  # 2x2 patches packed as tokens, row by row of the 4x4 patch grid
        grad = grad.reshape(2, 4, 4, -1).permute(0, 3, 1, 2)
        left, right = grad[..., :2], grad[..., 2:]
    else:
        left, right = grad[..., :4], grad[..., 4:]
    assert torch.count_nonzero(left) == 0
    assert (right.abs() > 0).float().mean() > 0.9


def test_regularization_samples_weigh_the_prior_loss_weight(features):
    """Each sample of a regularization image carries train.prior_loss_weight (0.5 here), the
    others 1; the step's loss is the family's per-sample loss times that weight."""
    job_file, _ = features
    data, family = dataset(job_file), FAMILIES["sdxl"]
    feed = Feed(data, seed=0, global_batch_size=4, remainder="drop", rank=0, world=1,
                prefetch=1, pin=False, prior_loss_weight=0.5)  # fmt: skip
    batches, weights, mixed = feed.epoch(0), {}, None
    for index in range(len(batches)):
        part = feed.assemble(0, index, batches)
        mine = dict(zip(part.ids, part.tensors["loss_weight"].tolist(), strict=True))
        weights |= mine
        mixed = part if len(set(mine.values())) == 2 else mixed
    assert weights == {row: 0.5 if row.startswith("1_person/") else 1.0 for row in weights}
    assert mixed is not None, "no global batch mixes regularization and training images"

    model = family.denoiser(TINY)
    loss_fn = family.loss(TINY, ObjectiveConfig().for_family(family))
    total = forward_backward(model, loss_fn, mixed, torch.device("cpu"), 0, scale=1.0)
    generators = [torch.Generator().manual_seed(s) for s in mixed.seeds]
    tensors = placement.batch(mixed.tensors, torch.device("cpu"))  # float32, as the step takes
    with torch.no_grad():
        per_sample = loss_fn(model, tensors, generators)
    torch.testing.assert_close(total, (per_sample * tensors["loss_weight"]).sum())


def _checkpoint_weights(run_dir: str) -> dict[str, torch.Tensor]:
    """The trained tensors of the run's newest checkpoint (float32, as training keeps them)."""
    _, folders = layout.complete_checkpoints(run_dir)
    return load_file(str(Path(folders[0]) / "weights.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_workers_train_epochs_and_resume_exactly(features):
    """train.epochs = 2 trains 2 x the global batches of an epoch; a run of one epoch resumed
    to two trains only the second epoch's steps, the same rows at every step and the same
    weights as the run of two; its LoRA (float16 files) loads into the diffusers pipeline."""
    job_file, _ = features
    output = load_job(job_file).train.output
    per_epoch = len(
        Feed(dataset(job_file), seed=0, global_batch_size=4, remainder="drop", rank=0,
             world=1, prefetch=1, pin=False).epoch(0)
    )  # fmt: skip
    assert per_epoch == 5  # 10 training + 10 regularization samples in batches of 4
    whole = train(load_job(job_file, ['train.name="whole"']))
    assert whole["step"] == 2 * per_epoch
    assert train(load_job(job_file, ['train.name="split"', "train.epochs=1"]))["step"] == 5
    split = train(load_job(job_file, ['train.name="split"']))
    assert split["step"] == 2 * per_epoch
    whole_dir, split_dir = f"{output}/whole", f"{output}/split"
    # resumed after the first epoch: the second attempt trained steps 6 to 10 and no other (a
    # run started again from step 1 trains the same rows and weights: training is seeded)
    first, second = sample_log.read_attempts(split_dir)
    assert sorted(first) == list(range(1, per_epoch + 1))
    assert sorted(second) == list(range(per_epoch + 1, 2 * per_epoch + 1)), sorted(second)
    assert sample_log.trained(split_dir) == sample_log.trained(whole_dir)
    expected, resumed = _checkpoint_weights(whole_dir), _checkpoint_weights(split_dir)
    for key, value in expected.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-6, atol=1e-7, msg=key)
    exported = load_file(whole["lora"])
    assert {t.dtype for t in exported.values()} == {torch.float16}
    assert lora_changes_the_pipeline(str(Path(whole["lora"]).parent))
