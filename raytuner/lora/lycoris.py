"""The LyCORIS layout of an adapter (``lora.kind = "lokr"`` / ``"loha"``, or a LoRA with
``lora.dora``): the tensor names ComfyUI's weight adapters read (``comfy/weight_adapter/``:
``lokr.py``, ``loha.py``, ``lora.py``) under a key per module that ComfyUI maps to the model's
weight, and the scale conventions they apply:

- LoKr: ``<key>.lokr_w1`` (or ``lokr_w1_a`` / ``lokr_w1_b``), ``lokr_w2`` (or ``lokr_w2_a`` /
  ``lokr_w2_b``); the delta ``w1 (x) w2`` reshaped to the weight, times ``alpha / rank`` (rank:
  the rows of ``w2_b``, else of ``w1_b``) where a factor is low-rank, times 1 where both are
  whole. peft scales by ``alpha / rank`` always: a LoKr with both factors whole has that scale
  folded into ``lokr_w1`` and no ``.alpha``.
- LoHa: ``<key>.hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b``, ``.alpha``; the delta
  ``(w1_a @ w1_b) * (w2_a @ w2_b)`` times ``alpha / rank`` (rank: the rows of ``hada_w1_b``).
- DoRA: ``<key>.lora_down.weight`` (A), ``lora_up.weight`` (B), ``.alpha`` and
  ``<key>.dora_scale`` of shape (out, 1, ...): ComfyUI's ``weight_decompose`` takes a scale whose
  first side is the weight's output rows as a per-row magnitude and divides by the *base*
  weight's row norm, where peft's ``lora_magnitude_vector`` m is divided by the row norm of the
  merged weight: the scale written is ``m x ||W|| / ||W + delta||`` (``dora_scales``), so that
  ComfyUI's weight is peft's.
"""

from __future__ import annotations

import torch

from raytuner.lora.kinds import ADAPTER_PARTS, MAGNITUDE

LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def grouped(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A peft adapter state -> {module: {tensor's own name (``lokr_w1``, ``lora_A``, ...):
    tensor}}, modules in order."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        parts = key.split(".")
        i = next(i for i, p in enumerate(parts) if p.startswith(ADAPTER_PARTS))
        out.setdefault(".".join(parts[:i]), {})[parts[i]] = value
    return out


def to_lycoris(
    state: dict[str, torch.Tensor],
    key_of,
    *,
    alpha: float,
    rank: int,
    dora_scale: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """A peft LoKr / LoHa / DoRA state (peft's scale ``alpha / rank``) -> LyCORIS tensors,
    each module under ``key_of(module)``; ``dora_scale``: each DoRA module's ComfyUI scale
    (``dora_scales``)."""
    out = {}
    for module, t in grouped(state).items():
        key = key_of(module)
        if "lokr_w1" in t or "lokr_w1_a" in t:
            t = {k: t[k] for k in LOKR if k in t}
            if "lokr_w1_a" in t or "lokr_w2_a" in t:
                out[f"{key}.alpha"] = torch.tensor(float(alpha))
            else:  # both whole: LyCORIS applies no scale, so peft's goes into w1
                t["lokr_w1"] = t["lokr_w1"] * (alpha / rank)
            out |= {f"{key}.{k}": v.contiguous() for k, v in t.items()}
        elif "hada_w1_a" in t:
            out |= {f"{key}.{k}": t[k].contiguous() for k in LOHA}
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
        else:
            out[f"{key}.lora_down.weight"] = t["lora_A"].contiguous()
            out[f"{key}.lora_up.weight"] = t["lora_B"].contiguous()
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
            if MAGNITUDE in t:
                out[f"{key}.dora_scale"] = dora_scale[module].contiguous()
    return out


def lora_delta(down: torch.Tensor, up: torch.Tensor, shape) -> torch.Tensor:
    """``up @ down`` as a weight of ``shape`` (a convolution's flattened)."""
    return (up.flatten(1).float() @ down.flatten(1).float()).reshape(shape)


def dora_scales(state: dict, weight_of, scale: float) -> dict:
    """Each DoRA module's ComfyUI ``dora_scale`` (out, 1, ...): ``m x ||W|| / ||W + scale x B
    A||`` per output row, from peft's magnitude m, its A and B (``state``) and the base weight W
    (``weight_of(module)``: the whole weight, asked for one module at a time, in order)."""
    out = {}
    for module, t in grouped(state).items():
        if MAGNITUDE not in t:
            continue
        w = weight_of(module).float()
        merged = w + scale * lora_delta(t["lora_A"], t["lora_B"], w.shape)
        rows = (w.shape[0],) + (1,) * (w.dim() - 1)
        base_norm = w.reshape(w.shape[0], -1).norm(dim=1)
        merged_norm = merged.reshape(w.shape[0], -1).norm(dim=1)
        m = t[MAGNITUDE].float().reshape(-1)
        out[module] = (m * base_norm / merged_norm).reshape(rows)
    return out
