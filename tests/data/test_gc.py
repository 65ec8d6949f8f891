"""`raytuner cache gc` is safe by construction: it deletes only raytuner cache versions (named
by a fingerprint, with a manifest that says so) that are old enough and not in use (no live
lease of a preprocess or training run), never anything when the job's own version is not
committed; `--dry-run` lists what would go. A commit refuses to point at files deleted after
they were listed. Versions here are synthetic commits in the real format (no Ray needed)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from raytuner.cli import main
from raytuner.config import SourceConfig, load_job
from raytuner.data import cache, index, lease
from raytuner.tools import synthetic

SOURCES = [SourceConfig(path=synthetic.SOURCE)]  # the synthetic rows' own source
JOB = """
[model]
family = "sdxl"
[data]
images = "{root}/images"
cache = "{root}/cache"
[preprocess]
resolution = {resolution}
[train]
output = "{root}/runs"
"""


def _job(root: Path, resolution: int = 64) -> Path:
    path = root / f"job{resolution}.toml"
    path.write_text(JOB.format(root=root, resolution=resolution))
    return path


def _version(job: Path) -> cache.Version:
    j = load_job(job)
    return cache.Version(j.data.cache, cache.fingerprint(j.model, j.preprocess))


def _commit(version: cache.Version) -> dict:
    shapes = lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)}  # noqa: E731
    return synthetic.write_cache(
        version,
        buckets=[(64, 64)] * 3,
        captions=[0, 1, 0],
        repeats=[1] * 3,
        shapes=shapes,
        family="sdxl",
    )


def _age(folder: str | Path, seconds: float = 7200) -> None:
    """Make everything under ``folder`` look written ``seconds`` ago."""
    then = time.time() - seconds
    for dirpath, _, files in os.walk(folder):
        for name in files:
            os.utime(Path(dirpath, name), (then, then))
        os.utime(dirpath, (then, then))


def _gc(job: Path, *flags: str, capsys) -> tuple[int, set[str], str]:
    code = main(["cache", "gc", str(job), *flags])
    out = capsys.readouterr()
    listed = {line.split(" ", 2)[-1] for line in out.out.splitlines() if "delete" in line}
    return code, listed, out.err


def test_gc_deletes_only_old_unused_raytuner_versions(tmp_path, capsys):
    keep = _version(_job(tmp_path))
    _commit(keep)
    old, young, used = (_version(_job(tmp_path, r)) for r in (96, 128, 160))
    for version in (old, young, used):
        _commit(version)
    # not raytuner versions: another tool's folder with a manifest, a fingerprint-like name
    # whose manifest names another fingerprint
    foreign = Path(tmp_path, "cache", "notes")
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"anything": 1}))
    lookalike = Path(tmp_path, "cache", "0123456789abcdef")
    shutil.copytree(old.root, lookalike)
    for folder in (old.root, used.root, foreign, lookalike):
        _age(folder)

    with used.lease("train-somebody-else"):  # a training run on that version right now
        code, listed, _ = _gc(_job(tmp_path), "--dry-run", capsys=capsys)
        assert code == 0 and listed == {old.root}
        assert Path(old.root).is_dir()  # a dry run deletes nothing
        code, listed, _ = _gc(_job(tmp_path), capsys=capsys)
        assert code == 0 and listed == {old.root}
    assert not Path(old.root).exists()
    for kept in (keep.root, young.root, used.root, foreign, lookalike):
        assert Path(kept).is_dir(), kept
    # the lease ended with the run: the version was used a moment ago, so it counts as young
    # (its lease folder just changed) until --min-age-s says otherwise
    assert _gc(_job(tmp_path), capsys=capsys)[1] == set()
    code, listed, _ = _gc(_job(tmp_path), "--min-age-s", "0", capsys=capsys)
    assert listed == {used.root, young.root} and not Path(used.root).exists()


def test_gc_deletes_nothing_while_the_jobs_own_version_is_not_committed(tmp_path, capsys):
    other = _version(_job(tmp_path, 96))
    _commit(other)
    _age(other.root)
    code, listed, err = _gc(_job(tmp_path), "--min-age-s", "0", capsys=capsys)
    assert code == 1 and not listed
    assert "not committed" in err and "deletes nothing" in err
    assert Path(other.root).is_dir()


def test_gc_leaves_the_part_folders_of_a_version_in_use(tmp_path, capsys):
    job = _job(tmp_path)
    keep = _version(job)
    _commit(keep)
    stale = Path(keep.path("parts/20260101-000000-dead0000/latents/status=ok"))
    stale.mkdir(parents=True)
    (stale / "x.parquet").write_bytes(b"left by a run that died")
    _age(Path(keep.path("parts/20260101-000000-dead0000")))
    with keep.lease("preprocess-adding-images"):
        assert _gc(job, capsys=capsys)[1] == set()
    # an expired lease (its job was killed and stopped renewing) does not hold anything
    expired = Path(keep.path(f"{lease.LEASES}/killed.json"))
    expired.write_text(json.dumps({"holder": "killed", "expires": time.time() - 1}))
    assert keep.leases() == []
    assert _gc(job, capsys=capsys)[1] == {keep.path("parts/20260101-000000-dead0000")}


def test_gc_removes_stale_temporaries_and_writes_leave_none(tmp_path, capsys):
    job = _job(tmp_path)
    keep = _version(job)
    _commit(keep)
    leftovers = [Path(f"{keep.path('manifest.json')}.tmp-0123"), Path(keep.path("x.tmp-9"))]
    for path in leftovers:
        path.write_bytes(b"a write that died")
    _age(leftovers[0].parent)
    assert _gc(job, capsys=capsys)[1] == {str(p) for p in leftovers}
    assert not any(p.exists() for p in leftovers)
    assert not list(Path(keep.root).rglob("*.tmp-*"))  # the commits themselves left none

    from raytuner import storage

    target = tmp_path / "out.json"
    fs = storage.resolve(str(target))[0]
    with pytest.raises(ZeroDivisionError), storage.atomic_output(fs, str(target)) as f:
        f.write(b"half")
        raise ZeroDivisionError  # the writer dies mid-write
    assert not target.exists() and not list(tmp_path.glob("out.json.tmp-*"))


def test_a_commit_on_top_of_another_runs_commit_is_refused(tmp_path):
    """Two runs on one version: the one that read generation 1 cannot overwrite generation 2
    (it would drop the other run's rows); preprocess then lists again and commits on top."""
    version = _version(_job(tmp_path))
    first = _commit(version)
    assert first["generation"] == 1 and version.generation() == 1
    _commit(version)
    assert version.generation() == 2
    with pytest.raises(cache.StaleCommit):
        version.commit({**first, "report": {}}, expected=1)
    assert version.generation() == 2


def test_a_commit_refuses_files_deleted_since_they_were_listed(tmp_path):
    version = _version(_job(tmp_path))
    manifest = _commit(version)
    located = index.Located(version, "bfloat16", None)
    located.refresh()
    rows = [
        {**r, "source_index": 0, "caption": "synthetic caption 0"}
        for r in version.read(manifest["index"]["path"]).to_pylist()
    ]
    os.remove(version.path(manifest["latents"][0]["path"]))  # a gc between listing and commit
    before = version.manifest()
    with pytest.raises(RuntimeError, match="gone"):
        index.commit(version, "parts/again", rows, located, report={}, sources=SOURCES)
    assert version.manifest() == before  # the committed manifest is untouched
