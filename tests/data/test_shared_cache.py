"""Jobs that share one ``data.cache`` (the same model and encoding, so one cache version): each
trains the rows of its own sources, never another job's, whatever order they preprocessed in.

Three jobs on tiny SDXL: "cats" (3 images, two half-transparent, with ``data.flip`` and
``data.mask = "alpha"``), "dogs" (2 other images) and "plain" (the cats' folder without flips
or masks). Before, the cache version's manifest held one index, the last commit's: `raytuner
train` of cats after dogs preprocessed trained the dogs, and after "plain" preprocessed it
trained the cats without a flip or a mask; `raytuner cache gc` of one job deleted the other's
encoded files.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from raytuner.api import preprocess, train
from raytuner.checkpoint import layout
from raytuner.cli import main
from raytuner.config import load_job
from raytuner.data import cache
from raytuner.train import sample_log

# preprocess runs of several jobs into one cache (~20 s a fixture): the whole suite runs them
pytestmark = pytest.mark.slow

SIDE = 64  # one 64x64 bucket
JOB = """
[model]
family = "sdxl"
pretrained = "tiny"

[data]
images = "{images}"
cache = "{cache}"
flip = "{flip}"
mask = "{mask}"

[preprocess]
resolution = 64
bucket_step = 16

[train]
output = "{root}/runs"
name = "{name}"
epochs = 1
global_batch_size = 1
sample_log = true
log_every = 1

[scaling]
workers = 1
cpus_per_worker = 0.5

