"""kohya dataset folders (``repeats_from_folder``): ``10_ohwx person/`` repeats its images 10
times as a row weight in the index, names the images it holds without a caption, shows in the
preprocess report; renaming the prefix changes the rows without encoding anything again."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from raytuner.cli import print_report
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
from raytuner.data import cache
from raytuner.families import FAMILIES
from raytuner.preprocess.job import update_cache
from raytuner.preprocess.sources import KohyaFolder, image_repeats, kohya_folder

MODEL = ModelConfig(family="sdxl", pretrained="tiny")
SDXL = FAMILIES["sdxl"]
PRE = PreprocessConfig(resolution=64, bucket_step=16)
# the kohya tree: image -> its .caption text (None: no caption file)
TREE = {
    "10_ohwx person/a.png": "ohwx person smiling",
    "10_ohwx person/b.png": None,  # captioned by its folder's class tokens
    "3_style/c.png": "overridden by metadata.jsonl",
    "3_style/sub/d.png": "a nested folder takes its nearest N_ folder's repeats",
    "plain/e.png": "a folder without the prefix keeps the source's repeats",
    "0_left out/f.png": "sd-scripts leaves 0-repeat folders out",
}


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        ("10_ohwx person/a.png", KohyaFolder("10_ohwx person", 10, "ohwx person")),
        ("10_ohwx_person/a.png", KohyaFolder("10_ohwx_person", 10, "ohwx_person")),
        ("1_2_3/a.png", KohyaFolder("1_2_3", 1, "2_3")),
        ("10_/a.png", KohyaFolder("10_", 10, "")),
        ("img/10_a/2_b/x.png", KohyaFolder("img/10_a/2_b", 2, "b")),
        ("img/10_a/sub/x.png", KohyaFolder("img/10_a", 10, "a")),
        ("007_bond/x.png", KohyaFolder("007_bond", 7, "bond")),
        ("a.png", None),
        ("10/a.png", None),
        ("x10_a/a.png", None),
        ("ten_a/a.png", None),
        ("10_a.png", None),  # a file name is not a folder
    ],
)
def test_folder_names_parse_as_sd_scripts_reads_them(rel, expected):
    assert kohya_folder(rel) == expected


def test_repeats_come_from_folders_only_when_asked():
    kohya = SourceConfig(path="img", repeats=2, repeats_from_folder=True)
    plain = SourceConfig(path="img", repeats=2)
    assert image_repeats(kohya, "10_ohwx person/a.png") == 10
    assert image_repeats(kohya, "plain/a.png") == 2
    assert image_repeats(plain, "10_ohwx person/a.png") == 2


def _committed(data: DataConfig) -> tuple[dict, dict[str, dict]]:
    version = cache.Version(data.cache, cache.fingerprint(MODEL, PRE))
    manifest = version.manifest()
    rows = version.read(manifest["index"]["path"]).to_pylist()
    return manifest, {r["path"]: r for r in rows}


@pytest.fixture(scope="module")
def kohya(ray_local, tmp_path_factory):
    """The tree preprocessed, then its 10_ folder renamed 5_ and preprocessed again."""
    root = tmp_path_factory.mktemp("kohya")
    img = root / "img"
    for i, (rel, caption) in enumerate(TREE.items()):
        (img / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), (i * 40, 255 - i * 40, 90)).save(img / rel)
        if caption is not None:
            (img / rel).with_suffix(".caption").write_text(caption)
    (img / "metadata.jsonl").write_text(
        json.dumps({"file_name": "3_style/c.png", "text": "from metadata"})
    )
    source = SourceConfig(path=str(img), caption_extension=".caption", repeats_from_folder=True)
    data = DataConfig(cache=str(root / "cache"), sources=[source])
    first = update_cache(MODEL, data, PRE, family=SDXL)
    manifest, rows = _committed(data)
    (img / "10_ohwx person").rename(img / "5_ohwx person")
    second = update_cache(MODEL, data, PRE, family=SDXL)
    renamed_manifest, renamed = _committed(data)
    return first, manifest, rows, second, renamed_manifest, renamed


@pytest.mark.slow
def test_index_rows_take_their_folders_repeats(kohya):
    report, manifest, rows, *_ = kohya
    repeats = {path: r["repeats"] for path, r in rows.items()}
    assert repeats == {
        "10_ohwx person/a.png": 10,
        "10_ohwx person/b.png": 10,
        "3_style/c.png": 3,
        "3_style/sub/d.png": 3,
        "plain/e.png": 1,
    }
    assert sum(manifest["appearances"].values()) == 2 * 10 + 2 * 3 + 1  # weights, not copies
    assert manifest["dataset"]["rows"] == 5
    skipped = {s["path"]: s["reason"] for s in report["skipped"]}
    assert "0 repeats" in skipped["0_left out/f.png"]


def test_captions_files_metadata_and_class_tokens(kohya):
    _, _, rows, *_ = kohya
    captions = {path: (r["caption"], r["caption_from"]) for path, r in rows.items()}
    assert captions["10_ohwx person/a.png"] == ("ohwx person smiling", "file")
    assert captions["10_ohwx person/b.png"] == ("ohwx person", "folder")
    assert captions["3_style/c.png"] == ("from metadata", "metadata")
    assert captions["plain/e.png"][1] == "file"


def test_the_report_shows_each_folders_images_and_repeats(kohya, capsys):
    report, *_ = kohya
    folders = {
        f["folder"]: (f["images"], f["repeats"], f["name_captions"]) for f in report["folders"]
    }
    assert folders == {"10_ohwx person": (2, 10, 1), "3_style": (2, 3, 0), "": (1, 1, 0)}
    print_report(report)
    shown = capsys.readouterr().out
    assert "folder 10_ohwx person: 2 images x 10 repeats, 1 captioned by its name" in shown
    assert "folder 3_style: 2 images x 3 repeats" in shown
    assert "folder (no N_ prefix): 1 images x 1 repeats" in shown


def test_renamed_prefix_changes_the_rows_without_encoding_again(kohya):
    _, manifest, _, second, renamed_manifest, renamed = kohya
    assert second["encoded"] == 0 and second["already_cached"] == 5
    assert renamed["5_ohwx person/a.png"]["repeats"] == 5
    assert renamed["5_ohwx person/b.png"]["repeats"] == 5
    assert sum(renamed_manifest["appearances"].values()) == 2 * 5 + 2 * 3 + 1
    assert renamed_manifest["dataset"]["id"] != manifest["dataset"]["id"]


@pytest.mark.slow
def test_a_kohya_tree_as_data_images_takes_its_folders(ray_local, tmp_path, capsys):
    """``data.images`` at a kohya tree: ``10_ohwx cat/`` repeats its images 10 times and
    captions them with its class tokens (before: 1 repeat, captioned by their stems "004" and
    "005"). A [[data.sources]] folder without ``repeats_from_folder`` trains its ``3_style/``
    with its own repeats, and the report says which key would take its N."""
    cats, other = tmp_path / "cats" / "10_ohwx cat", tmp_path / "other" / "3_style"
    cats.mkdir(parents=True)
    other.mkdir(parents=True)
    for i, path in enumerate((cats / "004.png", cats / "005.png", other / "a.png")):
        Image.new("RGB", (64, 64), (i * 80, 120, 200)).save(path)
    (other / "a.txt").write_text("a style")
    source = SourceConfig(path=str(tmp_path / "other"))
    data = DataConfig(
        images=str(tmp_path / "cats"), cache=str(tmp_path / "cache"), sources=[source]
    )
    report = update_cache(MODEL, data, PRE, family=SDXL)
    manifest, rows = _committed(data)
    assert {p: (r["repeats"], r["caption"]) for p, r in rows.items()} == {
        "10_ohwx cat/004.png": (10, "ohwx cat"),
        "10_ohwx cat/005.png": (10, "ohwx cat"),
        "3_style/a.png": (1, "a style"),
    }
    assert sum(manifest["appearances"].values()) == 2 * 10 + 1
    print_report(report)
    shown = capsys.readouterr().out
    assert "folder 10_ohwx cat: 2 images x 10 repeats, 2 captioned by its name" in shown
    assert (
        "folder 3_style: 1 images x 1 repeats (its name says 3: set repeats_from_folder = true "
        "on its source to take it)"
    ) in shown
    assert "(no N_ prefix)" not in shown  # neither source has images outside a kohya folder
