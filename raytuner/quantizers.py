"""diffusers' quantization backends, which a process of raytuner's may go without.

diffusers imports every quantization backend it finds installed as soon as any of its models is
imported (peft imports bitsandbytes too): bitsandbytes costs a process about 1.1 s of CPU at its
start, torchao more. An encoder actor never needs them, a training worker only for the optimizer
that is bitsandbytes' (``train.optimizer = "adamw8bit"``): raytuner loads no quantized
checkpoint. Such a process, one of Ray's that runs nothing else, does without them.
"""

from __future__ import annotations

import sys

QUANTIZERS = ("bitsandbytes", "torchao")


def go_without(keep=()) -> None:
    """Keep diffusers, transformers and peft from importing ``QUANTIZERS`` (less ``keep``) in
    this process: Python then reports them not installed there. Only for a process of its own
    (an actor's), before diffusers is imported: one that imported it has looked for them
    already, and keeps them."""
    if "diffusers" not in sys.modules and "peft" not in sys.modules:
        for name in QUANTIZERS:
            if name not in keep:
                sys.modules.setdefault(name, None)


def gone_without(error: BaseException) -> str | None:
    """The backend ``go_without`` left out that ``error`` (of loading a model) asks for."""
    return next((q for q in QUANTIZERS if q in str(error) and sys.modules.get(q, 0) is None), None)


def refusal(pretrained: str, part: str, backend: str) -> str:
    """What to change when the weights of ``pretrained`` are quantized for ``backend``."""
    return (
        f"the {part} of model.pretrained = {pretrained!r} asks for {backend} (a "
        "quantization_config in its config.json): raytuner loads unquantized weights (it "
        "stores them in float8 itself: model.dtype); point model.pretrained at weights "
        "without one"
    )
