"""What Ray Train's controller holds of a run: the workers' entry point and their config as
bytes. The controller, an actor process of its own, unpickles both to start the workers; by
reference, the loop's module and a config holding the model family would import torch,
diffusers and the model code there too: about 10 s of CPU a run, on the CPUs the workers
import the same on. The workers unpickle the config and import the loop themselves."""

from __future__ import annotations

from ray import cloudpickle


def config(loop) -> dict:
    """``train_loop_config`` of a run's ``LoopConfig``: its fields, pickled in memory (a run's
    config in flight, never written to disk)."""
    return {"loop": cloudpickle.dumps(vars(loop))}


def train_loop(config: dict) -> dict:
    """A Ray Train worker: ``raytuner.train.loop.train_loop`` of the config ``config`` made."""
    from raytuner.train import loop  # the worker's imports, in the worker alone

    return loop.train_loop(cloudpickle.loads(config["loop"]))
