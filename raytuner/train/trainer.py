"""Driver side of training: Ray Train's TorchTrainer, and the final export from its checkpoint."""

from __future__ import annotations

import json
import logging
import os

import ray.train
from ray.train.torch import TorchTrainer

from raytuner import storage
from raytuner.config import JobConfig
from raytuner.data.cache import fingerprint, read_manifest, version_dir
from raytuner.train.loop import LoopConfig, train_loop
from raytuner.train.state import EXPORT, STATE

log = logging.getLogger(__name__)
LORA_FILE = "pytorch_lora_weights.safetensors"


def run_dir(job: JobConfig) -> str:
    return storage.join(storage.absolute(job.train.output), job.train.name)


def _scaling(job: JobConfig) -> ray.train.ScalingConfig:
    s = job.scaling
    resources = {"CPU": s.cpus_per_worker} | ({"GPU": s.gpus_per_worker} if s.use_gpu else {})
    return ray.train.ScalingConfig(
        num_workers=tuple(s.workers) if isinstance(s.workers, list) else s.workers,
        use_gpu=s.use_gpu,
        resources_per_worker=resources,
    )


def export_final(checkpoint: ray.train.Checkpoint, job: JobConfig) -> dict:
    """Copy the checkpoint's loadable LoRA to ``<output>/<name>/lora/``; return the summary."""
    fs, out = storage.resolve(storage.join(run_dir(job), EXPORT))
    with checkpoint.as_directory() as directory:
        for name in sorted(os.listdir(os.path.join(directory, EXPORT))):
            storage.copy_file(os.path.join(directory, EXPORT, name), fs, storage.join(out, name))
        with open(os.path.join(directory, STATE)) as f:
            state = json.load(f)
    return {"lora": storage.join(out, LORA_FILE), **state}


def train(job: JobConfig) -> dict:
    """Train on the committed cache of this job's model and preprocess settings."""
    fp = fingerprint(job.model, job.preprocess)
    if read_manifest(job.data.cache, fp) is None:
        raise FileNotFoundError(
            f"no committed cache at {version_dir(job.data.cache, fp)}: "
            "run `raytuner preprocess` (or `raytuner run`) first"
        )
    loop = LoopConfig(
        model=job.model,
        train=job.train,
        lora=job.lora,
        checkpoint=job.checkpoint,
        cache=storage.absolute(job.data.cache),
        fingerprint=fp,
    )
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=vars(loop),
        scaling_config=_scaling(job),
        run_config=ray.train.RunConfig(
            name=job.train.name,
            storage_path=storage.absolute(job.train.output),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.keep),
            failure_config=ray.train.FailureConfig(max_failures=job.checkpoint.max_failures),
            # Ray Train's own INFO lines (one per report and rank) drown the progress lines
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training under {run_dir(job)} ended without a checkpoint")
    return export_final(result.checkpoint, job)
