"""What rank 0 tells the user about a run: a log line per window (step/max, loss, samples/s,
ETA), the dashboard's metrics, TensorBoard scalars under ``<run>/tensorboard`` and, with
``tracking.wandb``, the same scalars in the run's W&B run; and what the validation actor adds
to both (``ValidationReport``: the grids)."""

from __future__ import annotations

import datetime
import logging

from raytuner import storage
from raytuner.checkpoint.layout import TENSORBOARD
from raytuner.config import TrackingConfig
from raytuner.observe import metrics, tracking

log = logging.getLogger("raytuner.train")
PUSH_EVERY_S = 30.0  # a remote run's event files are copied at most this often between checkpoints
TRAIN_GAUGES = {  # window metric -> its dashboard gauge (declared in raytuner.observe.metrics)
    "loss": "raytuner_train_loss",
    "samples_per_s": "raytuner_train_samples_per_s",
    "step_time_s": "raytuner_train_step_time_s",
    "data_wait_fraction": "raytuner_train_data_wait_fraction",
    "tflops_per_s": "raytuner_train_tflops_per_s",
    "mfu": "raytuner_train_mfu",  # absent where the device's peak is unknown
    "hfu": "raytuner_train_hfu",
}


class EventFiles:
    """A TensorBoard writer of ``<run>/tensorboard``. For an ``s3://`` or ``gs://`` run the
    event files are written to a local temporary folder and copied to the run's folder as
    training goes (changed files only): on ``flush`` (at most every ``every_s`` seconds), on
    ``push`` and at ``close``."""

    def __init__(
        self, run_dir: str, suffix: str = "", every_s: float = 0.0, resumed: int = 0
    ) -> None:
        """``resumed``: the step a resumed run restarts from; TensorBoard then drops what an
        earlier attempt logged after it (``purge_step``), so no step shows twice."""
        from torch.utils.tensorboard import SummaryWriter

        folder, self.mirror = tracking.local_folder(run_dir, TENSORBOARD, every_s)
        purge = resumed + 1 if resumed else None
        self.writer = SummaryWriter(folder, filename_suffix=suffix, purge_step=purge)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def add_image(self, tag: str, array, step: int) -> None:
        self.writer.add_image(tag, array, step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()
        if self.mirror is not None:
            self.mirror.push()

    def push(self) -> None:
        self.writer.flush()
        if self.mirror is not None:
            self.mirror.push(force=True)

    def close(self) -> None:
        self.writer.close()
        if self.mirror is not None:
            self.mirror.close()


class Observer:
    """Rank 0's reporting; the other ranks hold none. ``job``: the resolved job (the W&B run's
    config)."""

    def __init__(
        self,
        run_dir: str,
        max_steps: int,
        tensorboard: bool,
        t: TrackingConfig | None = None,
        job: dict | None = None,
        resumed: int = 0,
    ) -> None:
        self.run = storage.basename(run_dir)
        self.max_steps = max_steps
        self.writer = None
        if tensorboard:
            self.writer = EventFiles(run_dir, every_s=PUSH_EVERY_S, resumed=resumed)
        use_wandb = t is not None and t.wandb
        self.wandb = tracking.WandbRun(t, run_dir, job, primary=True) if use_wandb else None

    def window(self, step: int, m: dict[str, float | None], lr: float) -> None:
        eta = datetime.timedelta(seconds=round((self.max_steps - step) * m["step_time_s"]))
        use = "unknown" if m.get("mfu") is None else f"{100 * m['mfu']:.1f}%"
        if m.get("hfu") is not None and m["hfu"] != m["mfu"]:  # checkpointing recomputes
            use += f", HFU {100 * m['hfu']:.1f}%"
        log.info(
            "step %d/%d loss %.4f lr %.2e %.1f samples/s %.3g TFLOP/s (MFU %s) data wait "
            "%.1f%% ETA %s",
            *(step, self.max_steps, m["loss"], lr, m["samples_per_s"], m.get("tflops_per_s", 0.0)),
            use,
            *(100 * m["data_wait_fraction"], eta),
        )
        known = {key: m[key] for key in TRAIN_GAUGES if m.get(key) is not None}
        for key, value in known.items():
            metrics.gauge(TRAIN_GAUGES[key], value, self.run)
        metrics.gauge("raytuner_train_step", step, self.run)
        scalars = known | {"lr": lr}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(f"train/{key}", value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log("train", step, scalars)

    def checkpoint(self, step: int, seconds: float) -> None:
        metrics.gauge("raytuner_checkpoint_time_s", seconds, self.run)
        if self.writer is not None:
            self.writer.add_scalar("train/checkpoint_time_s", seconds, step)
            self.writer.push()
        if self.wandb is not None:
            self.wandb.log("train", step, {"checkpoint_time_s": seconds})
            self.wandb.push()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


class ValidationReport:
    """The validation actor's grids: a TensorBoard image (``<run>/tensorboard``, an event file
    of its own) and, with ``tracking.wandb``, an image in the run's W&B run. W&B failing to
    start costs its images only (a warning); the grid PNGs are written anyway."""

    def __init__(self, run_dir: str, tensorboard: bool, t: TrackingConfig | None) -> None:
        self.writer = EventFiles(run_dir, ".validation") if tensorboard else None
        self.wandb = None
        if t is not None and t.wandb:
            try:
                self.wandb = tracking.WandbRun(t, run_dir, None, primary=False)
            except RuntimeError as e:
                log.warning("validation grids not sent to W&B: %s", e)

    def image(self, step: int, array, seconds: float) -> None:
        """``array``: the grid, height x width x RGB."""
        if self.writer is not None:
            self.writer.add_image("validation", array, step)
            self.writer.push()
        if self.wandb is not None:
            self.wandb.image(step, array, {"time_s": seconds})
            self.wandb.push()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
