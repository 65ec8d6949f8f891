"""The row keys of the cache (its index and data files): an image's content key (its sha256)
and the keys derived from it, of its flipped latent and its loss masks, and a caption's text
row's key, alone or with an edit pair's references. Part of the cache format
(``data/cache.py``); kept apart as the one place that names rows."""

from __future__ import annotations

import hashlib

from raytuner.data.cache import MASK

ALPHA = "alpha"  # the mask source of an image's own alpha channel (``mask_key``)


def flip_key(key: str) -> str:
    """The row key of the latent of an image's mirror image (``data.flip``)."""
    return f"{key}:flip"


def mask_key(key: str, source: str) -> str:
    """The row key of an image's loss mask: made of its alpha channel (``source`` = ALPHA) or
    of a mask file (``source``: the file's sha256, so an edited mask is made again)."""
    return f"{key}:{MASK}:{source[:16]}"


def caption_key(caption: str) -> str:
    """A caption's key in the text files and the index: the sha256 of its UTF-8 text."""
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()


def pair_caption_key(caption: str, reference_keys) -> str:
    """The text row's key of a caption encoded with its edit pair's reference images (a family
    whose text encoder sees them, ``References.text``): the caption's key and a hash of the
    references' content keys in order. Another reference (or the same ones in another order)
    is another row; the same pair, one row."""
    joined = "\n".join(reference_keys).encode("utf-8")
    return f"{caption_key(caption)}:refs:{hashlib.sha256(joined).hexdigest()[:32]}"
