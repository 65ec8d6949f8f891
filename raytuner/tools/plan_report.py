"""What `raytuner plan` prints, and its ``--gpu-memory`` argument (the figures: ``plan.py``)."""

from __future__ import annotations

import re

from raytuner.config import ConfigError
from raytuner.tools.plan import GiB


def parse_size(text: str) -> int:
    """``80GiB``, ``24GB``, ``12G`` (GiB), or a number of bytes."""
    units = {"gib": GiB, "gb": 10**9, "g": GiB, "mib": 2**20, "mb": 10**6, "": 1}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in units:
        raise ConfigError(f"--gpu-memory {text!r}: use a size such as 80GiB, 24GB or 12G")
    return int(float(match.group(1)) * units[match.group(2)])


def print_plan(result: dict) -> None:
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    w = result["worker"]
    print(
        f"{result['family']} ({result['pretrained']}): denoiser "
        f"{w['denoiser_params'] / 1e6:,.1f} M parameters, {w['trainable_params'] / 1e6:,.2f} M "
        f"trained; bucket {result['bucket'][0]}x{result['bucket'][1]}, "
        f"{result['micro_batch']} per forward"
    )
    dtypes = ", ".join(f"{k} {gib(v)}" for k, v in w["weights_by_dtype"].items())
    if w["blocks_to_swap"]:
        dtypes += (
            f" ({w['blocks_to_swap']} of {len(w['block_bytes'])} blocks streamed: "
            f"{gib(w['resident_weights_bytes'])} resident)"
        )
    print(
        f"  training worker: weights {dtypes}; gradients {gib(w['gradients_bytes'])}, "
        f"optimizer {gib(w['optimizer_bytes'])}, EMA {gib(w['ema_bytes'])}, DDP buckets "
        f"{gib(w['ddp_buckets_bytes'])}, activations {gib(w['activations_bytes'])}, "
        f"CUDA overhead {gib(w['overhead_bytes'])}"
    )
    line = f"  training worker peak {gib(result['peak_bytes'])}"
    for key in ("with", "without"):
        if f"peak_bytes_{key}_checkpointing" in w:
            line += f" ({key} gradient checkpointing: {gib(w[f'peak_bytes_{key}_checkpointing'])})"
    print(line)
    for name in ("encoder_actor", "validation_actor"):
        a = result[name]
        label = name.replace("_", " ")
        print(f"  {label}: weights {gib(a['weights_bytes'])}, peak {gib(a['peak_bytes'])}")
    verdict = "fits" if result["fits"] else "does NOT fit"
    print(f"  the training worker {verdict} in {gib(result['gpu_memory_bytes'])}")
    for s in result["suggestions"]:
        verdict = "fits" if s["fits"] else "still too big"
        print(f"  with {s['set']}: {gib(s['peak_bytes'])} ({verdict})")
