"""The final export, what the user takes away from a run's checkpoint into its run folder: a
LoRA's ``lora/`` (the checkpoint's export, copied file by file) or a full fine-tune's
``model/<part>/`` (a diffusers folder written a block at a time from its trained weights,
``full_model.py``); every byte read checked against the checkpoint's checksums, the folder
swapped in whole."""

from __future__ import annotations

import pyarrow.fs as pafs
import ray.train

from raytuner import storage
from raytuner.checkpoint import checksums, full_model, layout
from raytuner.checkpoint.layout import (
    DIFFUSERS_FILE,
    EXPORT,
    EXPORT_META,
    KOHYA_FILE,
    LORA_DIR,
    MODEL_DIR,
    STATE,
)


def final(checkpoint: ray.train.Checkpoint, output: str, name: str, part: str) -> dict:
    """What the user takes away, from the checkpoint into ``<output>/<name>/``: a LoRA's
    ``lora/`` (the checkpoint's export, copied), or a full fine-tune's ``model/<part>/`` (a
    diffusers folder written a block at a time from its trained weights); return the summary:
    where the files went, and the checkpoint's state. Never reads the optimizer state. Every
    byte read is checked against the checkpoint's checksums (a damaged file raises
    ``checksums.DamagedFileError``), and the folder is written beside the old one and swapped
    in whole (``storage.folder_swap``): a failed or interrupted export leaves the previous."""
    uri = layout.run_dir(output, name)  # what the user reads: s3:// kept
    source = checkpoint.filesystem
    state = storage.read_json(source, storage.join(checkpoint.path, STATE))
    if layout.trained_files(source, checkpoint.path) != [EXPORT]:
        _export_model(checkpoint, storage.join(uri, MODEL_DIR, part))
        return {"model": storage.join(uri, MODEL_DIR)} | state
    fs, run = storage.resolve(uri)
    sums = checksums.Sums.read(source, checkpoint.path)
    # file by file from where the checkpoint is, streamed: never the optimizer state, never a
    # whole file in memory (the driver may be a small head)
    root = storage.join(checkpoint.path, EXPORT, LORA_DIR)
    selector = pafs.FileSelector(root, recursive=True)
    files = [i.path for i in source.get_file_info(selector) if i.type == pafs.FileType.File]
    with storage.folder_swap(fs, storage.join(run, LORA_DIR)) as out:
        for path in sorted(files):
            target = storage.join(out, path[len(root) + 1 :])
            if sums is None:  # a checkpoint written before checksums
                storage.copy_stream(source, path, fs, target)
            else:
                sums.copy(source, path, fs, target)
    return _lora_paths(storage.join(uri, LORA_DIR), [p[len(root) + 1 :] for p in files]) | state


def _lora_paths(lora: str, names: list[str]) -> dict:
    """The summary's paths of an exported ``lora/`` holding ``names``: its diffusers file and
    its kohya file where the family has one; for a run of every expert of a mixture, the
    folder and each expert's diffusers file (``experts``: ``lora/<expert>/``)."""
    if DIFFUSERS_FILE not in names:
        experts = sorted(n.split("/")[0] for n in names if n.endswith(f"/{DIFFUSERS_FILE}"))
        files = {e: storage.join(lora, e, DIFFUSERS_FILE) for e in experts}
        return {"lora": lora, "experts": files}
    paths = {"lora": storage.join(lora, DIFFUSERS_FILE)}
    if KOHYA_FILE in names:  # not every family's
        paths["kohya"] = storage.join(lora, KOHYA_FILE)
    return paths


def _export_model(checkpoint: ray.train.Checkpoint, out: str) -> None:
    """A full fine-tune's diffusers folder at ``out`` from the checkpoint's trained weights
    (their EMA where kept), read where they are and written a block at a time
    (``lora/full_model.py``), with what the checkpoint says of its export (``raytuner.json``)."""
    fs, folder = checkpoint.filesystem, checkpoint.path
    trained = full_model.Trained(folder, fs)
    path, sums = storage.join(folder, EXPORT_META), checksums.Sums.read(fs, folder)
    if sums is not None:
        sums.check(fs, path)
    meta = storage.read_json(fs, path)
    meta["raytuner.checkpoint"] = storage.basename(folder)
    meta["raytuner.weights"] = storage.basename(trained.path)  # the EMA where there is one
    full_model.write_folder(trained, out, meta)
