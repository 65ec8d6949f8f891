"""Ray Train's controller, an actor process of every run, unpickles the workers' entry point,
their config and the callbacks: it imports neither the training loop nor torch's model code
(``raytuner/train/entry.py``: it cost every run about 10 s of CPU on the workers' CPUs). A
training worker imports no quantization backend but the one its optimizer is (bitsandbytes,
for ``adamw8bit``): ~1.1 s of CPU each worker a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from ray import cloudpickle

from raytuner.config import ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.render.callback import ValidationCallback
from raytuner.train import entry

HEAVY = ("raytuner.train.loop", "raytuner.render.validation", "diffusers", "peft", "transformers")


def test_the_controller_unpickles_a_run_without_the_loop_or_the_model_code(tmp_path):
    class Loop:  # a LoopConfig's fields, the family among them
        def __init__(self) -> None:
            self.family, self.model = FAMILIES["sdxl"], ModelConfig(family="sdxl")
            self.train = TrainConfig(output="runs")

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


WORKER = """
import json, sys
from raytuner import quantizers
keep, optimizer, quantized = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
quantizers.go_without(keep=keep)
import torch
from raytuner.config import LoraConfig, ModelConfig, TrainConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train import optim
from raytuner.train.model import trainable_model
train = TrainConfig(output="runs", optimizer=optimizer)
model, family = ModelConfig(family="sdxl", pretrained="tiny"), FAMILIES["sdxl"]
trained = trainable_model(model, train, LoraConfig(rank=4), family, torch.device("cpu"))
opt, _ = optim.for_run(train, trained.weights.params)
try:
    family.denoiser(Source(quantized), "cpu")
    refused = ""
except (ImportError, ValueError, RuntimeError) as e:
    refused = quantizers.gone_without(e) or repr(e)
print(json.dumps({
    "optimizer": type(opt).__name__,
    "imported": [m for m in ("peft", "bitsandbytes") if sys.modules.get(m) is not None],
    "refused": refused,
}))
"""


def _worker(keep: list[str], optimizer: str, quantized) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), json.dumps(keep), optimizer, quantized],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_worker_imports_the_quantization_backend_its_optimizer_is_and_no_other(tmp_path):
    """The keep list the driver sends (``entry.config``), in a process of its own as a
    worker's: AdamW trains a LoRA without bitsandbytes ever imported, and a denoiser whose
    weights ask for a backend gone without is refused naming it (torchao here: diffusers
    refuses bitsandbytes' on a CPU before it looks for it); 8-bit AdamW keeps bitsandbytes."""
    from diffusers import UNet2DConditionModel

    from raytuner.families import parts

    unet = UNet2DConditionModel(**parts.preset("sdxl", "tiny")["unet"]["config"])
    unet.save_pretrained(tmp_path / "unet")
    config = json.loads((tmp_path / "unet" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "torchao", "quant_type": "int8_weight_only"}
    (tmp_path / "unet" / "config.json").write_text(json.dumps(config))

    class Loop:
        def __init__(self, optimizer: str) -> None:
            self.train = TrainConfig(output="runs", optimizer=optimizer)

    plain = entry.config(Loop("adamw"))["quantizers"]
    assert plain == [] and entry.config(Loop("adamw8bit"))["quantizers"] == ["bitsandbytes"]
    got = _worker(plain, "adamw", str(tmp_path))
    assert got == {"optimizer": "AdamW", "imported": ["peft"], "refused": "torchao"}
    got = _worker(["bitsandbytes"], "adamw8bit", str(tmp_path))
    assert got["optimizer"] == "AdamW8bit" and got["imported"] == ["peft", "bitsandbytes"]
