"""Trained weights where a user points: a checkpoint folder, its ``export/``, a run's ``lora/`` or
``model/`` folder, or a LoRA ``.safetensors`` file (diffusers or kohya keys), on local disk;
what `raytuner sample` and the validation actor load. A full fine-tune's checkpoint holds no
export: its weights are read from it (``lora/full_model.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raytuner.checkpoint.layout import (
    DENOISER,
    DIFFUSERS_FILE,
    EXPORT,
    KOHYA_FILE,
    LORA_DIR,
    MODEL_DIR,
)


@dataclass(frozen=True)
class ExportedWeights:
    """Trained weights on local disk: a LoRA safetensors file or a model folder holding
    ``<denoiser part>/``."""

    kind: str  # "lora" | "model" | "checkpoint" (a full fine-tune's checkpoint folder)
    path: str
    # a run of every expert of a mixture (model.expert = "both"): (expert, its LoRA file) of
    # each, from lora/<expert>/; ``path`` is the first's
    experts: tuple[tuple[str, str], ...] = ()


def _experts(lora: Path) -> ExportedWeights | None:
    """The LoRA of each expert in ``lora``'s sub-folders (``lora/<expert>/``), or None."""
    found = sorted((f.parent.name, str(f)) for f in lora.glob(f"*/{DIFFUSERS_FILE}"))
    return ExportedWeights("lora", found[0][1], tuple(found)) if found else None


def find_weights(path: str) -> ExportedWeights:
    """What a user may point at: a checkpoint folder, its ``export/``, the run's ``lora/`` or
    ``model/`` folder (a run of every expert: ``lora/<expert>/`` each), a LoRA safetensors file
    (diffusers or kohya keys)."""
    p = Path(path)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{path}: a LoRA file must be .safetensors")
        return ExportedWeights("lora", str(p))
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    for folder in (p / EXPORT, p):
        if (folder / LORA_DIR / DIFFUSERS_FILE).is_file():
            return ExportedWeights("lora", str(folder / LORA_DIR / DIFFUSERS_FILE))
        if (experts := _experts(folder / LORA_DIR)) is not None:
            return experts
        if (folder / MODEL_DIR).is_dir():
            return ExportedWeights("model", str(folder / MODEL_DIR))
    if (p / DENOISER).is_file():  # a full fine-tune's checkpoint
        return ExportedWeights("checkpoint", str(p))
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        if (p / name).is_file():
            return ExportedWeights("lora", str(p / name))
    if (experts := _experts(p)) is not None:  # a run's lora/ of every expert
        return experts
    if any(p.glob("*/config.json")):  # model/: the denoiser folder inside
        return ExportedWeights("model", str(p))
    if (p / "config.json").is_file():  # model/<part>/
        return ExportedWeights("model", str(p.parent))
    raise FileNotFoundError(
        f"{path}: no trained weights found (expected a checkpoint folder, export/, lora/, "
        f"model/ or a .safetensors LoRA)"
    )