[checkpoint]
every_steps = 100
"""
# job -> (its image folder, flip, mask)
JOBS = {
    "cats": ("cats", "random", "alpha"),
    "dogs": ("dogs", "none", "none"),
    "plain": ("cats", "none", "none"),
}


def _images(root: Path) -> dict[str, list[str]]:
    """The cats (two of them half transparent) and the dogs; each folder's file names."""
    made = {"cats": [], "dogs": []}
    for folder, count in (("cats", 3), ("dogs", 2)):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            name = f"{folder[:-1]}{i}.png"
            color = (40 * i, 200 if folder == "cats" else 30, 90, 255)
            image = Image.new("RGBA", (SIDE, SIDE), color)
            if folder == "cats" and i < 2:
                image.paste((0, 0, 0, 0), (0, 0, SIDE // 2, SIDE))  # the left half transparent
            image.save(root / folder / name)
            (root / folder / name).with_suffix(".txt").write_text(f"a {folder[:-1]} number {i}")
            made[folder].append(name)
    return made


def _job_file(root: Path, cache_dir: Path, name: str) -> Path:
    folder, flip, mask = JOBS[name]
    path = root / f"{name}.toml"
    run = f"{name}-{cache_dir.name}"
    path.write_text(
        JOB.format(root=root, images=root / folder, cache=cache_dir, flip=flip, mask=mask, name=run)
    )
    return path


def _committed_id(job) -> str:
    """The dataset id the last commit of the job's cache version holds (its newest one)."""
    version = cache.Version(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    return version.manifest()["dataset"]["id"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("shared")
    return root, _images(root)


@pytest.mark.slow  # per case two or three preprocesses and a training run: ~1-2 min
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("first", "later"),
    [("cats", ["dogs", "plain"]), ("dogs", ["cats"])],
    ids=["cats-then-dogs-then-plain-cats", "dogs-then-cats"],
)
def test_a_job_trains_its_own_rows_after_other_jobs_preprocessed(
    ray_local, images, first, later, caplog
):
    """Each order of the two jobs; the cats with flips and masks also after the same folder
    without them committed last."""
    root, made = images
    cache_dir = root / f"cache-{first}"
    cache_dir.mkdir()
    jobs = {n: load_job(_job_file(root, cache_dir, n)) for n in (first, *later)}
    preprocess(jobs[first])
    expected_id = _committed_id(jobs[first])
    for name in later:  # committed last: the version's newest dataset is another job's
        preprocess(jobs[name])
        assert _committed_id(jobs[name]) != expected_id

    with caplog.at_level("INFO", logger="raytuner.train.trainer"):
        summary = train(jobs[first])
    folder = JOBS[first][0]
    run_dir = layout.run_dir(jobs[first].train.output, jobs[first].train.name)
    trained = sorted(p for ids in sample_log.trained(run_dir).values() for p in ids)
    assert trained == sorted(made[folder])  # its own images, each once (one epoch)
    assert summary["step"] == len(made[folder])

    newest = layout.complete_checkpoints(run_dir)[1][0]
    record = json.loads(Path(newest, layout.DATASET).read_text())
    assert record["id"] == expected_id  # the rows, flips and masks its own preprocess committed
    version = cache.Version(record["cache"], record["fingerprint"])
    rows = version.read(record["index"]).to_pylist()
    flips = [bool(r["flip_file"]) for r in rows]
    masks = [bool(r["mask_key"]) for r in rows]
    if first == "cats":  # every cat has its mirror image, the two transparent ones a mask
        assert flips == [True] * 3 and masks == [True, True, False]
    else:
        assert not any(flips) and not any(masks)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dataset ")]
    assert said and said[0].startswith(f"dataset {expected_id}: {len(made[folder])} images")
    assert str(root / folder) in said[0]


@pytest.fixture(scope="module")
def shared(ray_local, images):
    """The dogs and the plain cats preprocessed, in that order, into one cache."""
    root, made = images
    cache_dir = root / "cache-shared"
    cache_dir.mkdir()
    files = {n: _job_file(root, cache_dir, n) for n in JOBS}
    jobs = {n: load_job(files[n]) for n in JOBS}
    reports = {n: preprocess(jobs[n]) for n in ("dogs", "plain")}
    return root, files, jobs, reports


def test_train_refuses_a_job_whose_rows_the_cache_lacks_naming_them(shared):
    """The cats with flips and masks never preprocessed: `train` names what is missing,
    the nearest dataset it holds (the same folder without them) and the command to run."""
    root, _, jobs, _ = shared
    with pytest.raises(FileNotFoundError) as refused:
        train(jobs["cats"])
    message = str(refused.value)
    assert "holds no dataset of this job's sources" in message
    assert f"{root / 'cats'} (flip 'random', mask 'alpha')" in message
    assert "flip = 'none' there, 'random' here" in message
    assert "Run `raytuner preprocess`" in message


def test_a_rerun_keeps_the_other_jobs_rows_and_encodes_nothing(shared):
    root, _, jobs, _ = shared
    report = preprocess(jobs["dogs"])  # the plain cats committed last
    assert report["encoded"] == 0 and report["already_cached"] == 2
    version = cache.Version(
        jobs["dogs"].data.cache, cache.fingerprint(jobs["dogs"].model, jobs["dogs"].preprocess)
    )
    held = version.manifest()["datasets"]
    assert sorted(d["sources"][0]["path"] for d in held.values()) == [
        str(root / "cats"),
        str(root / "dogs"),
    ]
    assert sorted(d["dataset"]["rows"] for d in held.values()) == [2, 3]


def test_gc_of_one_job_keeps_the_files_of_the_others(shared, capsys):
    root, files, jobs, _ = shared
    version = cache.Version(
        jobs["dogs"].data.cache, cache.fingerprint(jobs["dogs"].model, jobs["dogs"].preprocess)
    )
    before = sorted(p.name for p in Path(version.path("parts")).iterdir())
    assert main(["cache", "gc", str(files["dogs"]), "--min-age-s", "0"]) == 0
    print(capsys.readouterr().out)
    after = sorted(p.name for p in Path(version.path("parts")).iterdir())
    assert after == before  # the plain cats' encoded files too
    assert main(["cache", "verify", str(files["plain"])]) == 0


def test_a_moved_folder_is_found_by_content_and_encodes_nothing_again(shared):
    """A folder no dataset has read yet (here the dogs, copied elsewhere) reads every dataset's
    index: its images are in the cache under the old folder."""
    root, _, jobs, _ = shared
    moved = shutil.copytree(root / "dogs", root / "dogs-moved")
    data = dataclasses.replace(jobs["dogs"].data, images=str(moved))
    report = preprocess(dataclasses.replace(jobs["dogs"], data=data))
    assert (report["encoded"], report["already_cached"]) == (0, 2)
