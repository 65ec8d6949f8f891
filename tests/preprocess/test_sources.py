"""Listing and probing dataset sources (no Ray): metadata captions, junk, symlinks, captions."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raytuner.config import SourceConfig
from raytuner.data.keys import caption_key
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.preprocess.sources import list_source, probe_row, read_metadata

TINY = Source("tiny")


def folder(tmp_path, names=("a.png", "b.png", "sub/c.png")):
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (80, 80), (len(name) * 20, 0, 0)).save(tmp_path / name)
    return tmp_path


def probe(tmp_path, source: SourceConfig) -> dict[str, dict]:
    rows = list_source(0, source)
    return {r["path"]: probe_row({**r, "known_key": ""}, [source]) for r in rows}


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_imagefolder_metadata_captions(tmp_path, kind):
    folder(tmp_path)
    rows = [{"file_name": "a.png", "text": "first"}, {"file_name": "sub/c.png", "text": "third"}]
    if kind == "jsonl":
        (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    elif kind == "csv":
        lines = ["file_name,text"] + [f"{r['file_name']},{r['text']}" for r in rows]
        (tmp_path / "metadata.csv").write_text("\n".join(lines))
    else:
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "metadata.parquet")
    (tmp_path / "b.txt").write_text("from a text file")
    probed = probe(tmp_path, SourceConfig(path=str(tmp_path)))
    assert probed["a.png"]["caption"] == "first"
    assert probed["sub/c.png"]["caption"] == "third"
    assert (probed["b.png"]["caption"], probed["b.png"]["caption_from"]) == (
        "from a text file",
        "file",
    )


def test_metadata_without_text_column_is_a_clear_error(tmp_path):
    (tmp_path / "m.jsonl").write_text(json.dumps({"file_name": "a.png", "caption": "x"}))
    with pytest.raises(ValueError, match="needs columns file_name and text"):
        read_metadata(pafs.LocalFileSystem(), str(tmp_path / "m.jsonl"))


def test_invalid_utf8_caption_is_replaced_or_skipped(tmp_path):
    folder(tmp_path, ["x.png"])
    (tmp_path / "x.txt").write_bytes(b"caf\xe9 \xff")
    tolerant = probe(tmp_path, SourceConfig(path=str(tmp_path)))["x.png"]
    assert tolerant["caption"] == "caf\ufffd \ufffd" and not tolerant["reason"]
    strict = probe(tmp_path, SourceConfig(path=str(tmp_path), caption_errors="skip"))["x.png"]
    assert strict["reason"] == "caption file is not valid UTF-8"


def test_caption_fallbacks(tmp_path):
    folder(tmp_path, ["my_cat_photo.png"])
    stem = probe(tmp_path, SourceConfig(path=str(tmp_path)))["my_cat_photo.png"]
    assert (stem["caption"], stem["caption_from"]) == ("my cat photo", "fallback")
    empty = probe(tmp_path, SourceConfig(path=str(tmp_path), caption_fallback="empty"))
    assert empty["my_cat_photo.png"]["caption"] == ""
    skip = probe(tmp_path, SourceConfig(path=str(tmp_path), caption_fallback="skip"))
    assert "no caption" in skip["my_cat_photo.png"]["reason"]


def test_junk_hidden_and_escaping_symlinks(tmp_path):
    root = folder(tmp_path / "data", ["ok.png", ".hidden.png", "__MACOSX/._ok.png", ".git/x.png"])
    outside = folder(tmp_path / "outside", ["secret.png"])
    os.symlink(outside / "secret.png", root / "link-out.png")
    os.symlink(root / "ok.png", root / "link-in.png")
    rows = {r["path"]: r for r in list_source(0, SourceConfig(path=str(root)))}
    assert set(rows) == {"ok.png", "link-out.png", "link-in.png"}
    assert rows["link-out.png"]["refused"] == "symlink outside the dataset folder"
    assert rows["link-in.png"]["refused"] == ""


def test_unchanged_files_reuse_their_known_key(tmp_path):
    folder(tmp_path, ["a.png"])
    source = SourceConfig(path=str(tmp_path))
    row = list_source(0, source)[0]
    assert probe_row({**row, "known_key": "k" * 64}, [source])["key"] == "k" * 64
    fresh = probe_row({**row, "known_key": ""}, [source])["key"]
    assert len(fresh) == 64 and fresh != "k" * 64


def test_empty_file_is_skipped_at_probe(tmp_path):
    (tmp_path / "zero.png").write_bytes(b"")
    assert probe(tmp_path, SourceConfig(path=str(tmp_path)))["zero.png"]["reason"] == "empty file"


def test_long_captions_are_counted_as_truncated():
    encoder = FAMILIES["sdxl"].text_encoder(TINY, "cpu")
    short, long = "a red circle", "a very long caption " * 10
    assert encoder.truncated([short, long]) == [False, True]
    assert len(caption_key(long)) == 64
