"""What rank 0 tells the user about a run: a log line per window (step/max, loss, samples/s,
ETA), the dashboard's metrics, and TensorBoard scalars under ``<run>/tensorboard``."""

from __future__ import annotations

import datetime
import logging
import os

from raytuner import metrics, storage

log = logging.getLogger("raytuner.train")
TENSORBOARD = "tensorboard"  # <run>/tensorboard: event files (scalars, validation images)


def tensorboard_dir(run_dir: str) -> str | None:
    """The run's TensorBoard folder; None for remote outputs (event files need a local disk)."""
    return None if "://" in run_dir else os.path.join(storage.absolute(run_dir), TENSORBOARD)


def summary_writer(run_dir: str, suffix: str = ""):
    folder = tensorboard_dir(run_dir)
    if folder is None:
        log.warning("train.output %s is remote: no TensorBoard event files", run_dir)
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(folder, filename_suffix=suffix)


class Observer:
    """Rank 0's reporting; the other ranks hold none."""

    def __init__(self, run_dir: str, max_steps: int, tensorboard: bool) -> None:
        self.run = storage.basename(run_dir)
        self.max_steps = max_steps
        self.writer = summary_writer(run_dir) if tensorboard else None

    def window(self, step: int, m: dict[str, float], lr: float) -> None:
        eta = datetime.timedelta(seconds=round((self.max_steps - step) * m["step_time_s"]))
        log.info(
            "step %d/%d loss %.4f lr %.2e %.1f samples/s data wait %.1f%% ETA %s",
            *(step, self.max_steps, m["loss"], lr, m["samples_per_s"]),
            *(100 * m["data_wait_fraction"], eta),
        )
        for key in ("loss", "samples_per_s", "step_time_s", "data_wait_fraction"):
            metrics.gauge(f"raytuner_train_{key}", m[key], self.run)
        metrics.gauge("raytuner_train_step", step, self.run)
        if self.writer is not None:
            for key in ("loss", "samples_per_s", "step_time_s", "data_wait_fraction"):
                self.writer.add_scalar(f"train/{key}", m[key], step)
            self.writer.add_scalar("train/lr", lr, step)
            self.writer.flush()

    def checkpoint(self, step: int, seconds: float) -> None:
        metrics.gauge("raytuner_checkpoint_time_s", seconds, self.run)
        if self.writer is not None:
            self.writer.add_scalar("train/checkpoint_time_s", seconds, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
