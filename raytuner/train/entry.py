"""What Ray Train's controller holds of a run: the workers' entry point and their config as
bytes. The controller, an actor process of its own, unpickles both to start the workers; by
reference, the loop's module and a config holding the model family would import torch,
diffusers and the model code there too: about 10 s of CPU a run, on the CPUs the workers
import the same on. The workers unpickle the config and import the loop themselves, without the
quantization backends the run does not use (``raytuner/quantizers.py``)."""

from __future__ import annotations

import ray
from ray import cloudpickle

from raytuner import quantizers


def config(loop) -> dict:
    """``train_loop_config`` of a run's ``LoopConfig``: its fields, pickled in memory (a run's
    config in flight, never written to disk), and the quantization backend its optimizer is
    (``train.optimizer = "adamw8bit"``: bitsandbytes), which its workers keep."""
    from raytuner.train.optim import PACKAGES

    package = PACKAGES.get(loop.train.optimizer)
    keep = [package] if package in quantizers.QUANTIZERS else []
    return {"loop": cloudpickle.dumps(vars(loop)), "quantizers": keep}


def train_loop(config: dict) -> dict:
    """A Ray Train worker: ``raytuner.train.loop.train_loop`` of the config ``config`` made."""
    if ray.get_runtime_context().get_actor_id() is not None:  # a worker's process, not a driver's
        quantizers.go_without(keep=config["quantizers"])
    from raytuner.train import loop  # the worker's imports, in the worker alone

    fields = cloudpickle.loads(config["loop"])
    try:
        return loop.train_loop(fields)
    except (ImportError, ValueError, RuntimeError) as e:
        if backend := quantizers.gone_without(e):
            pretrained = fields["model"].pretrained
            raise RuntimeError(quantizers.refusal(pretrained, "denoiser", backend)) from e
        raise
