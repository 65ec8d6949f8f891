"""A clip's samples in the cache: their row keys, and the clips the committed indexes hold, so
that a rerun trusts an unchanged clip by its size and mtime as it trusts an image, and never
reads it again (100,000 clips of 10 to 50 MB on S3: 1 to 5 TB a rerun would download).

A sample's key is the clip's content hash (hex, as an image's), what was taken of it (frame
count, selection, fps) and its place among the clip's samples. Which frame count a clip takes
depends on every frame count of its source (the largest its length gives), which the key does
not say: a committed clip is known under its source's frame settings as the dataset's sources
record has them (``datasets.frame_settings``), and trusted only under the same."""

from __future__ import annotations

from raytuner.data import datasets

CLIP = "clip"  # the second field of a sample key


def sample_key(content: str, frames: int, selection: str, fps: float, i: int) -> str:
    """The row key of a clip's ``i``-th sample: its content hash first (hex, as an image's)."""
    return f"{content}:{CLIP}:{frames}:{selection}:{fps:g}:{i}"


def content_of(key: str) -> str:
    """The clip's content hash in a sample key (an image key: itself)."""
    return key.split(":", 1)[0]


def frames_of(key: str) -> int:
    """The frame count a sample key's sample takes (its frame bucket)."""
    return int(key.split(":")[2])


def is_sample(key: str) -> bool:
    """Whether a latent row key is a clip sample's (not an image's, a flip's or a mask's)."""
    parts = key.split(":")
    return len(parts) == 6 and parts[1] == CLIP


def sample_keys(first: str, count: int) -> list[str]:
    """The keys of a clip's ``count`` samples, from its first sample's key."""
    stem = first.rsplit(":", 1)[0]
    return [f"{stem}:{i}" for i in range(count)]


def gather(rows: list[dict], record: list[dict] | None, into: dict) -> None:
    """Add the clip samples among committed index ``rows`` (of one index; ``record``: its
    dataset's ``sources_record``, None for an index from before it: its clips are read again)
    to ``into``: (source folder, path, frame settings) -> (size, mtime_ns, sample keys)."""
    if record is None:
        return
    settings = [datasets.frame_settings(s) for s in record]
    for r in rows:
        if not is_sample(r["key"]) or r["source_index"] >= len(settings):
            continue
        where = (r["source"], r["path"], settings[r["source_index"]])
        size, mtime, keys = into.setdefault(where, (r["size"], r["mtime_ns"], []))
        if (size, mtime) != (r["size"], r["mtime_ns"]):
            keys.append("")  # not one listing of one file: never trusted
        keys.append(r["key"])


def take(gathered: dict, held: dict) -> None:
    """Keep the clips of one index (``gather``) in ``held``: each with its samples in order,
    trusted when they are its whole run of samples (0 .. n - 1, one content and one setting)
    and no other index holds the clip otherwise (None: read again)."""
    for where, (size, mtime, keys) in gathered.items():
        value = None
        if all(keys):
            keys.sort(key=lambda k: int(k.rsplit(":", 1)[1]))
            if keys == sample_keys(keys[0], len(keys)):
                value = (size, mtime, keys[0], len(keys))
        if where in held and held[where] != value:
            value = None
        held[where] = value
