"""A rerun over an unchanged folder holding files the preprocess rejects (a corrupt image, a
clip too short for its frame counts) reads none of them again and starts no encoder actor (at
full size: tens of GB of VAE and text encoder loaded, minutes): each rejected file is
remembered with its size and mtime, as an indexed file is (``data/trust.py``), and reported in
the category of the first run. A rejected file whose size or mtime changed, or whose decode
settings did, is probed again. On a real local Ray with the tiny Wan (clips and images)."""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from clip_files import clip
from PIL import Image

from raytuner.config import DataConfig, ModelConfig, PreprocessConfig
from raytuner.data import verify
from raytuner.data.cache import Version, fingerprint, rejected_tables
from raytuner.data.datasets import merged
from raytuner.families import FAMILIES
from raytuner.preprocess.job import update_cache

WAN = FAMILIES["wan"]
MODEL = ModelConfig(family="wan", pretrained="tiny")
PRE = PreprocessConfig(resolution=64, bucket_step=16, min_size=32, dtype="float32")
CORRUPT = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 16  # a PNG's signature, then noise


def folder(root: Path) -> Path:
    """A good image, a corrupt one and a clip of 7 frames (too short for 9, enough for 5),
    each with its caption."""
    media = root / "media"
    media.mkdir()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(media / "good.png")
    (media / "bad.png").write_bytes(CORRUPT)
    (media / "short.mp4").write_bytes(clip(7, 24))
    for name in ("good", "bad", "short"):
        (media / f"{name}.txt").write_text(f"a file called {name}")
    return media


def valid_png_of_size(size: int) -> bytes:
    """A valid 64x64 PNG padded with zeros after its end to ``size`` bytes (decoders stop at
    its IEND chunk): what a rerun that reads the file again would encode."""
    out = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(out, "PNG")
    return out.getvalue() + bytes(size - len(out.getvalue()))


def stable(report: dict) -> dict:
    """A report less its times (``stages`` says which steps ran: checked apart)."""
    times = {"seconds", "images_per_s", "first_encoded_s", "stages"}
    return {k: v for k, v in report.items() if k not in times}


def no_encoder_ran(report: dict) -> bool:
    """No encoder actor took a block, nothing was written: only the probe ran (the stages
    ``encode``, ``load`` and ``write`` are an encoder actor's and the sink's)."""
    return not {"encode", "load", "write"} & set(report["stages"])


@pytest.mark.slow
def test_an_unchanged_rejected_file_costs_a_rerun_nothing(ray_local, tmp_path):
    media = folder(tmp_path)
    data = DataConfig(images=str(media), cache=str(tmp_path / "cache"), frames=[9])
    first = update_cache(MODEL, data, PRE, family=WAN)
    reasons = {s["path"]: s["reason"] for s in first["skipped"]}
    assert reasons["bad.png"].startswith("corrupt: ") and set(reasons) == {"bad.png", "short.mp4"}
    assert reasons["short.mp4"].startswith("too_short: 7 frames give 7")
    assert (first["encoded"], first["already_cached"], first["clips"]["too_short"]) == (1, 0, 1)
    assert not no_encoder_ran(first)

    # nothing changed: the same report (the rejected files in their categories), no encoder
    again = update_cache(MODEL, data, PRE, family=WAN)
    assert stable(again) == stable(first) | {"encoded": 0, "already_cached": 1}
    assert no_encoder_ran(again), again["stages"]

    # other bytes of the same size with the mtime put back: not read, so not noticed (a rerun
    # trusts a rejected file as it trusts an indexed one)
    stat = (media / "bad.png").stat()
    (media / "bad.png").write_bytes(valid_png_of_size(len(CORRUPT)))
    os.utime(media / "bad.png", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    trusted = update_cache(MODEL, data, PRE, family=WAN)
    assert stable(trusted) == stable(again) and no_encoder_ran(trusted), trusted["stages"]

    # its mtime changed: read again, now valid, encoded; the clip under other frame counts
    # (data.frames [5]: the 7 frames give a sample) is probed again and trained
    os.utime(media / "bad.png")
    fewer = dataclasses.replace(data, frames=[5])
    fixed = update_cache(MODEL, fewer, PRE, family=WAN)
    assert fixed["skipped"] == [] and (fixed["encoded"], fixed["already_cached"]) == (2, 1)
    assert (fixed["clips"]["trained"], fixed["clips"]["too_short"]) == (1, 0)


@pytest.mark.slow
def test_cache_verify_names_an_altered_rejected_table_and_repair_probes_its_files_again(
    ray_local, tmp_path
):
    """The table of rejected files is hashed like every file the manifest names: altered, it is
    a bad file of `cache verify`; quarantined (`--repair`), the next preprocess probes the
    rejected files again and commits a table that verifies."""
    media = folder(tmp_path)
    data = DataConfig(images=str(media), cache=str(tmp_path / "cache"), frames=[9])
    first = update_cache(MODEL, data, PRE, family=WAN)
    version = Version(data.cache, fingerprint(MODEL, PRE))
    assert verify.verify(version) == []
    (entry,) = rejected_tables(version.manifest())
    table = version.read(entry["path"])
    sizes = [size + 1 for size in table.column("size").to_pylist()]
    altered = table.set_column(table.schema.get_field_index("size"), "size", pa.array(sizes))
    pq.write_table(altered, version.path(entry["path"]))  # still a table, its rows intact

    bad = verify.verify(version)
    assert bad == [{"path": entry["path"], "problem": "sha256 differs from the manifest"}]
    assert verify.quarantine(version, bad) == [entry["path"]]
    again = update_cache(MODEL, data, PRE, family=WAN)
    assert stable(again) == stable(first) | {"encoded": 0, "already_cached": 1}
    assert verify.verify(version) == []
    (table,) = rejected_tables(version.manifest())
    assert version.read(table["path"]).column("size").to_pylist() != sizes


def test_a_dataset_whose_rejected_table_is_gone_keeps_its_files_and_drops_the_table():
    """Another job's dataset whose rejected table a repair set aside stays in the version (its
    job probes those files again); one whose index is gone is dropped, as before."""

    def dataset(name: str, rejected: bool) -> dict:
        d = {
            "sources": [{"path": f"/data/{name}"}],
            "files": {"latents": [f"{name}/l.parquet"], "text": [f"{name}/t.parquet"]},
            "index": {"path": f"{name}/index.parquet"},
            "captions": {"path": f"{name}/captions.parquet"},
        }
        return d | ({"rejected": {"path": f"{name}/rejected.parquet"}} if rejected else {})

    held = {"a": dataset("a", True), "b": dataset("b", True), "c": dataset("c", False)}
    gone = {"a/rejected.parquet", "b/index.parquet"}
    kept, dropped = merged(held, "mine", {"x": 1}, lambda rel: rel not in gone)
    assert kept == {"a": {k: v for k, v in held["a"].items() if k != "rejected"},
                    "c": held["c"], "mine": {"x": 1}}  # fmt: skip
    assert dropped == ["/data/b"]
