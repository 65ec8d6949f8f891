"""Ray Train's controller, an actor process of every run, unpickles the workers' entry point,
their config and the callbacks: it imports neither the training loop nor torch's model code
(``raytuner/train/entry.py``: it cost every run about 10 s of CPU on the workers' CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys

from ray import cloudpickle

from raytuner.config import ModelConfig
from raytuner.families import FAMILIES
from raytuner.render.callback import ValidationCallback
from raytuner.train import entry

HEAVY = ("raytuner.train.loop", "raytuner.render.validation", "diffusers", "peft", "transformers")


def test_the_controller_unpickles_a_run_without_the_loop_or_the_model_code(tmp_path):
    class Loop:  # a LoopConfig's fields, the family among them
        def __init__(self) -> None:
            self.family, self.model = FAMILIES["sdxl"], ModelConfig(family="sdxl")

    blob = tmp_path / "controller.bin"
    blob.write_bytes(
        cloudpickle.dumps((entry.train_loop, entry.config(Loop()), ValidationCallback(None, 4, 8)))
    )
    code = (
        "import sys, ray.train.torch\nfrom ray import cloudpickle\n"
        f"cloudpickle.loads(open({str(blob)!r}, 'rb').read())\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
