"""load_image: hostile bytes from a user's folder -> a clean RGB image, or SkipImage with a reason.

Every input is built here in memory with PIL/numpy (no binary fixtures).
"""

from __future__ import annotations

import contextlib
import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from raytuner.preprocess.images import ImagePolicy, SkipImage, load_image

POLICY = ImagePolicy()
SMALL_OK = ImagePolicy(min_size=1)
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def noise(width: int = 128, height: int = 128) -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png(width: int, height: int, bit_depth: int, color_type: int, samples: list[int]) -> bytes:
    """A PNG written by hand (PIL cannot write 16-bit RGB); every pixel holds ``samples``."""
    fmt = ">" + ("H" if bit_depth == 16 else "B") * len(samples)
    row = b"\0" + struct.pack(fmt, *samples) * width
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def reason(data: bytes, policy: ImagePolicy = POLICY) -> str:
    with pytest.raises(SkipImage) as info:
        load_image(data, policy)
    return str(info.value)


def close(actual: tuple[int, ...], expected: tuple[int, ...], tolerance: int = 1) -> bool:
    return all(abs(a - e) <= tolerance for a, e in zip(actual, expected, strict=True))


# 1. empty, not an image, truncated -------------------------------------------------------------


def test_empty_file() -> None:
    assert reason(b"") == "empty file"


