"""Edit / reference-image datasets (``preprocess/pairs.py``): a target's references found by
stem in a references folder (musubi-tuner's ``control_directory``, ai-toolkit's
``control_path`` folder) or named by its metadata row (``control_path``, ``control_path_0`` …),
a missing, ambiguous or undecodable reference skips its target naming it, and the references
are cached once like images: a rerun encodes nothing, a changed reference only itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from raytuner.api import preprocess, sample, train
from raytuner.config import SourceConfig, load_job
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.preprocess.sources import list_source, probe_row
from raytuner.preprocess.worklist import report_lines

SIDE = 64


def _image(path: Path, seed: int, size=(SIDE, SIDE)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def _listed(source: SourceConfig) -> dict[str, dict]:
    """A source's targets by path, and its reference files as ``ref:<path>``."""
    rows = list_source(0, source, reference_index=1)
    return {("ref:" if r["source"] else "") + r["path"]: r for r in rows}


def test_references_by_stem_in_a_folder_and_what_skips_a_target(tmp_path):
    data, control = tmp_path / "data", tmp_path / "data" / "control"
    for i, name in enumerate(["one.png", "two.png", "none.png", "both.png", "sub/deep.png"]):
        _image(data / name, i)
    _image(control / "one.png", 10)  # one reference, the same name
    _image(control / "two_0.png", 11)  # two, numbered
    _image(control / "two_1.jpg", 12)
    _image(control / "both.png", 13)  # one name in two formats: which?
    _image(control / "both.jpg", 14)
    _image(control / "sub" / "deep.webp", 15)  # subfolders mirrored, any image format
    rows = _listed(SourceConfig(path=str(data), references="control"))
    targets = {p: r for p, r in rows.items() if r["role"] == "target"}
    assert sorted(targets) == ["both.png", "none.png", "one.png", "sub/deep.png", "two.png"]
    assert targets["one.png"]["references"] == ["one.png"] and not targets["one.png"]["refused"]
    assert targets["two.png"]["references"] == ["two_0.png", "two_1.jpg"]
    assert targets["sub/deep.png"]["references"] == ["sub/deep.webp"]
    assert targets["none.png"]["refused"].startswith("no reference image: neither none.<ext>")
    assert "both.jpg, both.png (keep one)" in targets["both.png"]["refused"]
    references = sorted(p for p, r in rows.items() if r["role"] == "reference")
    assert references == ["ref:one.png", "ref:sub/deep.webp", "ref:two_0.png", "ref:two_1.jpg"]
    assert {r["source"] for r in rows.values() if r["role"] == "reference"} == {1}


