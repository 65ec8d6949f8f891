"""``preprocess.text_dtype = "float8"``: the text tensors stored as float8 e4m3 with a float32
scale per token row. Quick: the text dtype is part of the fingerprint, and float8 cells are
about half the bytes, located in their file and read back within float8's rounding, each token
row in its own range. Slow: one tiny Flux preprocess in each dtype (shared by those cases): the
float8 version is another cache version (its own fingerprint: the bfloat16 one is not mixed
into it, and switching back finds the bfloat16 version as it was), its text is about half the
bytes a caption, the reader hands back text within float8's rounding of the bfloat16 text, a
training step's loss on it is the bfloat16 cache's within a percent, and `raytuner train` runs
on it."""

from __future__ import annotations

import dataclasses
import re

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from raytuner import api
from raytuner.config import ConfigError, FlowObjective, load_job
from raytuner.data import cache, cells
from raytuner.data.reader import open_dataset
from raytuner.data.verify import verify
from raytuner.families import get_family, parts
from raytuner.tools.demo_images import make_demo_images

DTYPES = ("", "bfloat16", "float16", "float8")
JOB = """
[model]
family = "flux"
pretrained = "tiny"

[data]
images = "{images}"
cache = "{cache}"

[preprocess]
resolution = 64
bucket_step = 16
batch_size = 4

[train]
output = "{runs}"
max_steps = 2
global_batch_size = 2
log_every = 1

[scaling]
workers = 1
"""


@pytest.fixture(scope="module")
def caches(ray_local, tmp_path_factory):
    """The same tiny Flux job preprocessed with bfloat16 text, with float8 text, and with
    bfloat16 text again: each run's report, and the job of each dtype."""
    root = tmp_path_factory.mktemp("text_dtype")
    images = make_demo_images(root / "images", per_aspect=2)
    path = root / "job.toml"
    path.write_text(JOB.format(images=images, cache=root / "cache", runs=root / "runs"))
    jobs = {d: load_job(path, [f'preprocess.text_dtype="{d}"']) for d in ("bfloat16", "float8")}
    reports = {d: api.preprocess(job) for d, job in jobs.items()}
    reports["again"] = api.preprocess(jobs["bfloat16"])
    return jobs, reports


def _dataset(job):
    return open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))


def test_text_dtype_is_part_of_the_cache_identity_and_the_default_keeps_it(tmp_path):
    path = tmp_path / "job.toml"
    images = tmp_path / "images"
    path.write_text(JOB.format(images=images, cache=tmp_path / "c", runs=tmp_path / "r"))
    fp = {
        d: cache.fingerprint(job.model, job.preprocess)
        for d, job in ((d, load_job(path, [f'preprocess.text_dtype="{d}"'])) for d in DTYPES)
    }
    assert fp[""] == fp["bfloat16"]  # the default: the latents' dtype, the fingerprint as before
    assert len({fp[""], fp["float16"], fp["float8"]}) == 3


def _cells_file(tmp_path, tensor: torch.Tensor, dtype: str):
    """A text data file of ``tensor``'s rows in ``dtype``, written and located as the cache
    does (``cache.write_part``, ``cells.locate``): its bytes and located rows."""
    from raytuner.data.tensors import cell_column

    column, shape, sums = cell_column(tensor, dtype)
    n = len(column)
    table = pa.table(
        {
            "caption_key": [str(i) for i in range(n)],
            "prompt_embeds": column,
            "prompt_embeds_shape": pa.array([shape] * n, pa.list_(pa.int32())),
            "prompt_embeds_xxh3": sums,
        }
    )
    path = tmp_path / f"{dtype}.parquet"
    cache.write_part(pafs.LocalFileSystem(), str(path), table)
    data = path.read_bytes()
    located, _ = cells.locate(pa.py_buffer(data), "bfloat16", dtype)
    return data, located, shape


def test_float8_cells_are_about_half_the_bytes_located_and_read_back_close(tmp_path):
    from raytuner.data.tensors import from_cell

    # 4 captions' token rows, 32 wide, of ranges a thousandfold apart, one caption padded
    g = torch.Generator().manual_seed(0)
    tensor = torch.randn(4, 16, 32, generator=g) * torch.logspace(-2, 1, 16)[None, :, None]
    tensor[2, 10:] = 0
    sizes = {}
    for dtype in ("bfloat16", "float8"):
        data, located, shape = _cells_file(tmp_path, tensor, dtype)
        sizes[dtype] = cache.cell_bytes(shape, dtype)
        for i, at in enumerate(located.column("prompt_embeds_at").to_pylist()):
            row = from_cell(data, at, shape, dtype, torch.float32)
            error = (row - tensor[i]).norm(dim=-1) / tensor[i].norm(dim=-1).clamp_min(1e-30)
            # every token row within its own dtype's rounding, the small ones too
            assert error.max() < (0.05 if dtype == "float8" else 0.005), (dtype, i, error)
            if i == 2:  # its padding rows stay exactly zero
                assert not row[10:].any()
    assert sizes["float8"] / sizes["bfloat16"] == (32 + 4) / 64  # a float32 scale a row


