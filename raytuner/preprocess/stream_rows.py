"""The rows of the preprocess stream (``preprocess/pipeline.py``): their kinds (the ``status``
column), the schema the decode step emits them in (``decode.probe_decode``) and the columns
the driver gets back of each listed file."""

from __future__ import annotations

import pyarrow as pa

# The row kinds of the stream (its ``status`` column).
ENCODE = "encode"  # decoded pixels: VAE-encode them
FAILED = "failed"  # the decode refused the file (``failure`` says why)
PROBED = "probed"  # nothing to encode: skipped at probe, already cached, or a duplicate above
TEXT = "text"  # a caption's text tensors, appended by the encoder
LATENT = "latent"  # an encoded latent (an image's or its mirror image's), appended by the encoder
MASK = "mask"  # an encoded loss mask, appended by the encoder
SHAPE = pa.list_(pa.int32())
# One row of the stream as ``decode.probe_decode`` emits it.
STREAM_SCHEMA = pa.schema(
    [
        ("source", pa.int32()),
        ("path", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("key", pa.string()),
        ("caption", pa.string()),
        ("caption_key", pa.string()),
        ("caption_from", pa.string()),
        ("reason", pa.string()),  # why the probe skipped the file ("" if it did not)
        ("status", pa.string()),  # ENCODE, FAILED or PROBED
        ("failure", pa.string()),  # why the decode refused it (FAILED rows)
        ("flip_key", pa.string()),  # the key of its flipped latent ("": its source flips none)
        ("mask_key", pa.string()),  # the key of its loss mask ("": none)
        ("alpha", pa.bool_()),  # its crop has transparency (an alpha mask can be made)
        ("clip", pa.string()),  # a clip's report category (clips.CLIP_CATEGORIES); "": an image
        ("frames", pa.int32()),  # a clip sample's frames (its frame bucket); 0: an image
        # the decode settings a FAILED row was refused under (``decode.refusal_settings``; "": a
        # refusal not of its bytes, an unreadable file: read again), remembered for a rerun
        ("settings", pa.string()),
        ("pixels", pa.binary()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_size", SHAPE),
        ("crop_top_left", SHAPE),
        ("flip_crop_top_left", SHAPE),  # the crop's corner in the mirror image
        ("mask", pa.binary()),  # the mask's pixels at the bucket's size (uint8), to encode
        # what the encoder makes of an ENCODE row: its latent, its flipped latent, its mask
        ("want_latent", pa.bool_()),
        ("want_flip", pa.bool_()),
        ("want_mask", pa.bool_()),
    ]
)
# What the driver gets back of each listed file (the encoder keeps only these of its rows).
PROBE_COLUMNS = STREAM_SCHEMA.names[: STREAM_SCHEMA.names.index("pixels")]