@pytest.mark.parametrize(
    "data",
    [
        b"a photo of a cat sitting on a red sofa\n",
        b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n",
        b"<svg xmlns='http://www.w3.org/2000/svg' width='100' height='100'/>",
        np.random.default_rng(1234).bytes(4096),
    ],
    ids=["text", "pdf", "svg", "random"],
)
def test_non_image_bytes_are_not_an_image(data: bytes) -> None:
    text = reason(data)
    assert text.startswith("not an image"), text
    assert repr(data[:8]) in text  # the user sees what the file starts with


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP"])
def test_image_cut_in_half_is_corrupt(fmt: str) -> None:
    data = encode(noise(), fmt)
    text = reason(data[: len(data) // 2])
    assert text.startswith("corrupt"), text
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_truncation_is_named_in_the_reason() -> None:
    data = encode(noise(), "PNG")
    assert "truncated" in reason(data[: len(data) // 2])


def test_damaged_header_is_corrupt_not_unknown() -> None:
    data = encode(noise(), "GIF")
    text = reason(data[:20])  # the GIF signature survives, the header does not
    assert text.startswith("corrupt") and "GIF" in text, text


# 2. the format comes from the content --------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "GIF", "WEBP"])
def test_format_is_detected_from_content_not_name(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / "holiday.jpg"  # the wrong extension for all of these
    path.write_bytes(encode(Image.new("RGB", (80, 80), (10, 200, 30)), fmt, lossless=True))
    image = load_image(path.read_bytes(), POLICY)
    assert image.getpixel((40, 40)) == (10, 200, 30)


# 3. colour modes -----------------------------------------------------------------------------


def test_rgb_keeps_exact_colours() -> None:
    image = load_image(encode(Image.new("RGB", (70, 70), (12, 34, 56)), "PNG"), POLICY)
    assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (70, 70), (12, 34, 56))


def test_grey_becomes_grey_rgb() -> None:
    image = load_image(encode(Image.new("L", (70, 70), 77), "PNG"), POLICY)
    assert image.getpixel((5, 5)) == (77, 77, 77)


def test_bilevel_becomes_black_and_white() -> None:
    bilevel = Image.new("1", (70, 70), 0)
    bilevel.paste(1, (35, 0, 70, 70))
    image = load_image(encode(bilevel, "PNG"), POLICY)
    assert image.getpixel((10, 10)) == (0, 0, 0)
    assert image.getpixel((60, 10)) == (255, 255, 255)


def test_palette_without_transparency() -> None:
    palette = Image.new("P", (70, 70), 1)
    palette.putpalette([*RED, *GREEN, *BLUE])
    assert load_image(encode(palette, "PNG"), POLICY).getpixel((3, 3)) == GREEN


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_transparent_index_becomes_background(fmt: str) -> None:
    palette = Image.new("P", (70, 70), 0)
    palette.putpalette([*RED, *GREEN, *BLUE])
    palette.paste(2, (35, 0, 70, 70))
    policy = ImagePolicy(background=(10, 20, 30))
    image = load_image(encode(palette, fmt, transparency=0), policy)
    assert image.getpixel((5, 5)) == (10, 20, 30)  # index 0 is transparent
    assert image.getpixel((60, 5)) == BLUE


def test_palette_with_partial_alpha_blends() -> None:
    palette = Image.new("P", (70, 70), 0)
    palette.putpalette([*RED, *GREEN])
    palette.paste(1, (35, 0, 70, 70))
    data = encode(palette, "PNG", transparency=bytes([128, 255]))  # tRNS: index 0 half opaque
    image = load_image(data, ImagePolicy(background=BLUE))
    assert close(image.getpixel((5, 5)), (128, 0, 127))
    assert image.getpixel((60, 5)) == GREEN


def rgba_strip(colour: tuple[int, int, int], mode: str = "RGBA") -> Image.Image:
    """Three columns of ``colour``: transparent, half transparent, opaque."""
    pixels = np.zeros((70, 90, 4), np.uint8)
    pixels[..., :3] = colour
    pixels[:, 30:60, 3] = 128
    pixels[:, 60:, 3] = 255
    rgba = Image.fromarray(pixels)
    return rgba if mode == "RGBA" else rgba.convert(mode)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF"])
def test_rgba_alpha_is_composited_onto_background(fmt: str) -> None:
    data = encode(rgba_strip(RED), fmt, lossless=True)
    image = load_image(data, ImagePolicy(background=BLUE))
    assert image.getpixel((10, 10)) == BLUE
    assert close(image.getpixel((40, 10)), (128, 0, 127))
    assert image.getpixel((80, 10)) == RED


def test_default_background_is_white() -> None:
    image = load_image(encode(rgba_strip(RED), "PNG"), POLICY)
    assert image.getpixel((10, 10)) == (255, 255, 255)
    assert close(image.getpixel((40, 10)), (255, 127, 127))


def test_grey_alpha_is_composited() -> None:
    data = encode(rgba_strip((200, 200, 200), "LA"), "PNG")
    image = load_image(data, ImagePolicy(background=(0, 0, 0)))
    assert image.getpixel((10, 10)) == (0, 0, 0)
    assert close(image.getpixel((40, 10)), (100, 100, 100))
    assert image.getpixel((80, 10)) == (200, 200, 200)


def test_palette_alpha_is_composited() -> None:
    palette = Image.new("P", (90, 70), 1)
    palette.putpalette([*RED, *GREEN])
    alpha = Image.new("L", (90, 70), 0)
    alpha.paste(255, (45, 0, 90, 70))
    pa = Image.merge("PA", (palette, alpha))
    image = load_image(encode(pa, "TIFF"), ImagePolicy(background=BLUE))
    assert image.getpixel((10, 10)) == BLUE
    assert image.getpixel((80, 10)) == GREEN


def test_rgb_with_transparent_colour_key() -> None:
    rgb = Image.new("RGB", (70, 70), RED)
    rgb.paste(GREEN, (35, 0, 70, 70))
    image = load_image(encode(rgb, "PNG", transparency=RED), ImagePolicy(background=BLUE))
    assert image.getpixel((5, 5)) == BLUE
    assert image.getpixel((60, 5)) == GREEN


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk_cyan_becomes_rgb_cyan(fmt: str) -> None:
    data = encode(Image.new("CMYK", (70, 70), (255, 0, 0, 0)), fmt)
    assert close(load_image(data, POLICY).getpixel((35, 35)), (0, 255, 255), tolerance=3)


def test_cmyk_black_becomes_black() -> None:
    data = encode(Image.new("CMYK", (70, 70), (0, 0, 0, 255)), "TIFF")
    assert load_image(data, POLICY).getpixel((1, 1)) == (0, 0, 0)


def sixteen_bit_grey() -> np.ndarray:
    """Columns of 65535, 32768, 257 and 0, 80 pixels wide each."""
    return np.repeat(np.array([[65535, 32768, 257, 0]], np.uint16), 80, axis=1).repeat(70, 0)


def assert_scaled_grey(image: Image.Image) -> None:
    values = [image.getpixel((x, 10)) for x in (10, 90, 170, 250)]
    assert values == [(255,) * 3, (128,) * 3, (1,) * 3, (0,) * 3]


def test_16bit_grey_png_is_scaled_not_clipped() -> None:
    data = encode(Image.fromarray(sixteen_bit_grey()), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    assert_scaled_grey(load_image(data, POLICY))


def test_16bit_big_endian_grey_tiff_is_scaled() -> None:
    big_endian = Image.frombytes("I;16B", (320, 70), sixteen_bit_grey().astype(">u2").tobytes())
    data = encode(big_endian, "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I;16B"
    assert_scaled_grey(load_image(data, POLICY))


def test_32bit_integer_grey_is_scaled() -> None:
    data = encode(Image.fromarray(sixteen_bit_grey()).convert("I"), "TIFF")
    assert Image.open(io.BytesIO(data)).mode == "I"
    assert_scaled_grey(load_image(data, POLICY))


def test_16bit_pgm_with_small_maxval_reaches_white() -> None:
    data = b"P5\n70 70\n1023\n" + np.full((70, 70), 1023, ">u2").tobytes()
    assert load_image(data, POLICY).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize(
    ("color_type", "samples", "expected"),
    [(2, [65535, 32768, 0], (255, 128, 0)), (6, [65535, 32768, 0, 65535], (255, 128, 0))],
    ids=["rgb16", "rgba16"],
)
def test_16bit_colour_png(color_type: int, samples: list[int], expected: tuple) -> None:
    image = load_image(png(70, 70, 16, color_type, samples), POLICY)
    assert close(image.getpixel((5, 5)), expected)


@pytest.mark.parametrize(
    ("values", "expected"),
    [([0.0, 0.5, 1.0], [0, 128, 255]), ([0.0, 100.0, 300.0], [0, 100, 255])],
    ids=["unit-range", "byte-range"],
)
def test_float_grey(values: list[float], expected: list[int]) -> None:
    pixels = np.repeat(np.array([values], np.float32), 30, axis=1).repeat(70, 0)
    image = load_image(encode(Image.fromarray(pixels), "TIFF"), POLICY)
    assert [image.getpixel((x, 5))[0] for x in (5, 35, 65)] == expected


def test_float_nan_becomes_black() -> None:
    pixels = np.full((70, 70), 0.5, np.float32)
    pixels[0, 0] = np.nan
    image = load_image(encode(Image.fromarray(pixels), "TIFF"), POLICY)
    assert image.getpixel((0, 0)) == (0, 0, 0)
    assert image.getpixel((1, 1)) == (128, 128, 128)


def test_lab_is_colour_managed_not_read_as_rgb() -> None:
    white = encode(Image.new("LAB", (70, 70), (255, 128, 128)), "TIFF")
    assert close(load_image(white, POLICY).getpixel((0, 0)), (255, 255, 255), tolerance=2)
    red = encode(Image.new("LAB", (70, 70), (136, 208, 195)), "TIFF")  # L=53 a=80 b=67
    r, g, b = load_image(red, POLICY).getpixel((0, 0))
    assert r > 230 and g < 40 and b < 40


# 4. EXIF orientation --------------------------------------------------------------------------


def red_left_blue_right() -> Image.Image:
    image = Image.new("RGB", (160, 120), BLUE)
    image.paste(RED, (0, 0, 80, 120))
    return image


def with_orientation(orientation: int) -> bytes:
    image = red_left_blue_right()
    exif = image.getexif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", exif=exif, quality=95)


@pytest.mark.parametrize(
    ("orientation", "size", "red_at", "blue_at"),
    [
        (1, (160, 120), (40, 60), (120, 60)),
        (3, (160, 120), (120, 60), (40, 60)),  # 180°: red moves to the right
        (6, (120, 160), (60, 40), (60, 120)),  # 90° clockwise: the left edge goes on top
        (8, (120, 160), (60, 120), (60, 40)),  # 90° counter-clockwise: left edge to the bottom
    ],
)
def test_exif_orientation_is_applied(orientation: int, size, red_at, blue_at) -> None:
    image = load_image(with_orientation(orientation), POLICY)
    assert image.size == size
    assert close(image.getpixel(red_at), RED, tolerance=8)
    assert close(image.getpixel(blue_at), BLUE, tolerance=8)


def exif_block(entries: list[tuple[int, int, int, bytes]]) -> bytes:
    """A little-endian EXIF block with inline values: (tag, type, count, 4-byte value)."""
    ifd = b"".join(struct.pack("<HHI4s", *entry) for entry in entries)
    return b"Exif\0\0II*\0\x08\0\0\0" + struct.pack("<H", len(entries)) + ifd + b"\0\0\0\0"


def test_garbage_exif_keeps_the_image_unrotated() -> None:
    data = encode(red_left_blue_right(), "JPEG", exif=b"Exif\0\0MM\0*\0\0\0\x08\0\x05\x01\x12")
    image = load_image(data, POLICY)
    assert image.size == (160, 120)
    assert close(image.getpixel((40, 60)), RED, tolerance=8)


def test_malformed_tag_next_to_orientation_still_rotates() -> None:
    # HalftoneHints (0x0141, a SHORT tag) holding ASCII: ImageOps.exif_transpose raises
    # struct.error when it rewrites the EXIF block; the orientation itself is fine.
    exif = exif_block([(0x0112, 3, 1, b"\x06\0\0\0"), (0x0141, 2, 4, b"sof\0")])
    image = load_image(encode(red_left_blue_right(), "JPEG", exif=exif), POLICY)
    assert image.size == (120, 160)
    assert close(image.getpixel((60, 40)), RED, tolerance=8)


def test_nonsense_orientation_value_is_ignored() -> None:
    image = load_image(with_orientation(42), POLICY)
    assert image.size == (160, 120)


# 5. decompression bombs -----------------------------------------------------------------------


def test_more_pixels_than_the_policy_allows_is_too_large() -> None:
    data = encode(Image.new("RGB", (100, 100)), "PNG")
    assert reason(data, ImagePolicy(max_pixels=1000, min_size=1)) == (
        "too large: 100x100 = 10000 pixels, the limit is 1000"
    )
    assert load_image(data, ImagePolicy(max_pixels=10_000, min_size=1)).size == (100, 100)


def test_bomb_header_is_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    # The header claims 50000x50000 pixels; there is no pixel data to decode at all.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # our limit must not rely on PIL's
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 50_000, 50_000, 8, 0, 0, 0, 0))
    data = (
        b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b"")
    )
    text = reason(data)
    assert text == "too large: 50000x50000 = 2500000000 pixels, the limit is 178956970"


def test_pil_bomb_error_becomes_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL refuses above 2000 in open()
    text = reason(encode(Image.new("RGB", (100, 100)), "PNG"))
    assert text.startswith("too large") and "10000 pixels" in text and "2000" in text


def test_pil_bomb_warning_does_not_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 6000)  # 10000 px: PIL warns, does not refuse
    data = encode(Image.new("RGB", (100, 100), RED), "PNG")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = load_image(data, POLICY)
    assert image.getpixel((0, 0)) == RED
    assert caught == []


# 6. too small ---------------------------------------------------------------------------------


def test_short_side_under_min_size_is_too_small() -> None:
    data = encode(Image.new("RGB", (300, 40)), "PNG")
    assert reason(data) == "too small: 300x40, the short side is under 64"


def test_min_size_is_inclusive() -> None:
    assert load_image(encode(Image.new("RGB", (64, 64)), "PNG"), POLICY).size == (64, 64)


def test_min_size_uses_the_upright_size() -> None:
    image = Image.new("RGB", (200, 50))
    exif = image.getexif()
    exif[0x0112] = 6
    data = encode(image, "JPEG", exif=exif)
    assert reason(data) == "too small: 50x200, the short side is under 64"


# 7. animations --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animation_gives_the_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (70, 70), RED), Image.new("RGB", (70, 70), BLUE)]
    data = encode(
        frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, lossless=True
    )
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    assert load_image(data, POLICY).getpixel((35, 35)) == RED


# 8. the returned image ------------------------------------------------------------------------


def test_result_is_loaded_rgb_and_independent() -> None:
    data = encode(Image.new("RGB", (70, 70), GREEN), "PNG")
    first = load_image(data, POLICY)
    assert first.mode == "RGB"
    assert not isinstance(first, ImageFile.ImageFile)  # a plain in-memory image, no file handle
    first.putpixel((0, 0), RED)  # writable, and changing it changes nothing else
    second = load_image(data, POLICY)
    assert second.getpixel((0, 0)) == GREEN
    assert first is not second


def test_pil_global_state_is_untouched() -> None:
    before = (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)
    for data in (b"", b"nope", encode(noise(), "JPEG")[:500], encode(noise(), "PNG")):
        with contextlib.suppress(SkipImage):
            load_image(data, ImagePolicy(max_pixels=100))
    assert before == (Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)


def test_policy_is_keyword_only_and_frozen() -> None:
    assert ImagePolicy() == ImagePolicy(
        max_pixels=178_956_970, min_size=64, background=(255, 255, 255)
    )
    with pytest.raises(TypeError):
        ImagePolicy(1000)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        POLICY.min_size = 1  # type: ignore[misc]


# 9. hostile input: only SkipImage ever escapes, and no warnings ------------------------------


def test_damaged_files_only_ever_raise_skip_image() -> None:
    rng = np.random.default_rng(7)
    small = noise(40, 30)
    originals = [
        encode(small, fmt) for fmt in ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP", "ICO")
    ] + [encode(Image.fromarray(sixteen_bit_grey()), "PNG"), encode(small.convert("CMYK"), "JPEG")]
    outcomes = {"ok": 0, "skipped": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for original in originals:
            for _ in range(40):
                data = bytearray(original[: rng.integers(1, len(original) + 1)])
                for _ in range(rng.integers(0, 4)):
                    data[rng.integers(0, len(data))] = rng.integers(0, 256)
                try:
                    assert load_image(bytes(data), SMALL_OK).mode == "RGB"
                    outcomes["ok"] += 1
                except SkipImage as e:
                    assert str(e)
                    outcomes["skipped"] += 1
    assert caught == []
    assert outcomes["ok"] > 0 and outcomes["skipped"] > 0