def test_references_named_by_the_metadata_table_are_no_targets(tmp_path):
    data = tmp_path / "data"
    for i, name in enumerate(["a.png", "b.png", "c.png", "in/a.png", "in/b0.png", "in/b1.png"]):
        _image(data / name, i)
    lines = [
        {"file_name": "a.png", "text": "make it red", "control_path": "in/a.png"},
        {"file_name": "b.png", "text": "two", "control_path_0": "in/b0.png",
         "control_path_1": "in/b1.png"},
        {"file_name": "c.png", "text": "gone", "control_path": "in/c.png"},
    ]  # fmt: skip
    (data / "metadata.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    source = SourceConfig(path=str(data))
    rows = _listed(source)
    targets = {p: r for p, r in rows.items() if r["role"] == "target"}
    assert sorted(targets) == ["a.png", "b.png", "c.png"]  # in/*.png are references
    assert targets["a.png"]["references"] == ["in/a.png"]
    assert targets["b.png"]["references"] == ["in/b0.png", "in/b1.png"]
    assert targets["c.png"]["refused"] == f"reference 'in/c.png' is missing (in {data})"
    probed = probe_row({**targets["a.png"], "known_key": ""}, [source])
    assert probed["caption"] == "make it red" and not probed["reason"]


def test_a_reference_linked_out_of_its_folder_skips_its_target(tmp_path):
    secret = tmp_path / "secret.png"
    _image(secret, 0)
    data, control = tmp_path / "data", tmp_path / "control"
    _image(data / "a.png", 1)
    control.mkdir()
    os.symlink(secret, control / "a.png")
    rows = _listed(SourceConfig(path=str(data), references=str(control)))
    assert rows["a.png"]["refused"] == "reference 'a.png' is a symlink outside its folder"
    assert [r["role"] for r in rows.values()] == ["target"]
    with pytest.raises(ValueError, match="references folder .* is not a folder"):
        list_source(0, SourceConfig(path=str(data), references="nowhere"), reference_index=1)


JOB = """
[model]
family = "{family}"

[data]
cache = "{root}/cache"

[[data.sources]]
path = "{root}/edits"
references = "control"

[preprocess]
resolution = 64
bucket_step = 16

[train]
output = "{root}/runs"
max_steps = 4
global_batch_size = 2
"""


def _edits(root: Path) -> None:
    """4 targets with a reference each (t3's the same bytes as t0's); t4 with two (Kontext
    takes one), t5 whose reference is no image, t6 with none, t7 whose reference is of another
    bucket."""
    edits, control = root / "edits", root / "edits" / "control"
    for i in range(8):
        _image(edits / f"t{i}.png", i)
        (edits / f"t{i}.txt").write_text(f"make picture {i} red")
    for i in range(3):
        _image(control / f"t{i}.png", 100 + i)
    _image(control / "t3.png", 100)  # t0's reference again: encoded once
    _image(control / "t4_0.png", 104)
    _image(control / "t4_1.png", 105)
    (control / "t5.png").write_bytes(b"not a png at all")
    _image(control / "t7.png", 107, (2 * SIDE, SIDE))


@pytest.fixture(scope="module")
def edited(ray_local, tmp_path_factory):
    """The edit dataset, its job and the report of its first preprocess (tiny Flux.1
    Kontext)."""
    root = tmp_path_factory.mktemp("edits")
    _edits(root)
    (root / "job.toml").write_text(JOB.format(family="flux-kontext", root=root))
    return root, preprocess(load_job(root / "job.toml"))


def test_the_report_counts_pairs_and_names_a_missing_or_undecodable_reference(edited):
    root, report = edited
    skipped = {s["path"]: s["reason"] for s in report["skipped"]}
    assert skipped["t6.png"].startswith("no reference image: neither t6.<ext>")
    assert skipped["t5.png"].startswith("reference 't5.png': not an image")
    assert skipped["t7.png"].startswith(
        "reference 't7.png' falls in bucket 80x48, its target in 64x64: an edit pair's"
    )
    assert skipped["t4.png"] == "2 reference images; flux-kontext takes at most 1"
    assert len(skipped) == 4 and report["total"] == 8
    # 4 targets, 3 distinct references (t3's is t0's bytes), each encoded once
    assert report["pairs"] == {"targets": 4, "references": 3, "per_target": 1, "encoded": 3}
    assert report["encoded"] == 4 and report["already_cached"] == 0
    lines = "\n".join(report_lines(report))
    assert "pairs: 4 targets with 3 reference images (up to 1 each; 3 encoded now)" in lines
    assert "skipped t5.png: reference 't5.png'" in lines


@pytest.mark.slow
def test_a_rerun_encodes_nothing_and_a_changed_reference_only_itself(edited, tmp_path):
    root, _ = edited
    again = preprocess(load_job(root / "job.toml"))
    assert again["encoded"] == 0 and again["pairs"]["encoded"] == 0
    assert again["pairs"]["targets"] == 4
    _image(root / "edits" / "control" / "t1.png", 999)
    changed = preprocess(load_job(root / "job.toml"))
    assert changed["encoded"] == 0 and changed["pairs"]["encoded"] == 1
    data = _dataset(root)
    i = data.paths.index("t1.png")
    expected = _pipeline_encode(root / "edits" / "control" / "t1.png")
    got = data.batch([i])["reference_latent"][0, 0]
    # stored in bfloat16 (preprocess.dtype): its rounding
    torch.testing.assert_close(got, expected.to(torch.bfloat16).float(), rtol=0, atol=2e-2)


def _dataset(root: Path):
    job = load_job(root / "job.toml")
    return open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))


