"""The run folder: its one owner. Every name of a file or folder in it, the run's name, where a
job's run lives, its checkpoints, the newest complete one and where the exported weights are.

    <train.output>/<run>/                  run: train.name, or <name>-<YYYYmmdd-HHMMSS> when
                                           checkpoint.resume = false found <name> taken
      checkpoint_<timestamp>_step-<N>/     written by the workers through ray.train.report
      checkpoint_manager_snapshot.json     Ray Train's list of the checkpoints it registered
        scaling.strategy = "ddp" (rank 0 writes):
          weights.safetensors  ema.safetensors  optimizer.pt
        scaling.strategy = "fsdp" (every worker writes its rows, no pickle):
          weights/  ema/  optimizer/       shard-<rank>-model-00001-of-00001.safetensors each
          optimizer.json                   param groups, LR schedule (rank 0)
        denoiser.json  export.json         full fine-tunes: the denoiser's config, the export's
                                           raytuner.json
        run.json  job.json  dataset.json
        export/lora/                       LoRA runs: both LoRA layouts
        checksums/rank-<r>.json            every worker's files' checksums (xxh3-64)
        state.json  (rank 0, once every worker's files are in place: a folder without it is
                    incomplete)
      lora/pytorch_lora_weights.safetensors  lora/lora_kohya.safetensors   (LoRA runs)
      model/<denoiser part>/               (full fine-tunes)
      validation/step_<N>.png|json   tensorboard/   samples/<attempt>/   wandb/  wandb_run_id
      validation/step_<N>/<i>-<prompt>-seed<s>.mp4   (video families: each clip rendered;
                                           step_<N>.png is the grid of their posters)

Nothing here imports torch: the CLI, the validation actor and `sample` use it as well as the
training workers.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import time

import pyarrow.fs as pafs

from raytuner import storage

# in every checkpoint folder
CHECKPOINT_PREFIX = "checkpoint_"  # Ray Train names them checkpoint_<timestamp>
WEIGHTS = "weights.safetensors"  # the trained tensors: the LoRA adapter, or the whole denoiser
EMA = "ema.safetensors"  # their moving average, when train.ema_decay > 0
OPTIMIZER = "optimizer.pt"
STATE = "state.json"
RUN = "run.json"  # cache fingerprint and the settings a resume must not change
JOB = "job.json"  # the resolved job config that trained up to this checkpoint (a record)
DATASET = "dataset.json"  # the committed dataset it trained on: id, rows, index, manifest hash
EXPORT = "export"  # what the user takes away, inside every LoRA run's checkpoint (lora/)
# scaling.strategy = "fsdp": DCP folders of safetensors files, each worker's rows in its own file
WEIGHTS_DIR = "weights"
EMA_DIR = "ema"
OPTIMIZER_DIR = "optimizer"
OPTIMIZER_JSON = "optimizer.json"  # fsdp: the optimizer's param groups and the LR schedule
DENOISER = "denoiser.json"  # full fine-tunes: the denoiser's config (a model folder's config.json)
EXPORT_META = "export.json"  # full fine-tunes: what the exported model folder says of itself
CHECKSUMS = "checksums"  # rank-<r>.json: each worker's files' checksums (raytuner/checksums.py)
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the checkpoints it registered

# in the run folder (and, for the first two, inside a checkpoint's export/)
LORA_DIR = "lora"  # a LoRA's export: <run>/lora/
MODEL_DIR = "model"  # a full fine-tune's export: <run>/model/<denoiser part>/
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"  # in lora/: diffusers/peft keys
KOHYA_FILE = "lora_kohya.safetensors"  # in lora/: kohya keys
VALIDATION = "validation"  # step_<N>.png and step_<N>.json; clips in step_<N>/
CLIP_SUFFIX = ".mp4"  # a rendered clip (validation/step_<N>/, `raytuner sample --out`)
TENSORBOARD = "tensorboard"  # event files (scalars, validation images)
SAMPLES = "samples"  # the sample log: <attempt>/step_<N>.json
WANDB = "wandb"  # W&B's local files (offline runs, its logs)
WANDB_RUN_ID = "wandb_run_id"  # the W&B run id of every attempt of the run

log = logging.getLogger("raytuner.train")
_FRESH = re.compile(r"-\d{8}-\d{6}$")  # the suffix of a run started with resume = false


def validation_step(step: int) -> str:
    """The name of a validation render's grid and record (``.png``, ``.json``) and of the folder
    of its clips, in ``<run>/validation``: ``step_<N>``."""
    return f"step_{step:06d}"


def run_dir(output: str, name: str) -> str:
    """``<output>/<name>``, the output made absolute (URIs kept)."""
    return storage.join(storage.absolute(output), name)


def choose_run(output: str, name: str, resume: bool) -> str:
    """The run a job trains: ``name``; with ``checkpoint.resume = false`` and ``name`` taken,
    a fresh, timestamped run beside it (the old one is left alone)."""
    fs, path = storage.resolve(run_dir(output, name))
    if resume or not storage.exists(fs, path):
        return name
    fresh = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    log.warning("checkpoint.resume = false: starting run %s instead of resuming %s", fresh, path)
    return fresh


def checkpoint_name(step: int) -> str:
    """A new checkpoint's folder name: Ray Train's (``checkpoint_<timestamp>``, what orders
    them) and the step it holds, as kohya names its saves:
    ``checkpoint_2026-11-25_10-00-00.123456_step-000100``."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")
    return f"{CHECKPOINT_PREFIX}{stamp}_step-{step:06d}"


