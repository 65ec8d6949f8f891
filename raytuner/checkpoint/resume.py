"""Resuming a run: what a checkpoint must share with the job that resumes it (its identity:
``run.json``), the newest complete checkpoint of a finished run, and where an interrupted run
stands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import ray.train

from raytuner import storage
from raytuner.checkpoint import layout
from raytuner.checkpoint.layout import RUN, STATE, checkpoint_folders
from raytuner.config import ConfigError, JobConfig, LoraConfig, ModelConfig

# the sections of a run's identity whose keys grow with raytuner: a key a checkpoint lacks was
# added after it was written, and the run trained with that key's default (asdict's value of
# the section's default, with the family a run names: ModelConfig has no default for it)
_GROWING = {
    "model": lambda: asdict(ModelConfig(family="")) | {"merge_adapters": []},
    "lora": lambda: asdict(LoraConfig()),
}


def run_identity(
    model, lora, train, fingerprint: str, dataset: str, strategy: str, merged=()
) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint: the cache version,
    the dataset (its rows, in order: ``datasets.dataset_id``), the model (with the adapters merged
    into it: ``merged``, each file's path, weight and sha256: ``lora.merge.identity``), what is
    trained (mode, adapter shape, EMA, optimizer), how (``scaling.strategy``: the checkpoint's
    layout) and the schedule (the cursor means nothing under another)."""
    schedule = {k: getattr(train, k) for k in ("seed", "global_batch_size", "remainder")}
    trained = {"mode": train.mode, "ema": train.ema_decay > 0, "optimizer": train.optimizer}
    trained["strategy"] = strategy
    adapter = asdict(lora)
    del adapter["text_encoder_lr"]  # a learning rate, as train.learning_rate: may change
    model = asdict(model) | {"merge_adapters": list(merged)}
    return {"fingerprint": fingerprint, "model": model, "lora": adapter} | {
        "dataset": {"id": dataset},
        "schedule": schedule,
        "weights": trained,
    }


def identity_changes(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two run identities."""
    changes = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section), current.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changes.append(section)
    return changes


def check_resumable(
    job: JobConfig, run_dir: str, fp: str, dataset: dict, dataset_change: Callable, merged=()
) -> None:
    """Refuse to resume a run whose newest checkpoint was trained on another cache, dataset,
    model (merged adapters included: ``merged``, as ``run_identity``), adapter shape, schedule
    or strategy (ConfigError naming what changed and what to do); ``dataset_change(fs,
    checkpoint folder, dataset)`` says how its dataset differs."""
    strategy = job.scaling.strategy
    current = run_identity(job.model, job.lora, job.train, fp, dataset["id"], strategy, merged)
    fs, folders = checkpoint_folders(run_dir)
    for folder in folders:
        try:
            saved = storage.read_json(fs, storage.join(folder, RUN))
        except (OSError, ValueError):
            continue  # unreadable: the workers skip it too
        saved.get("weights", {}).setdefault("strategy", "ddp")  # before scaling.strategy
        for section, defaults in _GROWING.items():  # keys added after it was written
            added = {k: v for k, v in defaults().items() if k in current[section]}
            saved[section] = added | saved.get(section, {})
        changes = identity_changes(saved, current)
        if changes == ["dataset.id"]:
            raise ConfigError(
                f"run {run_dir} was trained on another dataset than the cache now holds "
                f"({dataset_change(fs, folder, dataset)}): its saved place in the schedule "
                "would pick other rows. Start a new run with --set checkpoint.resume=false or "
                "another train.name, or restore the images it trained on"
            )
        if "model.merge_adapters" in changes:
            raise ConfigError(
                f"run {run_dir} was trained with model.merge_adapters = "
                f"{_merged(saved['model']['merge_adapters'])}, the job has "
                f"{_merged(current['model']['merge_adapters'])}: its weights were trained on "
                "that merged model. Keep its adapters, weights and files to resume it, or start "
                "a new run with --set checkpoint.resume=false or another train.name"
            )
        if "weights.strategy" in changes:
            before = saved["weights"]["strategy"]
            raise ConfigError(
                f"run {run_dir} was trained with scaling.strategy = {before!r}, and its "
                "checkpoints are laid out for it: a run cannot switch strategy. Keep "
                f"scaling.strategy = {before!r} to resume it, or start a new run with --set "
                "checkpoint.resume=false or another train.name (from its weights: "
                "lora.init_from = its lora/ file, or model.pretrained = its model/ folder)"
            )
        if changes:
            raise ConfigError(
                f"run {run_dir} was trained with other settings ({', '.join(changes)} changed; "
                f"a changed fingerprint means other model or preprocess settings): resuming it "
                "would mix them. Use --set checkpoint.resume=false or another train.name"
            )
        return


def _merged(adapters: list[dict]) -> str:
    """Merged adapters as a resume's refusal names them: path, weight and the file's sha256."""
    shown = [f"{a['path']} x {a['weight']:g} (sha256 {a['sha256'][:12]})" for a in adapters]
    return "[" + ", ".join(shown) + "]" if shown else "none"


def finished_checkpoint(run_dir: str, max_steps: int) -> ray.train.Checkpoint | None:
    """The run's newest complete checkpoint when it has reached ``max_steps`` (with what its
    export reads): a finished run submitted again exports from it without starting any worker."""
    fs, folders = checkpoint_folders(run_dir)
    for folder in folders:
        try:
            step = storage.read_json(fs, storage.join(folder, STATE))["step"]
            layout.trained_files(fs, folder)
        except (OSError, ValueError, KeyError):
            continue  # incomplete or unreadable: the workers would skip it too
        if step >= max_steps:
            return ray.train.Checkpoint(folder, filesystem=fs)
        return None
    return None


def resume_hint(run_dir: str) -> str:
    """Where an interrupted run stands: its newest complete checkpoint, and how to resume."""
    newest = layout.complete_checkpoints(run_dir)[1][:1]
    if not newest:
        return f"run {run_dir} has no complete checkpoint yet: the same command starts it again"
    fs, folder = storage.resolve(newest[0])
    step = storage.read_json(fs, storage.join(folder, STATE))["step"]
    return (
        f"the newest complete checkpoint is step {step} ({newest[0]}): the same command "
        "resumes from it"
    )