@pytest.mark.slow
def test_float8_text_is_another_version_of_about_half_the_bytes(caches):
    jobs, reports = caches
    fp = {d: cache.fingerprint(j.model, j.preprocess) for d, j in jobs.items()}
    assert fp["bfloat16"] != fp["float8"]  # changing text_dtype encodes again, not mixes
    # the default ("": preprocess.dtype) is the fingerprint of the caches made before the key
    default = dataclasses.replace(jobs["bfloat16"].preprocess, text_dtype="")
    assert cache.fingerprint(jobs["bfloat16"].model, default) == fp["bfloat16"]
    assert reports["float8"]["encoded"] == reports["bfloat16"]["encoded"] > 0
    assert reports["again"]["encoded"] == 0  # the bfloat16 version is there, untouched
    bf16, f8 = reports["bfloat16"]["text"], reports["float8"]["text"]
    assert (bf16["dtype"], f8["dtype"]) == ("bfloat16", "float8")
    assert 0.45 < f8["bytes_per_caption"] / bf16["bytes_per_caption"] < 0.6
    manifest = cache.read_manifest(jobs["float8"].data.cache, fp["float8"])
    assert manifest["text_dtype"] == "float8"
    assert verify(cache.Version(jobs["float8"].data.cache, fp["float8"])) == []  # cache verify
    data = _dataset(jobs["float8"])
    try:
        batch = data.batch([0])
        shapes = {n: list(batch[n].shape[1:]) for n in data.tensors}
    finally:
        data.close()
    expected = sum(cache.cell_bytes(s, "float8") for s in shapes.values())
    assert f8["max_bytes_per_caption"] == expected


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ('preprocess.text_dtype="int8"', "preprocess.text_dtype = 'int8': must be one of"),
        ("preprocess.gpus_per_actor=1.5", "above 1 an encoder actor takes whole GPUs"),
    ],
)
def test_a_text_dtype_or_gpu_count_the_pool_cannot_take_is_refused(tmp_path, setting, named):
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(images=tmp_path, cache=tmp_path / "c", runs=tmp_path / "r"))
    with pytest.raises(ConfigError, match=re.escape(named)):
        load_job(path, [setting])


def _bucket(data) -> list[int]:
    first = data.buckets[0]
    return [i for i, b in enumerate(data.buckets) if b == first]


def _loss(family, batch) -> float:
    torch.manual_seed(0)
    denoiser = family.denoiser(parts.Source("tiny"), "cpu")
    loss_fn = family.loss(parts.Source("tiny"), FlowObjective())
    gens = [torch.Generator().manual_seed(i) for i in range(len(batch["latent"]))]
    with torch.no_grad():
        return loss_fn(denoiser, batch, gens).mean().item()


@pytest.mark.slow
def test_float8_text_reads_back_close_to_bfloat16_and_trains_the_same_loss(caches):
    jobs, _ = caches
    family = get_family("flux")
    batches = {}
    for dtype, job in jobs.items():
        data = _dataset(job)
        try:
            batches[dtype] = data.batch(_bucket(data), dtype=torch.float32)
        finally:
            data.close()
    bf16, f8 = batches["bfloat16"], batches["float8"]
    assert torch.equal(bf16["latent"], f8["latent"])  # latents untouched
    for name in ("prompt_embeds", "pooled_prompt_embeds"):
        error = (f8[name] - bf16[name]).norm() / bf16[name].norm()
        assert 0 < error < 0.05, (name, error)  # e4m3's 3 mantissa bits: about 2-3 %
    losses = {d: _loss(family, b) for d, b in batches.items()}
    assert abs(losses["float8"] - losses["bfloat16"]) <= 0.01 * abs(losses["bfloat16"])


@pytest.mark.slow
def test_raytuner_train_runs_on_a_float8_text_cache(caches):
    jobs, _ = caches
    summary = api.train(jobs["float8"])
    assert summary["step"] == 2
