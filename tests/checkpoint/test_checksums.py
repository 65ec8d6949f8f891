"""Checksummed reads: a byte that changed in a committed cache is never trained on.

Every tensor cell carries the xxh3-64 written with its bytes at encode time; the commit copies
it into the index, the training reader checks it on every read and `cache verify` on every
cell. A flipped byte fails `raytuner train` (exit 1) with a line naming the file, the row, the
column and the command that repairs the cache; the reader alone raises the same; `cache verify`
reports the cell.
"""

from __future__ import annotations

import contextlib
import io
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raytuner.config import load_job
from raytuner.data import cache, cells
from raytuner.data.reader import open_dataset
from raytuner.tools import synthetic
from raytuner.train.schedule import epoch_batches

REPAIR = "raytuner cache verify JOB.toml --repair"


def here(*args: str) -> tuple[int, str, str]:
    """A command run in this process through the CLI's own ``main`` (on the session's Ray when
    the test holds ``ray_local``): its exit code, stdout and stderr."""
    from raytuner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def row_in_file(path: Path, column: str, at: int) -> int:
    """The row (row group) of a data file whose ``column`` chunk holds byte ``at``."""
    meta = pq.read_metadata(path)
    (j,) = [j for j in range(meta.num_columns) if meta.schema.column(j).name == column]
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(j)
        if chunk.data_page_offset <= at < chunk.data_page_offset + chunk.total_compressed_size:
            return g
    raise AssertionError(f"byte {at} is in no {column} chunk of {path}")


# --- the training run ----------------------------------------------------------------------

# the session's skewed job (conftest.py) as one worker training a few steps on a copy of its cache
TRAIN = [
    "train.max_steps=3",
    "train.log_every=1",
    "train.sample_log=false",
    "train.tensorboard=false",
    "scaling.workers=1",
    "scaling.cpus_per_worker=1.0",
    "checkpoint.every_steps=100",
    "checkpoint.max_failures=0",
]


@dataclass
class Damaged:
    job: Path
    sets: list[str]  # --set overrides: this copy of the cache, one worker, a few steps
    path: Path  # the latents file with the flipped byte
    rel: str  # its path in the version
    row: int  # the cell's row in that file


