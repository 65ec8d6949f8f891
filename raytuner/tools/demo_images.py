"""A small captioned image set drawn in code: shapes and colours at three aspect ratios."""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 70),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {"square": (96, 96), "landscape": (128, 80), "portrait": (80, 128)}


def _draw(shape: str, colour: tuple, background: tuple, size: tuple, rng: random.Random):
    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    w, h = size
    r = rng.randint(min(w, h) // 5, min(w, h) // 3)
    cx, cy = rng.randint(r, w - r), rng.randint(r, h - r)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return image


def make_demo_images(
    folder: str | Path, per_aspect: int = 8, seed: int = 0, scale: int = 1
) -> Path:
    """Write ``3 * per_aspect`` PNGs with same-stem .txt captions into ``folder``, ``scale``
    times the demo's sizes (11: about 1024 px, for full-size models)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    for aspect, size in SIZES.items():
        sub = folder / aspect
        sub.mkdir(exist_ok=True)
        for i in range(per_aspect):
            shape, colour = rng.choice(SHAPES), rng.choice(names)
            background = rng.choice([n for n in names if n != colour])
            side = (size[0] * scale, size[1] * scale)
            image = _draw(shape, COLOURS[colour], COLOURS[background], side, rng)
            stem = sub / f"{aspect}_{i:02d}"
            image.save(stem.with_suffix(".png"))
            stem.with_suffix(".txt").write_text(
                f"a {colour} {shape} on a {background} background, {aspect}\n"
            )
    return folder