def trained_files(fs: pafs.FileSystem, checkpoint: str) -> list[str]:
    """What renders and exports read of a checkpoint (paths inside it), never its optimizer
    state: a LoRA run's export, or a full fine-tune's weights (their EMA where it has one, as
    exports use it) and the denoiser's config."""
    if storage.exists(fs, storage.join(checkpoint, EXPORT)):
        return [EXPORT]
    for name in (EMA_DIR, EMA, WEIGHTS_DIR, WEIGHTS):
        if storage.exists(fs, storage.join(checkpoint, name)):
            return [name, DENOISER]
    raise FileNotFoundError(f"{checkpoint} holds no trained weights ({EXPORT}/ or {WEIGHTS})")


def checkpoint_folders(run: str) -> tuple[pafs.FileSystem, list[str]]:
    """The run's checkpoint folders, newest first (Ray names them by timestamp), complete or
    not."""
    fs, root = storage.resolve(run)
    if not storage.exists(fs, root):
        return fs, []
    folders = [
        info.path
        for info in storage.listdir(fs, root)
        if info.base_name.startswith(CHECKPOINT_PREFIX) and info.type == pafs.FileType.Directory
    ]
    return fs, sorted(folders)[::-1]


def complete_checkpoints(run: str) -> tuple[pafs.FileSystem, list[str]]:
    """The checkpoint folders that hold their ``state.json`` (written last), newest first."""
    fs, folders = checkpoint_folders(run)
    return fs, [f for f in folders if storage.exists(fs, storage.join(f, STATE))]


def registered_checkpoints(run: str) -> set[str] | None:
    """The checkpoint folders (names) Ray Train's snapshot lists: those it deletes itself once
    they are beyond ``checkpoint.keep``, and expects to find when it restores the list. None
    when the snapshot cannot be read (Ray rewrites it in place)."""
    fs, root = storage.resolve(run)
    path = storage.join(root, SNAPSHOT)
    try:
        if not storage.exists(fs, path):
            return set()
        results = storage.read_json(fs, path)["checkpoint_results"]
        return {r["checkpoint_dir_name"] for r in results}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune_checkpoints(run: str, keep: int, running: bool = False) -> list[str]:
    """Delete the run's checkpoint folders that are neither among its newest ``keep`` complete
    ones nor on Ray Train's list: the checkpoints of reports Ray never registered (an
    interrupted driver's last ones, which a resume starts from all the same) and half-written
    folders, once newer ones replace them. Ray deletes the ones it listed. Returns what went.
    Nothing is deleted while Ray's list cannot be read. ``running``: called while Ray Train
    runs, which may be deleting a folder it has just taken off its list: only folders newer
    than the oldest it lists go (the older ones at the next driver start)."""
    registered = registered_checkpoints(run)
    if registered is None:
        return []
    fs, folders = checkpoint_folders(run)
    complete = [f for f in folders if storage.exists(fs, storage.join(f, STATE))]
    kept = set(complete[:keep])
    gone = [f for f in folders if f not in kept and storage.basename(f) not in registered]
    if running:
        oldest = min(registered, default=None)
        gone = [f for f in gone if oldest is not None and storage.basename(f) > oldest]
    for folder in gone:
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile (a restarted group's)
            fs.delete_dir(folder)
    return gone


def job_runs(output: str, name: str) -> list[str]:
    """Every run of the job named ``name``: ``<name>`` and its ``<name>-<timestamp>`` runs."""
    fs, root = storage.resolve(storage.absolute(output))
    if not storage.exists(fs, root):
        return []
    names = [
        info.base_name
        for info in storage.listdir(fs, root)
        if info.type == pafs.FileType.Directory
        and (info.base_name == name or _fresh_of(info.base_name, name))
    ]
    return [run_dir(output, n) for n in sorted(names)]


def _fresh_of(folder: str, name: str) -> bool:
    return folder.startswith(f"{name}-") and bool(_FRESH.fullmatch(folder[len(name) :]))


def latest_checkpoint(output: str, name: str) -> tuple[pafs.FileSystem, str] | None:
    """The newest complete checkpoint of any run of the job: after a run started with
    ``checkpoint.resume = false``, that run's, not the older one's it was started beside."""
    newest = None
    for run in job_runs(output, name):
        fs, folders = complete_checkpoints(run)
        if folders and (newest is None or _stamp(folders[0]) > _stamp(newest[1])):
            newest = (fs, folders[0])
    return newest


def _stamp(folder: str) -> str:
    return storage.basename(folder)[len(CHECKPOINT_PREFIX) :]
