"""Turn the bytes of one file from a user's image folder into a clean RGB image, or refuse it.

Pure: no Ray, no file system. Every way a hostile file can fail ends in :class:`SkipImage`, whose
text is the reason shown in the preprocess report. PIL's global state (``MAX_IMAGE_PIXELS``,
``LOAD_TRUNCATED_IMAGES``) is never changed; the pixel limit is checked here from the header.
"""

from __future__ import annotations

import contextlib
import io
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import ExifTags, Image, ImageFile


class SkipImage(Exception):
    """The file cannot be used; str(exc) is the reason shown in the preprocess report."""


@dataclass(frozen=True, kw_only=True)
class ImagePolicy:
    """What ``load_image`` accepts."""

    max_pixels: int = 178_956_970  # decompression-bomb limit (stored width*height); refuse above
    min_size: int = 64  # refuse if min(width, height) after EXIF transpose < min_size
    background: tuple[int, int, int] = (255, 255, 255)  # alpha is composited onto this colour


# What PIL and its plugins raise on hostile data (UnidentifiedImageError is an OSError).
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    struct.error,
    ZeroDivisionError,
    OverflowError,
    RuntimeError,  # the AVIF decoder; also NotImplementedError, RecursionError
)
# Same mapping as PIL.ImageOps.exif_transpose (EXIF orientation -> transpose).
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_INT_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


def load_image(data: bytes, policy: ImagePolicy) -> Image.Image:
    """RGB image, EXIF orientation applied, first frame of animations. Raises SkipImage."""
    return load_with_alpha(data, policy)[0]


def load_with_alpha(data: bytes, policy: ImagePolicy) -> tuple[Image.Image, Image.Image | None]:
    """``load_image``, and the image's alpha channel (mode L, upright) when it has one (an
    alpha mode or a transparency colour); None otherwise."""
    with _decoded(data, policy) as upright:
        width, height = upright.size
        if min(width, height) < policy.min_size:
            short = f"the short side is under {policy.min_size}"
            raise SkipImage(f"too small: {width}x{height}, {short}")
        return _to_rgb(upright, policy.background), _alpha(upright)


def load_mask(data: bytes, policy: ImagePolicy) -> Image.Image:
    """A mask file as greyscale (mode L, upright: white trains, black is ignored), read with
    the image's limits. Raises SkipImage."""
    with _decoded(data, policy) as upright:
        try:
            if upright.mode in _INT_MODES or upright.mode == "F":
                return _scale_to_8bit(upright)
            return upright.convert("L")
        except (*_DECODE_ERRORS, ImportError) as e:
            raise SkipImage(f"unsupported colour mode {upright.mode}: {e}") from e


@contextlib.contextmanager
def _decoded(data: bytes, policy: ImagePolicy) -> Iterator[Image.Image]:
    """The file's first frame decoded within the pixel limit, EXIF orientation applied, while
    the file is open. PIL's warnings (DecompressionBombWarning, corrupt EXIF, ...) are dropped:
    the checks here decide instead. Raises SkipImage."""
    if not data:
        raise SkipImage("empty file")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _open(data) as image:
            yield _upright(image, policy.max_pixels)


def _upright(image: ImageFile.ImageFile, max_pixels: int) -> Image.Image:
    """The decoded first frame, within the pixel limit, EXIF orientation applied."""
    _check_pixels(image.size, max_pixels)
    _decode(image)
    return _apply_orientation(image)


def _alpha(image: Image.Image) -> Image.Image | None:
    """The alpha channel of an image that has one, as mode L; None otherwise."""
    if image.mode not in _ALPHA_MODES and "transparency" not in image.info:
        return None
    try:
        return image.convert("RGBA").getchannel("A")
    except (*_DECODE_ERRORS, ImportError):  # malformed transparency info: no alpha
        return None


def _open(data: bytes) -> ImageFile.ImageFile:
    try:
        return Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise SkipImage(_unidentified(data)) from None
    except Image.DecompressionBombError as e:
        raise SkipImage(f"too large: {e}") from e
    except _DECODE_ERRORS as e:
        raise SkipImage(f"corrupt: {e}") from e


def _unidentified(data: bytes) -> str:
    """Reason for bytes no plugin could open: damaged if some format claims the signature."""
    for name, (_, accept) in Image.OPEN.items():
        try:
            claimed = accept is not None and accept(data[:16])
        except _DECODE_ERRORS:
            claimed = False
        if claimed and not isinstance(claimed, str):  # a str is "plugin not installed"
            return f"corrupt: looks like {name} but cannot be read (truncated or damaged)"
    return f"not an image: unrecognised format (starts with {data[:8]!r})"


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise SkipImage(
            f"too large: {width}x{height} = {width * height} pixels, the limit is {max_pixels}"
        )


def _decode(image: ImageFile.ImageFile) -> None:
    """Decode the (first frame's) pixels now, so a truncated file fails here, not later."""
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise SkipImage(f"too large: {e}") from e
    except _DECODE_ERRORS as e:
        raise SkipImage(f"corrupt: {e}") from e


def _apply_orientation(image: Image.Image) -> Image.Image:
    """EXIF orientation like ImageOps.exif_transpose, without rewriting the EXIF block.

    exif_transpose re-serialises the remaining tags and raises on malformed ones; only the
    orientation matters here. Unreadable EXIF leaves the image as stored.
    """
    try:
        method = _TRANSPOSE.get(image.getexif().get(ExifTags.Base.Orientation, 1))
    except _DECODE_ERRORS:
        return image
    return image if method is None else image.transpose(method)


def _to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """A new, independent RGB image; alpha composited onto ``background``."""
    try:
        if image.mode in _INT_MODES or image.mode == "F":
            return _scale_to_8bit(image).convert("RGB")
        if image.mode in _ALPHA_MODES or "transparency" in image.info:
            return _composite(image, background)
        return image.convert("RGB")  # CMYK naively, YCbCr exactly, LAB through LittleCMS
    except (*_DECODE_ERRORS, ImportError) as e:  # ImportError: LAB on a Pillow without LittleCMS
        raise SkipImage(f"unsupported colour mode {image.mode}: {e}") from e


def _composite(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    try:
        rgba = image.convert("RGBA")
    except ValueError:  # malformed transparency info: keep the colours, drop the alpha
        return image.convert("RGB")
    base = Image.new("RGBA", rgba.size, (*background, 255))
    return Image.alpha_composite(base, rgba).convert("RGB")


def _scale_to_8bit(image: Image.Image) -> Image.Image:
    """Greyscale with more than 8 bits -> L, scaled rather than clipped (PIL clips at 255).

    Integer modes hold 16-bit values (PIL opens 16-bit PNG/TIFF/PGM this way): v / 257.
    Float images are taken as 0..1 when all finite values fit in it, else as 0..255.
    """
    values = np.asarray(image, dtype=np.float64)
    if image.mode == "F":
        finite = values[np.isfinite(values)]
        unit = finite.size > 0 and finite.max() <= 1.0
        values = np.nan_to_num(values * (255.0 if unit else 1.0), nan=0.0, posinf=255.0)
    else:
        values = np.clip(values, 0, 65535) / 257.0
    return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8))
