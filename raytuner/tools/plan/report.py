"""What `raytuner plan` prints, and its ``--gpu-memory`` argument (the figures: ``measure.py``)."""

from __future__ import annotations

import re

from raytuner.config import ConfigError
from raytuner.tools.plan import encoders

GiB = 2**30  # as plan counts (trace.GiB); imported without torch

UNITS = {"gib": GiB, "mib": 2**20, "gb": 10**9, "mb": 10**6}  # binary, then decimal
SPELLING = {"gib": "GiB", "mib": "MiB", "gb": "GB", "mb": "MB"}
SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def parse_size(text) -> int:
    """``--gpu-memory`` (and ``raytuner.plan``'s ``gpu_memory``) in bytes: a number and an
    explicit unit, ``GiB``/``MiB`` (binary) or ``GB``/``MB`` (decimal), in any case, e.g.
    ``80GiB``, ``12.5GiB``, ``24GB`` (22.4 GiB). A bare number (bytes? GiB?), ``G`` or ``M``
    (binary or decimal?) and any other text are refused, saying what to write."""
    match = SIZE.fullmatch(text) if isinstance(text, str) else None
    if match and match.group(2).lower() in UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * UNITS[match.group(2).lower()])
    n = match.group(1) if match and float(match.group(1)) > 0 else "24"
    if not isinstance(text, bool) and isinstance(text, int | float) and text > 0:
        n = f"{text / GiB:.4g}" if text >= 2**20 else f"{text:g}"  # bytes, or a size in GiB
    zero = ", more than 0," if match and not float(match.group(1)) else ""
    if match and match.group(2).lower() in ("m", "mi"):  # megabytes meant: say it in M
        raise ConfigError(
            f"--gpu-memory {text!r}: give a size{zero} and its unit: {n}MiB (binary, as "
            f"nvidia-smi counts) or {n}MB (decimal: {float(n) * 1e6 / 2**20:.1f} MiB)"
        )
    raise ConfigError(
        f"--gpu-memory {text!r}: give a size{zero} and its unit: {n}GiB (binary, as "
        f'nvidia-smi counts: a card sold as "{n} GB" holds about {n}GiB) or {n}GB (decimal: '
        f"{float(n) * 1e9 / GiB:.1f} GiB); MiB and MB work the same"
    )


def size_text(text: str) -> str:
    """How plan names the ``--gpu-memory`` it was given: ``24GiB``, or for a decimal unit also
    its GiB (``12GB = 11.2 GiB``: decimal), so that a GB meant as GiB shows."""
    number, unit = SIZE.fullmatch(text).groups()
    shown = f"{number}{SPELLING[unit.lower()]}"
    if unit.lower() in ("gb", "mb"):
        shown += f" = {parse_size(text) / GiB:.1f} GiB (GB and MB are decimal)"
    return shown


def print_plan(result: dict) -> None:
    gib, w = _gib, result["worker"]
    print(
        f"{result['family']} ({result['pretrained']}): denoiser "
        f"{w['denoiser_params'] / 1e6:,.1f} M parameters, {w['trainable_params'] / 1e6:,.2f} M "
        f"trained; bucket {result['bucket'][0]}x{result['bucket'][1]}, "
        f"{result['micro_batch']} per forward; {result['tflops_per_sample']:.4g} TFLOP a sample "
        "(forward, backward and recompute, counted)"
    )
    if w.get("text_encoder_params"):  # lora.text_encoder: on the worker, run every step
        print(
            f"  text encoders (lora.text_encoder): {w['text_encoder_params'] / 1e6:,.1f} M "
            f"parameters on the worker, {w['text_encoder_trained_params'] / 1e6:,.2f} M of "
            "their LoRA trained; every caption encoded at every step (counted above)"
        )
    if result.get("sharded"):
        _print_sharded(result)
    else:
        _print_replicated(result)
    _print_actors(result)
    verdict = "fits" if result["fits"] else "does NOT fit"
    given = result.get("gpu_memory")
    size = size_text(given) if given else gib(result["gpu_memory_bytes"])
    usable = f"{gib(result['usable_bytes'])} of it usable: {result['margin']:.0%} kept free"
    print(f"  the training worker {verdict} in {size} ({usable})")
    for s in result["suggestions"]:
        verdict = "fits" if s["fits"] else "still too big"
        if s.get("faster"):
            work = f"{s['tflops_per_sample']:.4g} TFLOP a sample"
            print(f"  faster, and fits: {s['set']}: {gib(s['peak_bytes'])} ({work})")
        else:
            print(f"  with {s['set']}: {gib(s['peak_bytes'])} ({verdict})")
    print(f"  {result['closing']}")


