"""What a rerun trusts of a file it lists without reading it, by the size and mtime the
committed datasets it shares folders with hold for it (``index.Located`` reads them): an
indexed file's content key (an image's, an edit pair's reference's) and a clip's samples
(``clip_rows``: under its source's frame settings too). A listed file whose size or mtime
differs is read and hashed again."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from raytuner.data import clip_rows, references


class Trusted:
    """The files of the committed indexes read so far, as a rerun's listing trusts them."""

    def __init__(self) -> None:
        # (source folder, path) -> (size, mtime_ns, key) of the committed indexes' rows
        self.listed: dict[tuple[str, str], tuple[int, int, str]] = {}
        # (source folder, path, frame settings) -> (size, mtime_ns, first sample key, samples)
        # of the committed clips, None where two indexes disagree (``clip_rows.take``)
        self.clips: dict[tuple, tuple[int, int, str, int] | None] = {}

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
