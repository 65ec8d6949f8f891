"""A dataset folder with good photos mixed with every kind of hostile file users have."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from raytuner.tools.demo_images import make_demo_images


def _png(image: Image.Image, path: Path, caption: str | None = "a photo", **save) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=save.pop("format", "PNG"), **save)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption)


def make_hostile(root: Path, outside: Path) -> dict[str, str]:
    """Write the folder; return {path: expected outcome} for every image-named file in it.

    Outcomes: "encoded", "duplicate", or "skipped:<words in the reason>".
    """
    make_demo_images(root, per_aspect=2)  # 6 good photos with captions
    expect = {str(p.relative_to(root)): "encoded" for p in root.rglob("*.png")}
    rgb = Image.new("RGB", (96, 80), (200, 30, 30))

    (root / "zero.png").write_bytes(b"")
    expect["zero.png"] = "skipped:empty file"
    (root / "notes.jpg").write_text("this is a text file with an image extension\n")
    expect["notes.jpg"] = "skipped:not an image"
    buf = io.BytesIO()
    rgb.save(buf, "PNG")
    (root / "truncated.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    expect["truncated.png"] = "skipped:truncated"
    _png(rgb, root / "lying extension.jpg")  # a PNG named .jpg
    expect["lying extension.jpg"] = "encoded"
    _png(Image.new("CMYK", (96, 96), (255, 0, 0, 0)), root / "cmyk.jpg", format="JPEG")
    expect["cmyk.jpg"] = "encoded"
    deep = Image.fromarray(np.full((80, 96), 40000, np.uint16))  # 16-bit greyscale
    _png(deep, root / "sixteen-bit.png")
    expect["sixteen-bit.png"] = "encoded"
    palette = Image.new("P", (96, 96), 0)
    palette.info["transparency"] = 0
    _png(palette, root / "palette-alpha.png", transparency=0)
    expect["palette-alpha.png"] = "encoded"
    _png(Image.new("RGBA", (96, 96), (0, 0, 255, 128)), root / "rgba.png")
    expect["rgba.png"] = "encoded"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: stored 128x80 becomes 80x128 (portrait)
    _png(
        Image.new("RGB", (128, 80), (0, 90, 0)), root / "exif-rotated.jpg", format="JPEG", exif=exif
    )
    expect["exif-rotated.jpg"] = "encoded"
    _png(Image.new("L", (3000, 2000), 0), root / "bomb.png")  # 6 Mpx > the test's 2 Mpx limit
    expect["bomb.png"] = "skipped:too large"
    _png(Image.new("RGB", (30, 30)), root / "tiny.png")
    expect["tiny.png"] = "skipped:too small"
    _png(Image.new("RGB", (600, 60)), root / "panorama.png")
    expect["panorama.png"] = "skipped:aspect ratio"
    frames = [Image.new("RGB", (96, 96), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(root / "animated.gif", save_all=True, append_images=frames[1:], duration=50)
    expect["animated.gif"] = "encoded"
    _png(rgb.rotate(90, expand=True), root / "no caption here.png", caption=None)
    expect["no caption here.png"] = "encoded"
    _png(Image.new("RGB", (96, 96), (5, 5, 5)), root / "empty-caption.png", caption="  \n")
    expect["empty-caption.png"] = "encoded"
    _png(Image.new("RGB", (96, 96), (9, 9, 9)), root / "latin1-caption.png")
    (root / "latin1-caption.txt").write_bytes("café crème".encode("latin-1"))
    expect["latin1-caption.png"] = "encoded"
    shutil.copy(root / "square" / "square_00.png", root / "square" / "zz copy.png")
    expect["square/zz copy.png"] = "duplicate"
    _png(
        Image.new("RGB", (96, 96), (1, 100, 200)),
        root / "日本 ü" / "写真 1.png",
        caption="unicode path",
    )
    expect["日本 ü/写真 1.png"] = "encoded"
    _png(Image.new("RGB", (96, 96), (1, 200, 100)), outside / "secret.png")
    os.symlink(outside / "secret.png", root / "escape.png")
    expect["escape.png"] = "skipped:symlink outside"
    for junk in (".hidden.png", "__MACOSX/._square_00.png", ".thumbnails/a.png"):
        _png(Image.new("RGB", (96, 96)), root / junk)  # never counted: not an input
    (root / "Thumbs.db").write_bytes(b"junk")
    return expect
