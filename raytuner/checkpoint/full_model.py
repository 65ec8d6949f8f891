"""A full fine-tune's denoiser from a checkpoint, a block at a time: the final export (a diffusers
model folder), ``raytuner sample`` and the validation renders read its weights this way, so
none of them ever holds more than one block beside what it builds (the export: one block; a
render: the model it renders with).

A checkpoint keeps the trained weights (or their EMA, which exports use where there is one) as
one safetensors file (``scaling.strategy = "ddp"``) or as the workers' rows in a Distributed
Checkpoint folder (``"fsdp"``: each block's tensors assembled from the rows of every worker
that wrote them), and the denoiser's config (``denoiser.json``); both are read where they are
(``shards.RangeReader``: ranged reads of just the block's bytes, also from object storage).

The export is diffusers' sharded layout, a file per block:
``diffusion_pytorch_model-00001-of-00058.safetensors`` …, the index
``diffusion_pytorch_model.safetensors.index.json`` (written after them) and ``config.json``,
which ``from_pretrained`` loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow.fs as pafs
import torch
from safetensors.torch import save

from raytuner import storage
from raytuner.checkpoint import checksums
from raytuner.checkpoint.layout import DENOISER, EMA, EMA_DIR, WEIGHTS, WEIGHTS_DIR
from raytuner.checkpoint.ranges import RangeReader

WEIGHTS_NAME = "diffusion_pytorch_model"  # diffusers' file name for a model's weights
INDEX = f"{WEIGHTS_NAME}.safetensors.index.json"
CONFIG = "config.json"


def block_of(name: str) -> str:
    """The block a tensor belongs to: ``transformer_blocks.3`` for a block of a list, else the
    module under the root (``proj_out``, ``mid_block``)."""
    first, _, rest = name.partition(".")
    index = rest.split(".", 1)[0]
    return f"{first}.{index}" if index.isdigit() else first


class Trained:
    """A checkpoint's trained tensors (their EMA where it has one), whole, read by name where
    the checkpoint is (``shards.RangeReader``: ranged reads, also from object storage)."""

    def __init__(self, checkpoint: str, fs: pafs.FileSystem | None = None) -> None:
        """``checkpoint``: a checkpoint folder (or a copy of its ``layout.trained_files``) on
        ``fs`` (default: the local disk). What is read is checked against the checkpoint's
        checksums where it has them: a damaged file raises ``checksums.DamagedFileError``."""
        fs = fs or pafs.LocalFileSystem()
        found = [n for n in (EMA_DIR, EMA, WEIGHTS_DIR, WEIGHTS) if _exists(fs, checkpoint, n)]
        if not found:
            raise FileNotFoundError(f"{checkpoint}: no {WEIGHTS} or {WEIGHTS_DIR}/ in it")
        self.path = storage.join(checkpoint, found[0])
        sums = checksums.Sums.read(fs, checkpoint)
        config = storage.join(checkpoint, DENOISER)
        if sums is not None:
            sums.check(fs, config)
        self.config = storage.read_json(fs, config)
        self.reader = RangeReader(fs, self.path, sums)
        self.shapes = self.reader.shapes()

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, whole, on the CPU."""
        return self.reader.read(names)

    def blocks(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(block, its tensors) one block at a time, in the model's order."""
        for block, names in self.grouped().items():
            yield block, self.read(names)

    def grouped(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for name in self.shapes:
            groups.setdefault(block_of(name), []).append(name)
        return groups


def _exists(fs: pafs.FileSystem, folder: str, name: str) -> bool:
    return storage.exists(fs, storage.join(folder, name))


def write_folder(trained: Trained, out: str, meta: dict[str, str]) -> list[str]:
    """The diffusers model folder ``out`` (a path or URI): a safetensors file per block, each
    written as soon as its block is read, then the index, ``config.json`` and ``raytuner.json``
    (``meta``); written beside the folder there and swapped in whole (``storage.folder_swap``:
    an error or an interruption leaves the old one). Returns the files written."""
    fs, root = storage.resolve(out)
    groups = trained.grouped()
    weight_map, total, files = {}, 0, []
    with storage.folder_swap(fs, root) as folder:
        for i, (_, tensors) in enumerate(trained.blocks(), start=1):
            name = f"{WEIGHTS_NAME}-{i:05d}-of-{len(groups):05d}.safetensors"
            data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
            storage.write_atomic(fs, storage.join(folder, name), data)
            weight_map |= dict.fromkeys(tensors, name)
            total += sum(v.nbytes for v in tensors.values())
            files.append(name)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        for name, record in ((INDEX, index), (CONFIG, trained.config), ("raytuner.json", meta)):
            storage.write_json_atomic(fs, storage.join(folder, name), record)
            files.append(name)
    return files


def load_denoiser(
    cls, trained: Trained, dtype: torch.dtype, device, like: torch.nn.Module | None = None
) -> torch.nn.Module:
    """The denoiser of class ``cls`` with the trained weights in ``dtype`` on ``device``, built
    empty and filled a block at a time (never a second copy of the model). ``like``: a model of
    the same architecture whose plain tensor attributes it takes (``_plain_tensors``)."""
    with torch.device("meta"):
        model = cls.from_config(trained.config)
    _plain_tensors(model, like)
    for _, tensors in trained.blocks():
        state = {
            k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()
        }
        model.load_state_dict(state, strict=False, assign=True)
    if missing := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise ValueError(
            f"{trained.path}: no trained values for {len(missing)} tensors ({missing[0]})"
        )
    return model.eval()


def _plain_tensors(model: torch.nn.Module, like: torch.nn.Module | None) -> None:
    """Tensors a module keeps as plain attributes, neither parameters nor buffers (Qwen-Image's
    rotary tables), and buffers it does not save (Wan's rotary tables: not persistent), which a
    model built on meta has on meta and no checkpoint holds: taken from the same module of
    ``like``."""
    if like is None:
        return
    theirs = dict(like.named_modules())
    for name, module in model.named_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta and name in theirs:
                setattr(module, attr, getattr(theirs[name], attr))
        for attr, value in list(module._buffers.items()):
            if value is not None and value.is_meta and name in theirs:
                module._buffers[attr] = theirs[name]._buffers[attr]