def _print_actors(result: dict) -> None:
    """The encoder actor, and the validation actor when the job validates, with whether each
    fits (the validation actor beside a training worker when it shares the worker's GPU)."""
    for name in ("encoder_actor", "validation_actor"):
        if (a := result[name]) is None:  # validation.every_steps = 0: no validation actor
            continue
        label, verdict = name.replace("_", " "), "fits" if a["fits"] else "does NOT fit"
        if a.get("shares_training_gpu"):
            verdict += f" beside a training worker ({_gib(a['needs_bytes'])} together)"
        print(
            f"  {label}: weights {_gib(a['weights_bytes'])}, peak {_gib(a['peak_bytes'])} "
            f"({verdict})"
        )
        if name == "encoder_actor" and result.get("text_encoder"):
            print("\n".join(encoders.lines(result["text_encoder"])))


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _print_replicated(result: dict) -> None:
    w = result["worker"]
    dtypes = ", ".join(f"{k} {_gib(v)}" for k, v in w["weights_by_dtype"].items())
    if w["blocks_to_swap"]:
        dtypes += (
            f" ({w['blocks_to_swap']} of {len(w['block_bytes'])} blocks streamed: "
            f"{_gib(w['resident_weights_bytes'])} resident)"
        )
    print(
        f"  training worker: weights {dtypes}; gradients {_gib(w['gradients_bytes'])}, "
        f"optimizer {_gib(w['optimizer_bytes'])}, EMA {_gib(w['ema_bytes'])}, DDP buckets "
        f"{_gib(w['ddp_buckets_bytes'])}, activations {_gib(w['activations_bytes'])}, "
        f"CUDA overhead {_gib(w['overhead_bytes'])}"
    )
    _print_peak(f"  training worker peak {_gib(result['peak_bytes'])}", w)


def _print_sharded(result: dict) -> None:
    """An fsdp worker at the fewest and the most workers of the job."""
    s = result["sharded"]
    for w in s["by_workers"]:
        print(
            f"  training worker of {w['workers']} (fsdp, sharded): weights "
            f"{_gib(w['weights_bytes'])}, gradients {_gib(w['gradients_bytes'])}, optimizer "
            f"{_gib(w['optimizer_bytes'])}, EMA {_gib(w['ema_bytes'])}; whole in "
            f"{s['compute_dtype']}: root {_gib(w['root_bytes'])}, blocks in flight "
            f"{_gib(w['gathered_bytes'])}, a block's gradients {_gib(w['unit_gradient_bytes'])}; "
            f"activations {_gib(w['activations_bytes'])}, CUDA overhead "
            f"{_gib(w['overhead_bytes'])}: peak {_gib(w['peak_bytes'])}"
        )
    fewest = s["by_workers"][0]["workers"]
    line = f"  training worker peak {_gib(result['peak_bytes'])} at {fewest} workers"
    _print_peak(line, s)


def _print_peak(line: str, figures: dict) -> None:
    for key in ("with", "without"):
        if f"peak_bytes_{key}_checkpointing" in figures:
            peak = figures[f"peak_bytes_{key}_checkpointing"]
            line += f" ({key} gradient checkpointing: {_gib(peak)})"
    print(line)
