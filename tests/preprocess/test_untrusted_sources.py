"""Dataset folders as an attacker or a careless sync leaves them (no Ray): caption files,
metadata tables and folders that link out of the dataset are refused like images already are,
folder loops do not hang the listing, oversized captions and metadata are skipped or refused
with their reason, and images are hashed in pieces."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest
from PIL import Image

from raytuner.config import SourceConfig
from raytuner.preprocess import sources
from raytuner.preprocess.sources import list_source, probe_row


def _images(root, names=("a.png", "b.png")):
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (80, 80), (len(name) * 20, 0, 0)).save(root / name)
    return root


def _probe(root) -> dict[str, dict]:
    source = SourceConfig(path=str(root))
    return {r["path"]: probe_row({**r, "known_key": ""}, [source]) for r in list_source(0, source)}


def test_a_caption_linked_to_a_file_outside_never_reaches_the_cache(tmp_path):
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_text("aws_secret_access_key = hunter2")
    data = _images(tmp_path / "data")
    os.symlink(secret, data / "a.txt")
    (data / "b.txt").write_text("a red circle")
    probed = _probe(data)
    assert probed["a.png"]["reason"] == "caption file is a symlink outside the dataset folder"
    assert "hunter2" not in json.dumps(probed)
    assert probed["b.png"]["caption"] == "a red circle" and not probed["b.png"]["reason"]


def test_a_metadata_table_linked_outside_is_refused(tmp_path):
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps({"file_name": "a.png", "text": "stolen"}))
    data = _images(tmp_path / "data")
    os.symlink(outside, data / "metadata.jsonl")
    with pytest.raises(ValueError, match="symlink outside the dataset folder"):
        list_source(0, SourceConfig(path=str(data)))


def test_folder_links_out_of_the_dataset_and_loops_are_not_walked(tmp_path):
    outside = _images(tmp_path / "outside", ("private.png",))
    data = _images(tmp_path / "data", ("a.png", "sub/b.png"))
    os.symlink(outside, data / "linked-out")  # a folder link out of the dataset
    os.symlink("..", data / "sub" / "up")  # a loop back to the dataset root
    os.symlink(data / "sub", data / "same-sub")  # a link inside: its files once, not twice
    listed: list = []
    walker = threading.Thread(
        target=lambda: listed.extend(list_source(0, SourceConfig(path=str(data))))
    )
    walker.start()
    walker.join(timeout=30)
    assert not walker.is_alive(), "the listing hung on a folder loop"
    paths = sorted(r["path"] for r in listed)
    assert paths == ["a.png", "sub/b.png"] or paths == ["a.png", "same-sub/b.png"], paths
    assert not any("private" in p for p in paths)


def test_an_oversized_caption_file_is_skipped_with_its_reason(tmp_path):
    data = _images(tmp_path / "data")
    (data / "a.txt").write_text("x" * (sources.MAX_CAPTION_BYTES + 1))
    probed = _probe(data)
    assert probed["a.png"]["reason"] == f"caption file over {sources.MAX_CAPTION_BYTES:,} bytes"
    assert probed["a.png"]["caption"] == ""


def test_an_oversized_metadata_table_is_refused(tmp_path, monkeypatch):
    data = _images(tmp_path / "data")
    (data / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "t"}) * 40)
    monkeypatch.setattr(sources, "MAX_METADATA_BYTES", 1000)  # the documented limit is 1 GiB
    with pytest.raises(ValueError, match="over the 1,000 allowed"):
        list_source(0, SourceConfig(path=str(data)))


def test_images_are_hashed_in_pieces(tmp_path, monkeypatch):
    """A piece much smaller than the image: the key is still the whole content's sha256."""
    data = _images(tmp_path / "data", ("a.png",))
    monkeypatch.setattr(sources, "HASH_CHUNK", 16)
    whole = (data / "a.png").read_bytes()
    assert len(whole) > 10 * 16
    assert _probe(data)["a.png"]["key"] == hashlib.sha256(whole).hexdigest()
