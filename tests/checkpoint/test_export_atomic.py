"""An export is written beside the previous one and swapped in whole (``storage.folder_swap``):
interrupted anywhere (Ctrl-C, a SIGKILL, a damaged checkpoint file), the previous export stays
as it was, never a mix of two steps; the next export tidies what a killed one left.

Before, each file was replaced on its own: Ctrl-C during the export of a full fine-tune over an
older one left ``model/transformer/`` with some files of each step, labelled with the older one,
which ``from_pretrained`` loads; a truncated weights file crashed the export half-way.

The interruptions are real: a ``KeyboardInterrupt`` raised by the writer at a file boundary (what
Ctrl-C raises there), and a process SIGKILLed by its own writer after two files. No Ray needed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import ray.train
import torch
from test_checkpoint_damage import _checkpoint

from raytuner import storage
from raytuner.checkpoint import checksums, files, layout
from raytuner.checkpoint.export import final as export_final
from raytuner.config import LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train.model import adapt


def _full_checkpoint(folder: Path, step: int) -> Path:
    """The checkpoint of a full fine-tune of the tiny SD1.5 UNet at ``step``, as a worker writes
    it (its weights all ``step``, so two steps' files differ)."""
    family = FAMILIES["sd15"]
    weights = adapt(
        family.denoiser(Source("tiny")),
        mode="full",
        lora=LoraConfig(),
        targets=family.adapters.targets,
        ema_decay=0.0,
    )
    with torch.no_grad():
        for p in weights.params:
            p.fill_(step)
    opt = torch.optim.AdamW(weights.params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    records = {layout.EXPORT_META: {"raytuner.steps": str(step)}}
    folder.mkdir(parents=True)
    state = files.TrainState(step=step)
    files.save_checkpoint(str(folder), weights, opt, sched, state, records, None)
    return folder


def _lora_checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    _checkpoint(folder, steps=step)
    return folder


def _export(folder: Path, out: Path) -> dict:
    checkpoint = ray.train.Checkpoint(str(folder), filesystem=pafs.LocalFileSystem())
    return export_final(checkpoint, str(out), "job", "unet")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _weights(files: dict[str, bytes]) -> list[str]:
    """The files that hold a step's weights (a model's config is the same at every step)."""
    return [name for name in files if name.endswith(".safetensors")]


@contextlib.contextmanager
def _interrupted_at_file(monkeypatch, n: int):
    """Ctrl-C as the export starts its ``n``-th file (``storage.atomic_output``, which every
    exported file goes through)."""
    opened, original = [], storage.atomic_output

    @contextlib.contextmanager
    def writer(fs, path, *args, **kwargs):
        opened.append(path)
        if len(opened) == n:
            raise KeyboardInterrupt
        with original(fs, path, *args, **kwargs) as f:
            yield f

    monkeypatch.setattr(storage, "atomic_output", writer)
    with pytest.raises(KeyboardInterrupt):
        yield
    monkeypatch.setattr(storage, "atomic_output", original)
    assert len(opened) == n


MAKE = {"full": (_full_checkpoint, Path(layout.MODEL_DIR, "unet")), "lora": (_lora_checkpoint,
        Path(layout.LORA_DIR))}  # fmt: skip


@pytest.mark.parametrize("mode", sorted(MAKE))
def test_an_export_interrupted_over_an_older_one_leaves_the_older_one_whole(
    mode, tmp_path, monkeypatch
):
    make, exported = MAKE[mode]
    out = tmp_path / "out"
    _export(make(tmp_path / "checkpoint_1", 1), out)
    before = _files(out / "job" / exported)
    assert len(before) >= 2
    newer = make(tmp_path / "checkpoint_2", 2)
    with _interrupted_at_file(monkeypatch, 2):
        _export(newer, out)
    assert _files(out / "job" / exported) == before
    assert sorted(os.listdir(out / "job" / exported.parent)) == [exported.name]  # no sibling

    _export(newer, out)  # uninterrupted: the new export, whole
    after = _files(out / "job" / exported)
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in _weights(after))


def test_a_truncated_weights_file_fails_the_export_naming_it_and_keeps_the_older_one(tmp_path):
    """With checksums (a size differs from the one written) and without (a checkpoint written
    before them: the file ends before its header says its tensors do)."""
    out = tmp_path / "out"
    _export(_full_checkpoint(tmp_path / "checkpoint_1", 1), out)
    before = _files(out / "job" / layout.MODEL_DIR)
    for with_sums in (True, False):
        folder = _full_checkpoint(tmp_path / f"checkpoint_2_{with_sums}", 2)
        if not with_sums:
            shutil.rmtree(folder / layout.CHECKSUMS)
        weights = folder / layout.WEIGHTS
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size * 2 // 3])
        with pytest.raises(checksums.DamagedFileError, match=rf"^{weights}: .*truncated"):
            _export(folder, out)
        assert _files(out / "job" / layout.MODEL_DIR) == before


KILLED = """
import os, signal, sys
import pyarrow.fs as pafs
import ray.train
from raytuner import storage
from raytuner.checkpoint.export import final as export_final

written, original = [], storage.write_atomic
def write_atomic(fs, path, data):
    if len(written) == 2:  # SIGKILLed after two whole files
        os.kill(os.getpid(), signal.SIGKILL)
    original(fs, path, data)
    written.append(path)
storage.write_atomic = write_atomic
checkpoint = ray.train.Checkpoint(sys.argv[1], filesystem=pafs.LocalFileSystem())
export_final(checkpoint, sys.argv[2], "job", "unet")
"""


def test_an_export_killed_midway_leaves_the_older_one_and_the_next_export_tidies_up(tmp_path):
    out, model = tmp_path / "out", tmp_path / "out" / "job" / layout.MODEL_DIR
    _export(_full_checkpoint(tmp_path / "checkpoint_1", 1), out)
    before = _files(model / "unet")
    newer = _full_checkpoint(tmp_path / "checkpoint_2", 2)
    killed = subprocess.run([sys.executable, "-c", KILLED, str(newer), str(out)], timeout=300)
    assert killed.returncode == -9
    assert _files(model / "unet") == before
    left = [p for p in os.listdir(model) if p != "unet"]
    assert len(left) == 1 and left[0].startswith("unet.tmp-"), left  # the unfinished one

    _export(newer, out)
    assert os.listdir(model) == ["unet"]
    after = _files(model / "unet")
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in _weights(after))


def test_a_swap_without_renameat2_is_whole_too(tmp_path, monkeypatch):
    """Where the filesystem cannot exchange two folders in one rename: two renames."""
    monkeypatch.setattr(storage, "_exchange", lambda a, b: False)
    target, fs = tmp_path / "lora", pafs.LocalFileSystem()
    for content in (b"old", b"new"):
        with storage.folder_swap(fs, str(target)) as folder:
            Path(folder, "file").write_bytes(content)
    assert (target / "file").read_bytes() == b"new" and os.listdir(tmp_path) == ["lora"]