def _pipeline_encode(path: Path) -> torch.Tensor:
    """``FluxKontextPipeline``'s own encode of a reference image (of its bucket's size: no
    crop), as its ``__call__`` preprocesses it and ``prepare_latents`` encodes it."""
    pipe = FAMILIES["flux-kontext"].pipeline(Source("tiny"))
    image = Image.open(path).convert("RGB")
    pixels = pipe.image_processor.preprocess(image, image.height, image.width)
    with torch.no_grad():
        return pipe._encode_vae_image(pixels, generator=None)[0]


def test_a_batch_carries_each_targets_reference(edited):
    root, _ = edited
    data = _dataset(root)
    order = [data.paths.index(p) for p in ("t2.png", "t0.png", "t3.png")]
    batch = data.batch(order)
    assert batch["reference_count"].tolist() == [1, 1, 1]
    refs = batch["reference_latent"]
    assert refs.shape == (3, 1, *batch["latent"].shape[1:])
    torch.testing.assert_close(refs[1, 0], refs[2, 0])  # t3's reference is t0's
    expected = _pipeline_encode(root / "edits" / "control" / "t2.png").to(torch.bfloat16)
    torch.testing.assert_close(refs[0, 0], expected.float(), rtol=0, atol=2e-2)
    assert (refs[0, 0] - batch["latent"][0]).abs().max() > 0.1  # not the target's latent


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_edit_run_trains_on_two_workers_and_samples_with_its_reference(edited, tmp_path):
    """The pairs train (tiny Flux.1 Kontext, 2 workers, the references in every batch); the
    trained LoRA renders another image with the target's reference than without."""
    root, _ = edited
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        (root / "job.toml").read_text().replace(f"{root}/runs", f"{tmp_path}/runs")
        + "\n[scaling]\nworkers = 2\ncpus_per_worker = 0.5\n"
    )
    job = load_job(job_file, ["train.learning_rate=1e-2"])
    summary = train(job)
    assert summary["step"] == 4 and np.isfinite(summary["loss"])
    reference = str(root / "edits" / "control" / "t0.png")

    def render(out: str, references=()) -> np.ndarray:
        (path,) = sample(
            job, ["make picture 0 red"], steps=2, out=str(tmp_path / out), references=references
        )
        return np.asarray(Image.open(path), dtype=np.float32)

    assert np.abs(render("with", [reference]) - render("without")).max() > 2
    record = json.loads((tmp_path / "with" / "samples.json").read_text())
    assert record["lines"][0]["references"] == [reference]


def test_check_refuses_pairs_and_reference_images_for_a_family_without_them(tmp_path):
    from raytuner.api import check
    from raytuner.config import ConfigError
    from raytuner.render.prompts import PromptsError, check_line, parse_line

    _image(tmp_path / "edits" / "t0.png", 0)
    _image(tmp_path / "edits" / "control" / "t0.png", 1)
    (tmp_path / "job.toml").write_text(JOB.format(family="flux", root=tmp_path))
    with pytest.raises(ConfigError, match=r"data.sources\[0\].references = 'control': flux takes"):
        check(load_job(tmp_path / "job.toml"))
    (tmp_path / "job.toml").write_text(JOB.format(family="flux-kontext", root=tmp_path))
    with pytest.raises(ConfigError, match='references = .control. with flip = "random"'):
        check(load_job(tmp_path / "job.toml", ['data.flip="random"']))
    line = parse_line(f"make it red --ci {tmp_path}/edits/t0.png --d 1", 3)
    assert line.references == (f"{tmp_path}/edits/t0.png",) and line.seed == 1
    with pytest.raises(PromptsError, match="line 3: --ci: flux takes no reference image"):
        check_line(line, FAMILIES["flux"])
    check_line(line, FAMILIES["flux-kontext"])
    gone = parse_line("make it red --ci nowhere.png", 4)
    with pytest.raises(PromptsError, match="line 4: --ci nowhere.png: no such file"):
        check_line(gone, FAMILIES["flux-kontext"])