@pytest.fixture(scope="module")
def damaged(job_file, tmp_path_factory) -> Damaged:
    """A copy of the session's committed cache with one byte flipped in the middle of the
    latent of a row that the first training batch holds (found through the index)."""
    root = tmp_path_factory.mktemp("checksums")
    shutil.copytree(job_file.parent / "cache", root / "cache")
    sets = [f'data.cache="{root / "cache"}"', f'train.output="{root / "runs"}"', *TRAIN]
    job = load_job(job_file, sets)
    fp = cache.fingerprint(job.model, job.preprocess)
    data = open_dataset(job.data.cache, fp)
    rows = [i for i, n in enumerate(data.repeats) for _ in range(n)]
    buckets = [data.buckets[i] for i in rows]
    t = job.train
    first = epoch_batches(buckets, t.seed, 0, t.global_batch_size, t.remainder)[0]
    data.close()
    version = cache.Version(job.data.cache, fp)
    index = version.read(version.manifest()["index"]["path"]).to_pylist()
    row = index[rows[first[0]]]
    path = Path(version.path(row["latent_file"]))
    n = math.prod(row["latent_shape"]) * cache.itemsize(version.manifest()["dtype"])
    flip_byte(path, row["latent_at"] + n // 2)
    return Damaged(
        job_file, sets, path, row["latent_file"], row_in_file(path, "latent", row["latent_at"])
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flipped_byte_in_a_latent_fails_the_training_run_naming_the_file(ray_local, damaged):
    args = ["train", str(damaged.job)] + [a for s in damaged.sets for a in ("--set", s)]
    code, out, err = here(*args)
    assert code == 1, out + err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("raytuner: train failed: ")]
    print(line)
    assert "ChecksumError" in line, line
    assert str(damaged.path) in line
    assert f"row {damaged.row}, column latent" in line
    assert REPAIR in line
    assert "trained" not in out  # nothing was exported


@pytest.mark.timeout(120)
def test_cache_verify_reports_the_flipped_cell(damaged):
    args = ["cache", "verify", str(damaged.job)] + [a for s in damaged.sets for a in ("--set", s)]
    code, out, err = here(*args)
    assert code == 1, out + err[-3000:]
    bad = [x for x in out.splitlines() if x.startswith("bad ")]
    assert bad == [
        f"bad {damaged.rel}: sha256 differs from the manifest; row {damaged.row}, column latent: "
        "its checksum differs from the one written with it"
    ]


# --- the reader alone ----------------------------------------------------------------------

SHAPES = {"latent": (4, 2, 2), "prompt_embeds": (3, 8), "pooled_prompt_embeds": (16,)}


def synthetic_cache(root: Path, std: float = 0.0) -> cache.Version:
    """A committed cache of 6 rows with 3 captions, written in the real format."""
    version = cache.Version(str(root), "synthetic")
    synthetic.write_cache(
        version,
        buckets=[(16, 16)] * 6,
        captions=[i % 3 for i in range(6)],
        repeats=[1] * 6,
        shapes=lambda w, h: SHAPES,
        family="test",
        dtype="float32",
        rows_per_file=4,
        std=std,
    )
    return version


def test_every_cell_carries_its_checksum_from_the_data_file_into_the_index(tmp_path):
    version = synthetic_cache(tmp_path, std=0.5)
    manifest = version.manifest()
    index = version.read(manifest["index"]["path"]).to_pylist()
    captions = version.read(manifest["captions"]["path"]).to_pylist()
    for rows, tensors in ((index, ["latent", "latent_std"]), (captions, manifest["text_tensors"])):
        for row in rows:
            file = row.get("latent_file") or row.get("text_file")
            data = Path(version.path(file)).read_bytes()
            for name in tensors:
                n = math.prod(row[cache.shape_column(name)]) * 4
                cell = data[row[f"{name}_at"] : row[f"{name}_at"] + n]
                assert row[f"{name}_xxh3"] == cache.checksum(cell)
    table = pq.read_table(version.path(index[0]["latent_file"]))
    assert table.schema.field("latent_xxh3").type == "uint64"


def test_the_reader_raises_on_a_flipped_byte_in_a_text_cell(tmp_path):
    version = synthetic_cache(tmp_path)
    manifest = version.manifest()
    captions = version.read(manifest["captions"]["path"]).to_pylist()
    caption = captions[1]
    path = Path(version.path(caption["text_file"]))
    flip_byte(path, caption["prompt_embeds_at"] + 5)
    row = row_in_file(path, "prompt_embeds", caption["prompt_embeds_at"])

    data = open_dataset(str(tmp_path), "synthetic")
    try:
        index = version.read(manifest["index"]["path"]).to_pylist()
        users = [i for i, r in enumerate(index) if r["caption_row"] == 1]
        others = [i for i, r in enumerate(index) if r["caption_row"] != 1]
        assert data.batch(others)["latent"].shape[0] == len(others)  # the others still read
        with pytest.raises(cache.ChecksumError) as caught:
            data.batch(users[:1])
    finally:
        data.close()
    message = str(caught.value)
    assert message.startswith(f"{path}: row {row}, column prompt_embeds: ")
    assert REPAIR in message


def test_the_reader_names_the_image_of_a_damaged_latent(tmp_path):
    version = synthetic_cache(tmp_path)
    index = version.read(version.manifest()["index"]["path"]).to_pylist()
    row = index[4]  # the first row of the second latents file
    path = Path(version.path(row["latent_file"]))
    flip_byte(path, row["latent_at"])
    data = open_dataset(str(tmp_path), "synthetic")
    try:
        with pytest.raises(cache.ChecksumError) as caught:
            data.batch([3, 4])
    finally:
        data.close()
    assert str(caught.value).startswith(f"{path}: row 0, column latent: ")
    assert f"(image {row['path']})" in str(caught.value)


def test_a_part_file_damaged_before_its_commit_is_not_committed(tmp_path):
    """The commit checks every cell it locates: a file that changed between its write and the
    commit is not in the cache's layout (its rows are encoded again, into a new file)."""
    version = synthetic_cache(tmp_path)
    index = version.read(version.manifest()["index"]["path"]).to_pylist()
    row = index[0]
    flip_byte(Path(version.path(row["latent_file"])), row["latent_at"] + 1)
    with pytest.raises(ValueError, match="row 0, column latent: the cell's checksum differs"):
        cells.describe(version, row["latent_file"], "float32")
