"""The validation callback on Ray Train's controller, in a module of its own: the controller
unpickles it by reference, and this module imports no more than Ray (``validation``, the
actor's, imports torch and the pipelines: seconds of CPU in the controller of every run)."""

from __future__ import annotations

import logging

import ray
from ray.train import UserCallback

log = logging.getLogger("raytuner.validation")
QUEUE_TIMEOUT_S = 10.0  # how long the controller waits for the actor to take a checkpoint


class ValidationCallback(UserCallback):
    """On Ray Train's controller: queue each persisted validation checkpoint (a quick call)."""

    def __init__(self, validator, every_steps: int, max_steps: int) -> None:
        self.validator, self.every, self.max_steps = validator, every_steps, max_steps

    def after_report(self, run_context, metrics, checkpoint) -> None:
        step = metrics[0].get("step") if metrics else None
        if checkpoint is None or step is None:
            return
        if step % self.every and step != self.max_steps:
            return
        queued = self.validator.enqueue.remote(step, checkpoint.path, checkpoint.filesystem)
        try:
            ray.get(queued, timeout=QUEUE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:  # not started yet: the call stays queued
            log.warning(
                "validation at step %d: the validation actor has not started (are "
                "validation.cpus/gpus free?); it renders once it runs",
                step,
            )
        except ray.exceptions.RayError as e:  # the actor died: training goes on without it
            log.warning("validation at step %d not queued: %s", step, e)
