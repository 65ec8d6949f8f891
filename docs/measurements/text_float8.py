"""The error ``preprocess.text_dtype = "float8"`` adds (docs/figures.md): each tiny family's text
features stored and read back in bfloat16 and in float8, against the float32 features; and a
tiny Flux training step (flow-matching loss and its gradient over the whole denoiser) on text
read back from each, against float32 text, with the same latents and draws.
Run: ``python docs/measurements/text_float8.py`` from the repository root."""

from __future__ import annotations

import torch

from raytuner.config import FlowObjective
from raytuner.data.tensors import cell_column, from_cell, ragged_cell_column
from raytuner.families import FAMILIES
from raytuner.families.parts import Source

CAPTIONS = [
    "a red circle on a blue background",
    "a photograph of a fox in the snow at dawn, soft light",
    "two cats",
    "",
    "an oil painting of a harbour with boats, ships and gulls over grey water",
    "ohwx person smiling, portrait, 85 mm",
]
TINY = Source("tiny")


def stored(tensor: torch.Tensor, dtype: str, ragged: bool) -> torch.Tensor:
    """``tensor`` written as the cache's cells in ``dtype`` and read back in float32 (ragged:
    each caption's rows alone, zero rows after them)."""
    if ragged:
        cells, shapes, _ = ragged_cell_column(tensor, dtype)
    else:
        cells, shape, _ = cell_column(tensor, dtype)
        shapes = [shape] * len(cells)
    out = torch.zeros_like(tensor, dtype=torch.float32)
    for i, (cell, shape) in enumerate(zip(cells, shapes, strict=True)):
        row = from_cell(cell.as_py(), 0, shape, dtype, torch.float32)
        out[i][tuple(slice(0, n) for n in shape)] = row
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def features() -> None:
    for name in sorted(FAMILIES):
        encoder = FAMILIES[name].text_encoder(TINY, "cpu")
        with torch.no_grad():
            text = encoder(CAPTIONS)
        ragged = getattr(encoder, "ragged", ())
        for key, tensor in text.items():
            if not tensor.is_floating_point() or "mask" in key:
                continue
            x = tensor.float()
            errors = {d: relative(stored(x, d, key in ragged), x) for d in ("bfloat16", "float8")}
            print(
                f"{name:8} {key:28} {list(x.shape[1:])!s:12} bfloat16 {errors['bfloat16']:.2e} "
                f"float8 {errors['float8']:.2e}"
            )


def step() -> None:
    family = FAMILIES["flux"]
    torch.manual_seed(0)
    pixels = torch.rand(len(CAPTIONS), 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents, _ = family.image_encoder(TINY, "cpu")(pixels * 2 - 1)
        text = family.text_encoder(TINY, "cpu")(CAPTIONS)
    denoiser = family.denoiser(TINY, "cpu")
    loss_fn = family.loss(TINY, FlowObjective())
    results = {}
    for dtype in ("float32", "bfloat16", "float8"):
        batch = {"latent": latents.float()}
        for key, tensor in text.items():
            batch[key] = tensor.float() if dtype == "float32" else stored(tensor, dtype, False)
        gens = [torch.Generator().manual_seed(i) for i in range(len(CAPTIONS))]
        denoiser.zero_grad()
        loss = loss_fn(denoiser, batch, gens).mean()
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in denoiser.parameters() if p.grad is not None])
        results[dtype] = (loss.item(), grad)
    base, grad = results["float32"]
    for dtype in ("bfloat16", "float8"):
        loss, g = results[dtype]
        print(
            f"tiny flux step, text in {dtype}: loss {loss:.6f} (float32 text {base:.6f}: "
            f"{(loss - base) / base:+.2e} relative), gradient {relative(g, grad):.2e} relative"
        )


if __name__ == "__main__":
    features()
    step()
