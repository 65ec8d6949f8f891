"""What a preprocess must not let through without a word: caption files that are not UTF-8
(counted and named in the report; refused with ``caption_errors = "strict"``), a source that
ends with no usable image (a regularization folder whose only image is a zero-byte file: the
run would train without prior preservation), and a full disk (named with the file it was
writing, the bytes it needed and the bytes free)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from PIL import Image
from test_full_disk import small_tmpfs

from raytuner.cli import print_report
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
from raytuner.data import cache
from raytuner.errors import root_line
from raytuner.families import FAMILIES
from raytuner.preprocess.job import update_cache

MODEL = ModelConfig(family="sdxl", pretrained="tiny")
SDXL = FAMILIES["sdxl"]
PRE = PreprocessConfig(resolution=64, bucket_step=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """images/: a.png captioned in UTF-8, b.png whose caption file is binary; reg/: one
    zero-byte image."""
    root = tmp_path_factory.mktemp("refusals")
    (root / "images").mkdir()
    (root / "reg").mkdir()
    for i, name in enumerate(("a", "b")):
        Image.new("RGB", (64, 64), (i * 90, 60, 200)).save(root / "images" / f"{name}.png")
    (root / "images" / "a.txt").write_text("a photo of a blue square")
    (root / "images" / "b.txt").write_bytes(b"\xff\xfe\x00\x81\x9c binary \xc3")
    (root / "reg" / "empty.png").write_bytes(b"")
    return root


def _data(root: Path, **settings) -> DataConfig:
    return DataConfig(images=str(root / "images"), cache=str(root / "cache"), **settings)


def _generation(data: DataConfig) -> int:
    return cache.Version(data.cache, cache.fingerprint(MODEL, PRE)).generation()


@pytest.mark.slow
def test_captions_that_are_not_utf8_are_counted_and_named(ray_local, folders, capsys):
    report = update_cache(MODEL, _data(folders), PRE, family=SDXL)
    assert report["encoded"] == 2  # replaced (caption_errors = "replace"), not skipped
    assert report["captions"]["not_utf8"] == 1
    assert report["not_utf8_files"] == [{"source": str(folders / "images"), "path": "b.txt"}]
    print_report(report)
    shown = capsys.readouterr().out
    assert "0 truncated, 1 not UTF-8" in shown
    assert "caption not UTF-8 (bad bytes replaced by U+FFFD): b.txt" in shown


def test_strict_caption_errors_refuse_them_naming_the_files(ray_local, folders):
    data = _data(folders, caption_errors="strict")
    before = _generation(data)
    with pytest.raises(ValueError) as refused:
        update_cache(MODEL, data, PRE, family=SDXL)
    message = str(refused.value)
    expected = (
        f'1 caption file(s) are not UTF-8 (caption_errors = "strict"): {folders}/images/b.txt.'
    )
    assert expected in message and "Save them as UTF-8" in message
    assert _generation(data) == before  # nothing committed


def test_a_regularization_source_without_a_usable_image_fails_naming_why(ray_local, folders):
    reg = SourceConfig(path=str(folders / "reg"), regularization=True)
    data = _data(folders, sources=[reg])
    before = _generation(data)
    with pytest.raises(ValueError) as refused:
        update_cache(MODEL, data, PRE, family=SDXL)
    message = str(refused.value)
    assert "has no usable image, so the run would train without it" in message
    assert f"regularization source {folders / 'reg'}: 1 file(s) left out (empty.png: " in message
    assert "empty file" in message
    assert _generation(data) == before  # nothing committed: no run trains without it


@pytest.mark.slow  # a preprocess of its own, its encoder loaded: ~40 s
def test_a_full_disk_names_the_file_and_the_room_left_and_frees_the_encoders(
    ray_local, folders, tmp_path
):
    """A preprocess onto a full disk fails with one line naming the file, the bytes it needs
    and those free; and while its error is still held (here by ``pytest.raises``; in a notebook
    as its last exception) the failed stream's encoder actor is gone and its CPU free again.
    Before ``errors.release`` the error's frames kept the stream's ObjectRefs, whose lineage
    kept the actor alive until the driver ended: on the suite's shared Ray a later test's two
    workers waited 400 s for its CPU (test_demo.py)."""
    cpus = ray_local.cluster_resources()["CPU"]
    with small_tmpfs(tmp_path / "small", 8192) as small:
        data = DataConfig(images=str(folders / "images"), cache=str(small / "cache"))
        with pytest.raises(Exception) as failed:  # noqa: B017  (raised inside Ray: its wrapper)
            update_cache(MODEL, data, PRE, family=SDXL)
    deadline = time.monotonic() + 20
    while ray_local.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU", 0) == cpus, "an encoder still holds a CPU"
    line = root_line(failed.value)
    print(line)
    pattern = (
        r"OSError: \[Errno 28\] no room to write "
        + re.escape(str(small / "cache"))
        + r"/\S+ \(No space left on device\): it needs [\d,]+ bytes, [\d,]+ bytes are free "
        r"there; free space on that disk or move the folder elsewhere"
    )
    assert re.fullmatch(pattern, line), line
