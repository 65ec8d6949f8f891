"""What a preprocess must not let through without a word: caption files that are not UTF-8
(counted and named in the report; refused with ``caption_errors = "strict"``), a source that
ends with no usable image (a regularization folder whose only image is a zero-byte file: the
run would train without prior preservation), and a full disk (named with the file it was
writing, the bytes it needed and the bytes free)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from test_full_disk import small_tmpfs

from raytuner.cli import print_report
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
from raytuner.data import cache
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
def test_a_full_disk_names_the_file_the_bytes_and_the_room_left(folders, tmp_path):
    """`raytuner preprocess` onto a full disk ends with one line naming the file, the bytes it
    needs and those free. In a process of its own (its own Ray): the failed stream's encoder
    actor outlives the error in the process that ran it (Ray Data holds it until the driver
    ends), and on the suite's shared Ray its CPU was missing to a later test's two workers
    (test_demo.py waited 400 s)."""
    with small_tmpfs(tmp_path / "small", 8192) as small:
        job = tmp_path / "job.toml"
        job.write_text(
            f'[model]\nfamily = "sdxl"\npretrained = "tiny"\n[data]\n'
            f'images = "{folders / "images"}"\ncache = "{small / "cache"}"\n'
            f'[preprocess]\nresolution = 64\nbucket_step = 16\n[train]\noutput = "{tmp_path}"\n'
        )
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        out = subprocess.run([sys.executable, "-m", "raytuner", "preprocess", str(job)],
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in out.stderr.splitlines() if line.startswith("raytuner:")]
    assert out.returncode == 1 and lines, out.stderr[-3000:]
    line = lines[-1].removeprefix("raytuner: preprocess failed: ")
    print(line)
    pattern = (
        r"OSError: \[Errno 28\] no room to write "
        + re.escape(str(small / "cache"))
        + r"/\S+ \(No space left on device\): it needs [\d,]+ bytes, [\d,]+ bytes are free "
        r"there; free space on that disk or move the folder elsewhere"
    )
    assert re.fullmatch(pattern, line), line
