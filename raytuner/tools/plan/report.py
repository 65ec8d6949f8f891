"""What `raytuner plan` prints, and its ``--gpu-memory`` argument (the figures: ``measure.py``)."""

from __future__ import annotations

from raytuner.config.sizes import SIZE, SPELLING, GiB, parse_size
from raytuner.tools.plan import encoders

__all__ = ["GiB", "parse_size", "print_plan", "size_text"]


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
    if result.get("strategy_choice"):  # scaling.strategy = "auto": what it decided, and why
        print(f"  {result['strategy_choice']}")
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
        each = " on its busiest GPU" if a.get("per_gpu") else ""  # a text encoder placed
        print(
            f"  {label}: weights {_gib(a['weights_bytes'])}, peak {_gib(a['peak_bytes'])}"
            f"{each} ({verdict})"
        )
        if name == "encoder_actor" and result.get("text_encoder"):
            print("\n".join(encoders.lines(result["text_encoder"])))


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _print_replicated(result: dict) -> None:
    w = result["worker"]
    dtypes = ", ".join(f"{k} {_gib(v)}" for k, v in w["weights_by_dtype"].items())
    if w["blocks_to_swap"]:
        sizes = w.get("block_groups") or [len(w["block_bytes"])]  # experts in turn: each's
        each = " of each expert" if len(sizes) > 1 else ""
        dtypes += (
            f" ({w['blocks_to_swap']} of {min(sizes)} blocks{each} streamed: "
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
