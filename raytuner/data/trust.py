"""What a rerun trusts of a file it lists without reading it, by the size and mtime the
committed datasets it shares folders with hold for it (``index.Located`` reads them): an
indexed file's content key (an image's, an edit pair's reference's), a clip's samples
(``clip_rows``: under its source's frame settings too), and a rejected file's. A listed file
whose size or mtime differs is read and hashed again.

A rejected file (the probe skipped it: no caption, empty, a clip of an image family; or the
decode refused it: corrupt, too small, a clip too short for its frame counts) is in no index.
Each dataset keeps its rejected files in a table of their own beside its index
(``rejected.parquet``, written before the manifest that names it, under ``datasets.<key>.
rejected``; none when the dataset has none): where each lies, its size and mtime, its content
key, and for a refusal of the decode the reason and the settings it was refused under
(``settings``, the decode's own text). A rerun gives an unchanged one its key unread, and its
refusal where the settings are the same, so it is neither read nor decoded again and starts no
encoder actor; its report category is the first run's. A changed one, or one under other
settings, is read again. The probe's own reasons (the caption, the listing's refusals) are
found again each run, from the caption files and the listing.

Bytes: about 90 a rejected file on disk (its key, path, size and mtime; the folder, reasons and
settings dictionary-encoded) and 650 held by a rerun: 100,000 files of which 5 % are bad give
5,000 rows, 0.45 MB of Parquet and 3 MB of memory; 10 %: 0.9 MB and 6 MB (measured with
``write_rejected`` and tracemalloc, 2026-11-27). The table grows only with bad files."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import pyarrow as pa

from raytuner.data import clip_rows, references

log = logging.getLogger(__name__)
REJECTED = "rejected.parquet"
REJECTED_SCHEMA = pa.schema(
    [
        ("source", pa.string()),  # its source folder (absolute, as the index's)
        ("path", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("key", pa.string()),  # its content hash ("": none was made, an empty file)
        ("failure", pa.string()),  # the decode's reason ("": the probe skipped it)
        ("settings", pa.string()),  # what the decode refused it under ("": read it again)
        ("clip", pa.string()),  # a clip's category of that refusal ("": an image)
    ]
)


class Rejected(NamedTuple):
    """A rejected file as its dataset's table remembers it (``REJECTED_SCHEMA``)."""

    size: int
    mtime_ns: int
    key: str
    failure: str
    settings: str
    clip: str


class Trusted:
    """The files of the committed indexes read so far, as a rerun's listing trusts them."""

    def __init__(self) -> None:
        # (source folder, path) -> (size, mtime_ns, key) of the committed indexes' rows
        self.listed: dict[tuple[str, str], tuple[int, int, str]] = {}
        # (source folder, path, frame settings) -> (size, mtime_ns, first sample key, samples)
        # of the committed clips, None where two indexes disagree (``clip_rows.take``)
        self.clips: dict[tuple, tuple[int, int, str, int] | None] = {}
        # (source folder, path) -> the rejected file, None where two datasets disagree
        self.rejected: dict[tuple[str, str], Rejected | None] = {}

    def index(self, slices: Iterable[list[dict]], record: list[dict] | None) -> Iterator:
        """Each slice of one committed index's rows, handed on once its files are taken in;
        ``record``: its dataset's ``sources_record`` (None: from before it, its clips are read
        again). Its clips are taken once the last slice is."""
        clips: dict[tuple, tuple] = {}
        for rows in slices:
            clip_rows.gather(rows, record, clips)
            for r in rows:
                self.listed[(r["source"], r["path"])] = (r["size"], r["mtime_ns"], r["key"])
                self.listed.update(references.listed(r))
            yield rows
        clip_rows.take(clips, self.clips)

    def take_rejected(self, version, entry: dict | None) -> None:
        """The rows of one dataset's rejected table (``entry``: its manifest entry; None: the
        dataset has none). One that cannot be read is warned of: its files are read again."""
        if entry is None:
            return
        try:
            table = version.read(entry["path"], columns=REJECTED_SCHEMA.names)
        except (OSError, KeyError, pa.ArrowInvalid) as e:
            log.warning("cache: rejected files' table unreadable (%s): probing them again", e)
            return
        columns = [table.column(name).to_pylist() for name in REJECTED_SCHEMA.names]
        for source, path, *fields in zip(*columns, strict=True):
            where, record = (source, path), Rejected(*fields)
            self.rejected[where] = record if self.rejected.get(where, record) == record else None


def write_rejected(version, run: str, rows: list[dict]) -> dict:
    """A dataset's rejected table of ``rows`` (each with ``REJECTED_SCHEMA``'s columns) written
    into its run folder ``run`` beside its index, atomically: ``{"rejected": its manifest
    entry}``; nothing (``{}``) for no rows."""
    if not rows:
        return {}
    table = pa.Table.from_pylist(rows, schema=REJECTED_SCHEMA)
    return {"rejected": version.write_table(f"{run}/{REJECTED}", table)}
